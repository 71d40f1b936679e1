"""radixkv: a local LLM serving runtime built around a radix-tree prefix cache."""

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name):
    # Lazy: `import radixkv` stays light (the cache simulator needs no model stack).
    if name in ("Engine", "EngineConfig"):
        from radixkv.engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from radixkv.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
