"""KV formats: how the pool stores K and V, and what it hands an attention backend.

A ``KVFormat`` names a storage format and says how many bytes a page of it takes; the
pool allocates pages in it, writes new tokens into it (``KVPool.store_kv``) and
describes each layer's KV to the backend as a ``KVView`` (tensors, scales, the format).
Backends read a view and never write it.

Formats: ``fp32``, ``bf16``, ``fp16`` store elements as they are; ``int8`` stores each
element as an int8 and one fp16 scale per (token, KV head), computed when the token is
written (``absmax / 127``; no calibration):

    K row of one token, one head:  [x_0 ... x_{D-1}]  ->  int8 [q_0 ... q_{D-1}], scale
    x_i ~= q_i * scale,  |x_i - q_i * scale| <= scale / 2

A page's bytes depend only on its own tokens, so equal prefixes give equal pages.

Names and aliases: ``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``,
``int8``; ``auto`` (in ``EngineConfig.kv_dtype`` and ``--kv-dtype``) means the weights'
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


_MIN_SCALE = 2.0**-14  # fp16's smallest normal: a row of zeros still gets a usable scale


@dataclass(frozen=True)
class KVFormat:
    """A storage format for K/V pages. ``dtype``: the element type of the page tensors;
    ``scale_dtype``: with a quantized format, the type of its per-(token, KV head)
    scales (None: elements are stored as they are); ``qmax``: the largest quantized
    magnitude."""

    name: str
    dtype: torch.dtype
    scale_dtype: torch.dtype | None = None
    qmax: int = 0

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    def bytes_per_page(self, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one page across all layers, scales included."""
        per_head = head_dim * _size(self.dtype) + (_size(self.scale_dtype) if self.quantized else 0)
        return 2 * num_layers * page_size * num_kv_heads * per_head

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (``[..., D]``, any float dtype) as stored: the elements in ``dtype`` and,
        for a quantized format, one scale per row (``[...]`` in ``scale_dtype``; else
        None). Rounds to nearest; the scale is rounded to ``scale_dtype`` first, so
        ``dequantize`` undoes exactly what this did."""
        if not self.quantized:
            return x.to(self.dtype), None
        xf = x.float()
        scale = (xf.abs().amax(-1) / self.qmax).clamp_min(_MIN_SCALE).to(self.scale_dtype)
        q = torch.round(xf / scale.float()[..., None]).clamp_(-self.qmax, self.qmax).to(self.dtype)
        return q, scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored elements (and their row scales) back to ``dtype``."""
        if scale is None:
            return q.to(dtype)
        return (q.float() * scale.float()[..., None]).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a backend reads it back after the pool stored it, in ``x.dtype``."""
        if not self.quantized and x.dtype == self.dtype:
            return x
        return self.dequantize(*self.quantize(x), x.dtype)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", torch.float32),
    "bf16": KVFormat("bf16", torch.bfloat16),
    "fp16": KVFormat("fp16", torch.float16),
    "int8": KVFormat("int8", torch.int8, scale_dtype=torch.float16, qmax=127),
}
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values() if not f.quantized}


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
    ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``format.dtype``; for a
    quantized format ``k_scale`` and ``v_scale`` are ``[num_pages, page_size,
    num_kv_heads]`` in ``format.scale_dtype`` (same page ids), else None."""

    k: torch.Tensor
    v: torch.Tensor
    format: KVFormat
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (``slot = page * page_size + offset``) as ``[n, H, D]``
        in ``dtype``, dequantized when the format is quantized. Does not mutate."""
        heads, dim = self.k.shape[2], self.k.shape[3]
        k = self.k.view(-1, heads, dim).index_select(0, slots)
        v = self.v.view(-1, heads, dim).index_select(0, slots)
        if self.k_scale is None:
            return k.to(dtype), v.to(dtype)
        ks = self.k_scale.view(-1, heads).index_select(0, slots)
        vs = self.v_scale.view(-1, heads).index_select(0, slots)
        return self.format.dequantize(k, ks, dtype), self.format.dequantize(v, vs, dtype)
