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


class FieldError(ValueError):
    """A value a caller gave is not allowed. ``field`` names it as radixkv's Python API
    spells it (the HTTP layer maps it to the request's ``param`` without reading the
    message); the message names the field, the allowed range and what came."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
