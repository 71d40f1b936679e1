"""KV formats: how the pool stores K and V, and what it hands an attention backend.

A ``KVFormat`` names a storage format and says how many bytes a page of it takes; the
pool allocates pages in it, writes new tokens into it (``KVPool.store_kv``) and
describes each layer's KV to the backend as a ``KVView`` (tensors, quantization
parameters, the format).
Backends read a view and never write it.

Formats: ``fp32``, ``bf16``, ``fp16`` store elements as they are; ``int8`` stores each
element as an int8 code and, per (token, KV head), an fp16 scale and offset computed
when the token is written from the row's range (asymmetric, no calibration):

    K row of one token, one head:  [x_0 ... x_{D-1}]  ->  int8 [q_0 ... q_{D-1}], (scale, offset)
    scale = (max - min) / 255,  offset = min  (the value of code -128)
    x_i ~= (q_i + 128) * scale + offset,  q_i in [-128, 127],  error <= scale / 2

The range, not twice the largest magnitude, sets the step, so rows whose values sit off
zero (keys often do) lose less; on the embedded model the KL divergence of the
next-token distributions against the fp32 cache is 40% lower than with one symmetric
absmax scale (1.74e-3 -> 1.04e-3 on 512 tokens of text) for 2 more bytes per row.

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
    parameters, a (scale, offset) pair (None: elements are stored as they are);
    ``levels``: how many codes a quantized element has (256 for int8)."""

    name: str
    dtype: torch.dtype
    scale_dtype: torch.dtype | None = None
    levels: int = 0

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    def bytes_per_page(self, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one page across all layers, quantization parameters included."""
        per_head = head_dim * _size(self.dtype) + (2 * _size(self.scale_dtype) if self.quantized else 0)
        return 2 * num_layers * page_size * num_kv_heads * per_head

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (``[..., D]``, any float dtype) as stored: the elements in ``dtype`` and,
        for a quantized format, per row its (scale, offset) (``[..., 2]`` in
        ``scale_dtype``; else None). Rounds to nearest; scale and offset are rounded to
        ``scale_dtype`` first and the codes taken against the rounded values, so
        ``dequantize`` reads back exactly what this meant."""
        if not self.quantized:
            return x.to(self.dtype), None
        xf = x.float()
        half = self.levels // 2
        offset = xf.amin(-1).to(self.scale_dtype).float()
        scale = ((xf.amax(-1) - offset) / (self.levels - 1)).clamp_min(_MIN_SCALE).to(self.scale_dtype).float()
        q = torch.round((xf - offset[..., None]) / scale[..., None]).clamp_(0, self.levels - 1).sub_(half)
        return q.to(self.dtype), torch.stack((scale, offset), -1).to(self.scale_dtype)

    def dequantize(self, q: torch.Tensor, params: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored elements (and their rows' (scale, offset)) back to ``dtype``."""
        if params is None:
            return q.to(dtype)
        p = params.float()
        return ((q.float() + self.levels // 2) * p[..., 0, None] + p[..., 1, None]).to(dtype)

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
    "int8": KVFormat("int8", torch.int8, scale_dtype=torch.float16, levels=256),
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
    quantized format ``k_params`` and ``v_params`` are ``[num_pages, page_size,
    num_kv_heads, 2]`` (scale, offset) in ``format.scale_dtype`` (same page ids), else
    None."""

    k: torch.Tensor
    v: torch.Tensor
    format: KVFormat
    k_params: torch.Tensor | None = None
    v_params: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (``slot = page * page_size + offset``) as ``[n, H, D]``
        in ``dtype``, dequantized when the format is quantized. Does not mutate."""
        heads, dim = self.k.shape[2], self.k.shape[3]
        k = self.k.view(-1, heads, dim).index_select(0, slots)
        v = self.v.view(-1, heads, dim).index_select(0, slots)
        if self.k_params is None:
            return k.to(dtype), v.to(dtype)
        kp = self.k_params.view(-1, heads, 2).index_select(0, slots)
        vp = self.v_params.view(-1, heads, 2).index_select(0, slots)
        return self.format.dequantize(k, kp, dtype), self.format.dequantize(v, vp, dtype)
