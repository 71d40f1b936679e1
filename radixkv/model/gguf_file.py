"""Reading GGUF files: metadata as plain Python values, tensors by name.

Thin wrapper over the ``gguf`` package's reader (memory-mapped, so opening a file
reads only its header). Shared by the weight loader, the tokenizer and the chat
template.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from radixkv.errors import ModelLoadError


@lru_cache(maxsize=4)
def open_gguf(path: str):
    """A ``gguf.GGUFReader`` for ``path`` (cached per path). Raises ModelLoadError if
    the file is missing or not GGUF."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None


def metadata(path: str | Path) -> dict:
    """All key-value metadata of a GGUF file as Python values (str, int, float, bool,
    or lists of them). Does not read tensor data."""
    reader = open_gguf(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}
