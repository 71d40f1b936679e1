"""radixkv: a local LLM serving runtime built around a radix-tree prefix cache."""

__version__ = "0.1.0"

_FRONTEND = (
    "function", "gen", "select", "system", "user", "assistant", "assistant_begin", "assistant_end",
    "set_default_backend", "EngineBackend", "RuntimeEndpoint", "ProgramError", "ProgramState",
)  # fmt: skip
__all__ = ["Engine", "EngineConfig", "SamplingParams", *_FRONTEND]


def package_version() -> str:
    """The installed distribution's version (what ``radixkv --version`` prints), else
    ``__version__`` (a source tree on sys.path without an install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixkv")
    except PackageNotFoundError:
        return __version__


def __getattr__(name):
    # Lazy: `import radixkv` stays light (the cache simulator needs no model stack).
    if name in ("Engine", "EngineConfig"):
        from radixkv.engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from radixkv.engine.sampling import SamplingParams

        return SamplingParams
    if name in _FRONTEND:
        from radixkv import frontend

        return getattr(frontend, name)
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
