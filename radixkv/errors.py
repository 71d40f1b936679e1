"""Exceptions shared across radixkv."""


class OutOfPagesError(RuntimeError):
    """More KV pages were asked for than are free. Nothing was allocated."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"asked for {requested} pages but only {free} are free")
        self.requested = requested
        self.free = free


class IntegrityError(RuntimeError):
    """A cache invariant does not hold (a bug, never a user error)."""


class ModelLoadError(ValueError):
    """A model, tokenizer or template could not be loaded: the message names the file
    and what is wrong with it (missing, unsupported architecture or quantization)."""
