"""KV formats: how the pool stores K and V, and what it hands an attention backend.

A ``KVFormat`` names a storage format and says how many bytes a page of it takes; the
pool allocates pages in it, writes new tokens into it (``KVPool.store_kv``) and
describes each layer's KV to the backend as a ``KVView`` (tensors plus the format).
Backends read a view and never write it. Today's formats store elements as they are
(fp32, bf16, fp16); a quantized format adds its scale arrays here and a reader in each
backend, nothing else.

Names and aliases: ``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``;
``auto`` (in ``EngineConfig.kv_dtype`` and ``--kv-dtype``) means the weights' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    """A storage format for K/V pages. ``dtype``: the element type of the page tensors."""

    name: str
    dtype: torch.dtype

    def bytes_per_page(self, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one page across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem


FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", torch.float32),
    "bf16": KVFormat("bf16", torch.bfloat16),
    "fp16": KVFormat("fp16", torch.float16),
}
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}


def kv_format(spec: str | torch.dtype | KVFormat, field: str = "kv_dtype") -> KVFormat:
    """The format named by ``spec`` (a name, an alias, a torch dtype or a format).

    Raises ValueError naming ``field`` and the known names."""
    if isinstance(spec, KVFormat):
        return spec
    if isinstance(spec, torch.dtype) and spec in _BY_DTYPE:
        return _BY_DTYPE[spec]
    if isinstance(spec, str) and ALIASES.get(spec, spec) in FORMATS:
        return FORMATS[ALIASES.get(spec, spec)]
    names = ", ".join([*FORMATS, *ALIASES])
    raise ValueError(f"{field} must be one of {names}, got {spec!r}")


@dataclass(frozen=True)
class KVView:
    """One layer's KV as a backend reads it: ``k`` and ``v`` are
    ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``format.dtype``."""

    k: torch.Tensor
    v: torch.Tensor
    format: KVFormat

    @property
    def page_size(self) -> int:
        return self.k.shape[1]
