"""radixkv: a local LLM serving runtime built around a radix-tree prefix cache."""

__version__ = "0.1.0"
