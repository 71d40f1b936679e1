"""KV formats: how the pool stores K and V, and what it hands an attention backend.

A ``KVFormat`` names a storage format and says how many bytes a page of it takes; the
pool allocates pages in it, writes new tokens into it (``KVPool.store_kv``) and
describes each layer's KV to the backend as a ``KVView`` (tensors, quantization
parameters, the format).
Backends read a view and never write it.

Formats: ``fp32``, ``bf16``, ``fp16`` store elements as they are; ``int8`` rotates each
K and V row by a fixed orthonormal matrix (``rotation``: Hadamard for power-of-two head
sizes), then stores each element as an int8 code and, per (token, KV head), one byte
``b`` naming the row's scale on a logarithmic grid, computed when the token is written
from the rotated row's largest magnitude (symmetric, no calibration):

    row of one token, one head:  x = [x_0 ... x_{D-1}],  y = x @ R  ->  int8 [q_0 ... q_{D-1}], b
    scale = 2 ** ((b - 128) / 8), the smallest on the grid with 127 * scale >= max |y_i|
    y_i ~= q_i * scale,  q_i in [-127, 127];  x ~= y @ R^T

One byte per row instead of an fp16 (scale, offset) pair makes a row of 64 elements 65
bytes instead of 68: 0.254x fp32, not 0.266x, so the same memory holds 3.94x fp32's
tokens instead of 3.76x, which is what a fixed-memory prefix cache turns into hit rate.
The grid's steps (2^(1/8), 9%) cost at most 9% of a row's resolution; the rotation
spreads a row's outlier channels over all of them, so its largest magnitude shrinks.
On the embedded model, 2k tokens of text against the fp32 cache: mean KL 4.2e-4 and
perplexity -0.00%, where an asymmetric fp16 (scale, offset) pair per row gave 3.3e-4
and +0.13% (and, without the rotation, 6.5e-4 and +0.28%).

A page's bytes depend only on its own tokens, so equal prefixes give equal pages.

``fp8_e4m3`` and ``fp8_e5m2`` store ``x / scale`` as an 8-bit float, with one fixed
scale per (layer, KV head) for K and one for V from a scale file (``KVScales``,
``load_kv_scales``); nothing is calibrated on the fly, and without a file nothing runs
unless told ``unity`` (every scale 1; e4m3 saturates beyond +-448).

A format's ``identity`` (name, scheme, scale file digest) is what a stored page's bytes
depend on besides the model and the tokens: pages of two identities never serve each
other.

Names and aliases: ``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``,
``int8``, ``fp8_e4m3``, ``fp8_e5m2``; ``auto`` (in ``EngineConfig.kv_dtype`` and ``--kv-dtype``) means the weights'
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


_MIN_SCALE = 2.0**-14  # fp16's smallest normal: a row of zeros still gets a usable scale
SCALE_STEPS = 8  # a log-scale byte b stands for 2 ** ((b - 128) / SCALE_STEPS): 2^-16 .. 2^15.9


@dataclass(frozen=True)
class KVFormat:
    """A storage format for K/V pages. ``dtype``: the element type of the page tensors;
    ``scale_dtype``: with a quantized format, the type of its per-(token, KV head)
    parameters (None: elements are stored as they are): one log-scale byte when
    ``log_scale`` (int8; ``log_scales``), else a (scale, offset) pair (int4's);
    ``levels``: how many codes a quantized element has (256 for int8);
    ``head_scaled``: elements are stored divided by a fixed scale per (layer, KV head)
    that comes from a scale file (``KVScales``; the fp8 formats); ``scheme``: what,
    besides the name, the stored bytes depend on (part of ``identity``)."""

    name: str
    dtype: torch.dtype
    scale_dtype: torch.dtype | None = None
    levels: int = 0
    head_scaled: bool = False
    scheme: str = ""
    rotated: bool = False  # rows are stored rotated by ``rotation(head_dim)`` (then quantized)
    paged: bool = False  # quantized a whole page at a time, when it fills ("on seal"; int4)
    log_scale: bool = False  # symmetric codes, a row's scale one byte on a log grid (int8)

    @property
    def row_params(self) -> int:
        """Parameters per (token, KV head) row: 1 (a log-scale byte), 2 (scale, offset),
        0 (none)."""
        return 0 if self.scale_dtype is None else 1 if self.log_scale else 2

    @property
    def quantized(self) -> bool:
        """Whether elements are codes read back through parameters (per row, or per
        head from a scale file): what only some backends read."""
        return self.scale_dtype is not None or self.head_scaled

    def check_scales(self, given: bool) -> None:
        """ValueError unless scales are given exactly when the format takes them (the
        fp8 formats: a scale file, or ``unity``)."""
        if self.head_scaled and not given:
            raise ValueError(f"kv_dtype {self.name} needs kv_scales: a JSON scale file (per layer and KV head, see "
                             f"README) or 'unity' (every scale 1; values beyond the format's range saturate)")  # fmt: skip
        if not self.head_scaled and given:
            raise ValueError(f"kv_scales applies to the fp8 KV formats only, not kv_dtype {self.name}")

    def identity(self, scales: KVScales | None = None) -> str:
        """What a stored page's bytes depend on besides its tokens and the model: the
        format, its scheme and, for a head-scaled format, the scale file's digest. Pages
        of different identities never serve each other (the key of every cache tier)."""
        parts = [self.name] + ([self.scheme] if self.scheme else [])
        if self.head_scaled:
            parts.append(f"scales={scales.digest if scales is not None else 'missing'}")
        return "/".join(parts)

    def bytes_per_page(self, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one page across all layers, quantization parameters included (a
        head-scaled format's per-layer scales are not per page)."""
        if self.paged:  # 4-bit codes; K: (scale, offset) per channel of the page, V: per token
            codes = 2 * page_size * head_dim // 2
            params = 2 * _size(self.scale_dtype) * (head_dim + page_size)
            return num_layers * num_kv_heads * (codes + params)
        per_head = head_dim * _size(self.dtype) + (self.row_params * _size(self.scale_dtype) if self.scale_dtype else 0)
        return 2 * num_layers * page_size * num_kv_heads * per_head

    # -- paged formats (int4): a whole page at a time ------------------------------------

    def quantize_pages(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Whole pages ``k``, ``v`` (``[P, page_size, H, D]``, any float dtype) as a paged
        format stores them (KIVI's layout): K's codes against a (scale, offset) per
        channel over the page's tokens (``[P, H, D, 2]``), V's per token (``[P,
        page_size, H, 2]``); codes two per byte (``[P, page_size, H, D / 2]`` uint8, the
        even channel in the low nibble). Rows are rotated first when ``rotated``.
        Returns (k codes, k params, v codes, v params)."""
        kc, kp = self._minmax_codes(self._rotate(k), 1)  # over the page's tokens: per channel
        vc, vp = self._minmax_codes(self._rotate(v), -1)  # over a row's channels: per token
        return _pack4(kc), kp, _pack4(vc), vp

    def dequantize_k_rows(self, codes: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K rows of a paged format: ``codes`` ``[n, H, D / 2]``, ``params`` their
        pages' per-channel (scale, offset) ``[n, H, D, 2]``."""
        p = params.float()
        return self._unrotate(_unpack4(codes).float() * p[..., 0] + p[..., 1], dtype)

    def dequantize_v_rows(self, codes: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """V rows of a paged format: ``codes`` ``[n, H, D / 2]``, ``params`` per row
        ``[n, H, 2]``."""
        p = params.float()
        return self._unrotate(_unpack4(codes).float() * p[..., 0, None] + p[..., 1, None], dtype)

    def _minmax_codes(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes 0..levels-1 of ``x`` against (scale, offset) = (range / (levels - 1),
        min) over ``dim`` (rounded to ``scale_dtype`` first); the params stacked last."""
        offset = x.amin(dim).to(self.scale_dtype).float()
        scale = ((x.amax(dim) - offset) / (self.levels - 1)).clamp_min(_MIN_SCALE).to(self.scale_dtype).float()
        codes = torch.round((x - offset.unsqueeze(dim)) / scale.unsqueeze(dim)).clamp_(0, self.levels - 1)
        return codes.to(torch.uint8), torch.stack((scale, offset), -1).to(self.scale_dtype)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows as float32, rotated when the format stores them rotated."""
        x = x.float()
        return x @ rotation(x.shape[-1], x.device) if self.rotated else x

    def _unrotate(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored (rotated) float32 rows back to the model's basis, in ``dtype``."""
        return (x @ self.row_map(x.shape[-1], x.device) if self.rotated else x).to(dtype)

    def quantize(self, x: torch.Tensor, head_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (``[..., H, D]``, any float dtype) as stored: the elements in ``dtype``
        and, for a format with per-row parameters, those of each row (``[..., H,
        row_params]`` in ``scale_dtype``; else None). Rounds to nearest against the
        stored parameters, so ``dequantize`` reads back exactly what this meant. A
        head-scaled format divides by ``head_scale`` (``[H]`` float32) and saturates at
        its largest finite value."""
        if self.head_scaled:
            top = torch.finfo(self.dtype).max
            return (x.float() / head_scale[:, None]).clamp_(-top, top).to(self.dtype), None
        if not self.quantized:
            return x.to(self.dtype), None
        y = self._rotate(x)
        if self.log_scale:
            step = y.abs().amax(-1) / (self.levels // 2 - 1)  # 127 * scale covers the row
            b = torch.ceil(torch.log2(step) * SCALE_STEPS).clamp_(-128, 127) + 128  # log2(0) = -inf: b = 0
            scale = _scale_table(x.device)[b.long()]
            codes = torch.round(y / scale[..., None]).clamp_(1 - self.levels // 2, self.levels // 2 - 1)
            return codes.to(self.dtype), b.to(self.scale_dtype)[..., None]
        codes, params = self._minmax_codes(y, -1)
        return (codes.to(torch.int16) - self.levels // 2).to(self.dtype), params

    def dequantize(self, q: torch.Tensor, params: torch.Tensor | None, dtype: torch.dtype,
                   head_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Stored elements (and their rows' parameters, or their heads' scales)
        back to ``dtype``."""
        if self.head_scaled:
            return (q.float() * head_scale[:, None]).to(dtype)
        if params is None:
            return q.to(dtype)
        if self.log_scale:
            return self._unrotate(q.float() * _scale_table(q.device)[params.long()], dtype)
        p = params.float()
        return self._unrotate((q.float() + self.levels // 2) * p[..., 0, None] + p[..., 1, None], dtype)

    def log_scales(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """With ``log_scale``, what each scale byte stands for: ``[256]`` float32, entry
        ``b`` = ``2 ** ((b - 128) / SCALE_STEPS)``, one table every reader looks its
        scales up in (so the torch path, the C kernel and Triton agree exactly); else
        None."""
        return _scale_table(device) if self.log_scale else None

    def row_map(self, dim: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """What a stored row (codes with their parameters applied) is multiplied by
        to read back: ``R^T`` (``[dim, dim]`` float32, contiguous) for a rotated format,
        None otherwise. A kernel that reads codes in place rotates its queries by it
        (``q . (y M) = (q M^T) . y``) and its weighted sums of V back with it."""
        if not self.rotated:
            return None
        key = (dim, str(device))
        if key not in _ROW_MAPS:
            _ROW_MAPS[key] = rotation(dim, device).T.contiguous()
        return _ROW_MAPS[key]

    def round_trip(self, x: torch.Tensor, head_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` as a backend reads it back after the pool stored it, in ``x.dtype``."""
        if not self.quantized and x.dtype == self.dtype:
            return x
        q, params = self.quantize(x, head_scale)
        return self.dequantize(q, params, x.dtype, head_scale)


_ROTATIONS: dict[tuple[int, str], torch.Tensor] = {}
_ROW_MAPS: dict[tuple[int, str], torch.Tensor] = {}
_SCALE_TABLES: dict[str, torch.Tensor] = {}


def _scale_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """``KVFormat.log_scales``' table on ``device``, computed once (in float64)."""
    key = str(device)
    if key not in _SCALE_TABLES:
        steps = (torch.arange(256, dtype=torch.float64) - 128) / SCALE_STEPS
        _SCALE_TABLES[key] = torch.exp2(steps).to(torch.float32).to(device)
    return _SCALE_TABLES[key]


def rotation(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fixed orthonormal ``[dim, dim]`` float32 matrix: the normalised Sylvester
    Hadamard matrix when ``dim`` is a power of two (symmetric, entries +-1/sqrt(dim)),
    else the Q of a QR decomposition of a Gaussian matrix from seed 0 (computed in
    float64 on the CPU, so every machine gets the same). A row ``x`` is stored as
    ``x @ R``: one outlier channel spreads over all channels, so a row's range, and its
    quantization step, shrink. Attention is unchanged (``(q R) . (k R) = q . k``)."""
    key = (dim, str(device))
    matrix = _ROTATIONS.get(key)
    if matrix is None:
        if dim & (dim - 1) == 0:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < dim:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            q = h / dim**0.5
        else:
            g = torch.randn(dim, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            q = torch.linalg.qr(g).Q
        matrix = _ROTATIONS[key] = q.to(torch.float32).to(device)
    return matrix


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[..., D]`` -> ``[..., D / 2]``, two per byte (even index low)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """``_pack4``'s inverse: ``[..., D / 2]`` -> ``[..., D]`` codes 0..15 (uint8)."""
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", torch.float32),
    "bf16": KVFormat("bf16", torch.bfloat16),
    "fp16": KVFormat("fp16", torch.float16),
    "int8": KVFormat("int8", torch.int8, scale_dtype=torch.uint8, levels=256, scheme="rot-row-absmax-log8",
                     rotated=True, log_scale=True),
    "int4": KVFormat("int4", torch.uint8, scale_dtype=torch.float16, levels=16, scheme="rot-kivi-page-fp16",
                     paged=True, rotated=True),
    "int4_norot": KVFormat("int4_norot", torch.uint8, scale_dtype=torch.float16, levels=16, scheme="kivi-page-fp16",
                           paged=True),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, head_scaled=True),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, head_scaled=True),
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


@dataclass(frozen=True, eq=False)
class KVScales:
    """Fixed per-(layer, KV head) scales of a head-scaled format (fp8): ``k`` and ``v``
    are ``[num_layers, num_kv_heads]`` float32, all positive and finite; an element is
    stored as ``x / scale``. ``digest`` names where they came from (``unity``, or the
    scale file's sha256), for the cache identity. Built by ``load_kv_scales``."""

    k: torch.Tensor
    v: torch.Tensor
    digest: str


UNITY = "unity"


def load_kv_scales(spec: str, num_layers: int, num_kv_heads: int, kv_dtype: str | None = None,
                   field: str = "kv_scales") -> KVScales:  # fmt: skip
    """Scales from ``spec``: ``"unity"`` (every scale 1: values beyond the format's
    range saturate) or a JSON file ``{"k_scale": [...], "v_scale": [...]}`` with one
    entry per layer, each a number (every KV head) or a list of ``num_kv_heads``
    numbers, and optionally ``"format"``, which must then be ``kv_dtype`` (scales made
    for e5m2's range would saturate e4m3). Raises ValueError naming ``field``, the
    file and what is wrong."""
    import hashlib
    import json
    import math
    from pathlib import Path

    if spec == UNITY:
        ones = torch.ones(num_layers, num_kv_heads)
        return KVScales(ones, ones.clone(), UNITY)
    try:
        raw = Path(spec).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: cannot read scale file {spec!r}: {e}") from None
    made_for = data.get("format") if isinstance(data, dict) else None
    if made_for is not None and kv_dtype is not None and made_for != kv_dtype:
        raise ValueError(f"{field}: {spec!r} holds scales for {made_for}, not kv_dtype {kv_dtype}")
    tensors = []
    for key in ("k_scale", "v_scale"):
        rows = data.get(key) if isinstance(data, dict) else None
        if not isinstance(rows, list) or len(rows) != num_layers:
            raise ValueError(f"{field}: {spec!r} needs {key!r}: a list of {num_layers} entries (one per layer)")
        table = []
        for i, row in enumerate(rows):
            row = [row] * num_kv_heads if isinstance(row, (int, float)) and not isinstance(row, bool) else row
            if not isinstance(row, list) or len(row) != num_kv_heads:
                raise ValueError(f"{field}: {spec!r} {key}[{i}] must be a number or {num_kv_heads} numbers")
            for x in row:
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
                    raise ValueError(f"{field}: {spec!r} {key}[{i}] must hold finite numbers > 0, got {x!r}")
            table.append([float(x) for x in row])
        tensors.append(torch.tensor(table, dtype=torch.float32))
    return KVScales(*tensors, "sha256:" + hashlib.sha256(raw).hexdigest()[:16])


@dataclass(frozen=True)
class KVView:
    """One layer's KV as a backend reads it: ``k`` and ``v`` are
    ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``format.dtype``; for a
    format with per-row parameters ``k_params`` and ``v_params`` are ``[num_pages,
    page_size, num_kv_heads, format.row_params]`` in ``format.scale_dtype`` (same page
    ids; int8: the log-scale byte), else None; for a head-scaled format ``k_scale`` and ``v_scale`` are this
    layer's ``[num_kv_heads]`` float32 scales, else None."""

    k: torch.Tensor
    v: torch.Tensor
    format: KVFormat
    k_params: torch.Tensor | None = None
    v_params: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    sealer: object = None  # a paged format's staging and sealing (radixkv.cache.sealing.Sealer)
    layer: int = 0

    def stored(self, x: torch.Tensor, part: str) -> torch.Tensor:
        """New tokens' K (``part="k"``) or V as this layer stores them and reads them
        back, in ``x.dtype``. Not for a paged format, whose rows read back depend on
        the page (``gather``, ``gather_own``)."""
        if self.format.paged:
            raise ValueError(f"{self.format.name} rows are read back through gather and gather_own")
        return self.format.round_trip(x, self.k_scale if part == "k" else self.v_scale)

    def gather_own(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A paged format's full-precision rows at ``slots`` (what queries in the same
        page read; see ``radixkv.cache.sealing``); zeros where there are none."""
        return self.sealer.gather_own(self.layer, slots, dtype)

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (``slot = page * page_size + offset``) as ``[n, H, D]``
        in ``dtype``, dequantized when the format is quantized. Does not mutate."""
        if self.sealer is not None:
            return self.sealer.gather(self.layer, slots, dtype)
        heads, dim = self.k.shape[2], self.k.shape[3]
        k = self.k.view(-1, heads, dim).index_select(0, slots)
        v = self.v.view(-1, heads, dim).index_select(0, slots)
        if self.format.head_scaled:
            return self.format.dequantize(k, None, dtype, self.k_scale), self.format.dequantize(v, None, dtype, self.v_scale)
        if self.k_params is None:
            return k.to(dtype), v.to(dtype)
        rows = (-1, heads, self.format.row_params)
        kp = self.k_params.view(rows).index_select(0, slots)
        vp = self.v_params.view(rows).index_select(0, slots)
        return self.format.dequantize(k, kp, dtype), self.format.dequantize(v, vp, dtype)
