"""Quantized GGUF weights on the GPU, multiplied by a Triton kernel that dequantizes
tiles of them in registers (the GPU counterpart of ``weights.PackedMatrix``).

A ``TritonPackedMatrix`` holds one weight matrix ``[rows, cols]`` of a GGUF quantized
type (``weights.TYPES``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as planes,
decoded from the file's blocks once, on the CPU, then moved to the device:

- ``codes``: the values' integer codes in row order. 4-bit types (Q4_0, Q4_1, Q4_K):
  ``uint8 [rows, cols / 2]``, two to a byte, byte i holding value 2i in its low nibble
  and value 2i + 1 in its high one (GGUF's nibble orders are rearranged on load).
  Others: one byte per value, ``uint8 [rows, cols]`` (Q5_0, Q5_1, Q5_K: 5 bits; Q6_K:
  6 bits), ``int8`` for Q8_0.
- ``scales`` and, for the types with one (Q4_1, Q5_1, Q4_K, Q5_K), ``mins``: float32
  ``[rows, cols / group]``, one per group of 32 values (Q6_K: 16).

A value is ``scale * (code - offset)`` (offset 8 for Q4_0, 16 for Q5_0, 32 for Q6_K,
0 otherwise), plus ``min`` where the type has one. The K-quants' packed 6-bit (Q6_K:
8-bit) sub-scales are applied once, on load: ``scale = d * sc`` and ``min = -(dmin *
m)``, in float32 as ``gguf.quants.dequantize`` computes them, so ``dequantize()``
equals gguf's dequantization bit for bit, for every type. The planes are views into
one ``uint8`` buffer (``data``, each plane 128-byte aligned): ``data.numel()`` is the
matrix's bytes on the device (5 to 10 bits per value, against 4.5 to 8.5 in the
file: the K-quants' scales are unpacked and 5- and 6-bit codes take a byte).

``linear(x)`` computes ``x @ W.T`` with one kernel (``_qlinear``): each program takes
a tile of ``BLOCK_M`` tokens by ``BLOCK_N`` rows and loops over the columns in steps of
``BLOCK_K`` (a multiple of the group, dividing ``cols``: no column masks). A step loads
the rows' codes and their groups' scales (and mins), dequantizes the ``[BLOCK_N,
BLOCK_K]`` tile to float32 in registers and multiplies it with ``tl.dot`` into a
float32 accumulator: for half-precision ``x`` on a GPU, the tile rounded to ``x``'s
dtype (tensor cores); for float32 ``x`` (and for CPU tensors: the interpreter, which
computes bf16 dots wrongly) in IEEE float32. No dense copy of the matrix is ever made. The
kernel is the same whatever the batch (``dense`` is accepted and ignored), but a
token's result may depend on the tile size chosen for the call's token count.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from gguf.quants import Q4_K

from radixkv.kernels.weights import TYPES, row_bytes


class CodeLayout(NamedTuple):
    """How a type's planes hold its values (see the module docstring)."""

    nibbles: bool  # two 4-bit codes per byte (else one code per byte)
    group: int  # values per scale (and min)
    offset: int  # subtracted from each code
    has_min: bool
    signed: bool  # int8 codes (Q8_0)


LAYOUTS = {
    2: CodeLayout(True, 32, 8, False, False),  # Q4_0
    3: CodeLayout(True, 32, 0, True, False),  # Q4_1
    6: CodeLayout(False, 32, 16, False, False),  # Q5_0
    7: CodeLayout(False, 32, 0, True, False),  # Q5_1
    8: CodeLayout(False, 32, 0, False, True),  # Q8_0
    12: CodeLayout(True, 32, 0, True, False),  # Q4_K
    13: CodeLayout(False, 32, 0, True, False),  # Q5_K
    14: CodeLayout(False, 16, 32, False, False),  # Q6_K
}

ALIGN = 128  # bytes: where each plane starts in ``data``
DOT_TYPES = (torch.float32, torch.bfloat16, torch.float16)


class Tile(NamedTuple):
    """A launch of ``_qlinear``: tokens and weight rows per program, warps, pipeline stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# by the call's token count: up to DECODE_TOKENS (one tile of tl.dot's least height, 16) or more;
# benchmarks/bench_qlinear.py sweeps the alternatives on a GPU
TILES = {"decode": Tile(16, 64, 4, 3), "prefill": Tile(64, 64, 4, 3)}
DECODE_TOKENS = 16


def tile(tokens: int) -> Tile:
    """The launch ``linear`` uses for ``tokens`` rows of activations."""
    return TILES["decode" if tokens <= DECODE_TOKENS else "prefill"]


def block_k(cols: int) -> int:
    """Columns per loop step: the largest of 128, 64, 32 that divides ``cols`` (every
    type's row is a multiple of 32 values, so no step needs a column mask)."""
    return next(b for b in (128, 64, 32) if cols % b == 0)


@triton.jit
def _qlinear(
    x, codes, scales, mins, out, M, N,
    K: tl.constexpr, NIBBLES: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
    NATIVE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out [M, N] = x [M, K] @ W.T`` for one ``[BLOCK_M, BLOCK_N]`` tile (program ids:
    row tile, token tile), ``W`` dequantized from its planes ``BLOCK_K`` columns at a
    time. ``K`` is a constexpr: the interpreter cannot loop up to a runtime value, and a
    matrix's width never changes."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    if NIBBLES:
        STEP_BYTES: tl.constexpr = BLOCK_K // 2
    else:
        STEP_BYTES: tl.constexpr = BLOCK_K
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = (m < M)[:, None]
    n_mask = (n < N)[:, None]
    x_ptrs = x + m.to(tl.int64)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
    code_ptrs = codes + n.to(tl.int64)[:, None] * (STEP_BYTES * (K // BLOCK_K)) + tl.arange(0, STEP_BYTES)[None, :]
    group_offs = n.to(tl.int64)[:, None] * (K // GROUP) + tl.arange(0, GROUPS)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        packed = tl.load(code_ptrs + k * STEP_BYTES, mask=n_mask, other=0)
        if NIBBLES:  # byte i: value 2i low, 2i + 1 high
            packed = tl.interleave(packed & 15, packed >> 4)
        w = (packed.to(tl.int32) - OFFSET).to(tl.float32)
        scale = tl.load(scales + group_offs + k * GROUPS, mask=n_mask, other=0.0)
        w = tl.reshape(w, [BLOCK_N, GROUPS, GROUP]) * scale[:, :, None]
        if HAS_MIN:
            w = w + tl.load(mins + group_offs + k * GROUPS, mask=n_mask, other=0.0)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        xv = tl.load(x_ptrs + k * BLOCK_K, mask=m_mask, other=0.0)
        if NATIVE_DOT:
            acc = tl.dot(xv, tl.trans(w.to(xv.dtype)), acc)
        else:
            acc = tl.dot(xv.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    out_ptrs = out + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=m_mask & (n < N)[None, :])


def _half(field: np.ndarray) -> np.ndarray:
    """A 2-byte fp16 field of each block (``uint8 [blocks, 2]``) as float32 ``[blocks]``."""
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return qs & np.uint8(15), qs >> np.uint8(4)


def _bits(packed: np.ndarray, shifts: range, width: int) -> np.ndarray:
    """``(packed[..., None, j] >> s) & (2**width - 1)`` for each shift: ``[..., len(shifts), J]``."""
    s = np.array(shifts, dtype=packed.dtype).reshape(-1, 1)
    return ((packed[..., None, :] >> s) & packed.dtype.type(2**width - 1)).astype(np.uint8)


def _decode(type_id: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks ``uint8 [blocks, block_bytes]`` of ``type_id`` as (codes ``[blocks,
    values]`` in value order, one byte each; scales and mins (or None) float32
    ``[blocks, values / group]``), vectorized over all blocks."""
    n = b.shape[0]
    if type_id in (2, 3):  # Q4_0: d, 16 bytes; Q4_1: d, m, 16 bytes. Byte j: value j low, j + 16 high.
        head = 2 if type_id == 2 else 4
        codes = np.concatenate(_nibbles(b[:, head:]), axis=1)
        mins = _half(b[:, 2:4])[:, None] if type_id == 3 else None
        return codes, _half(b[:, :2])[:, None], mins
    if type_id in (6, 7):  # Q5_0: d, qh, qs; Q5_1: d, m, qh, qs. Value j's 5th bit: bit j of qh (little endian).
        head = 2 if type_id == 6 else 4
        qh = np.ascontiguousarray(b[:, head : head + 4]).view("<u4")[:, 0]
        high = _bits(qh[:, None], range(32), 1)[:, :, 0]
        codes = np.concatenate(_nibbles(b[:, head + 4 :]), axis=1) | (high << np.uint8(4))
        mins = _half(b[:, 2:4])[:, None] if type_id == 7 else None
        return codes, _half(b[:, :2])[:, None], mins
    if type_id == 8:  # Q8_0: d, 32 int8 codes
        return b[:, 2:].view(np.int8), _half(b[:, :2])[:, None], None
    if type_id in (12, 13):  # Q4_K: d, dmin, 12 bytes of sub-scales, 128 bytes; Q5_K: qh (32 bytes) before them
        sc, m = Q4_K.get_scale_min(b[:, 4:16])
        scales = _half(b[:, :2])[:, None] * sc.astype(np.float32)
        mins = -(_half(b[:, 2:4])[:, None] * m.astype(np.float32))
        qs = b[:, 16:] if type_id == 12 else b[:, 48:]
        # 64-value chunks of 32 bytes: low nibbles values 0..31, high nibbles 32..63
        codes = np.stack(_nibbles(qs.reshape(n, 4, 32)), axis=2).reshape(n, 256)
        if type_id == 13:  # value 32i + j's 5th bit: bit i of qh[j]
            codes |= _bits(b[:, 16:48], range(8), 1).reshape(n, 256) << np.uint8(4)
        return codes, scales, mins
    # Q6_K: ql (128 bytes), qh (64), 16 int8 sub-scales, d. Per half of 128 values: low
    # 4 bits from ql's 64 bytes (low nibbles values 0..63, high 64..127), the top 2 bits
    # from qh's 32 bytes (bits 2i..2i+1 of byte j: value 32i + j).
    low = np.stack(_nibbles(b[:, :128].reshape(n, 2, 64)), axis=2).reshape(n, 256)
    high = _bits(b[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 2).reshape(n, 256)
    scales = _half(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return low | (high << np.uint8(4)), scales, None


def _layout(type_id: int, rows: int, cols: int) -> list[tuple[int, int]]:
    """(byte offset, bytes) in ``data`` of the codes, scales and (where the type has
    them) mins planes."""
    layout = LAYOUTS[type_id]
    sizes = [rows * (cols // 2 if layout.nibbles else cols), rows * (cols // layout.group) * 4]
    if layout.has_min:
        sizes.append(sizes[1])
    spans, start = [], 0
    for size in sizes:
        spans.append((start, size))
        start = -(-(start + size) // ALIGN) * ALIGN
    return spans


class TritonPackedMatrix:
    """A ``[rows, cols]`` weight matrix in a GGUF quantized type, as code, scale and min
    planes on one device (CUDA, or the CPU for Triton's interpreter), multiplied in
    place by ``_qlinear``. Made by ``from_blocks`` (or ``stack``)."""

    def __init__(self, type_id: int, rows: int, cols: int, data: torch.Tensor):
        """``data``: the planes packed as ``_layout`` places them (``uint8``, on the
        matrix's device); the planes are views of it."""
        self.type_id = type_id
        self.cols = cols
        self.shape = (rows, cols)
        self.data = data
        self.layout = LAYOUTS[type_id]
        codes, scales, *mins = (data[start : start + size] for start, size in _layout(type_id, rows, cols))
        self.codes = (codes.view(torch.int8) if self.layout.signed else codes).view(rows, -1)
        self.scales = scales.view(torch.float32).view(rows, -1)
        self.mins = mins[0].view(torch.float32).view(rows, -1) if mins else None

    @classmethod
    def _from_planes(cls, type_id: int, cols: int, codes: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, device) -> TritonPackedMatrix:  # fmt: skip
        """Pack the planes (on one device) into one buffer, moved to ``device``."""
        rows = codes.shape[0]
        spans = _layout(type_id, rows, cols)
        data = torch.zeros(spans[-1][0] + spans[-1][1], dtype=torch.uint8, device=codes.device)
        for (start, size), plane in zip(spans, (codes, scales, mins)):
            data[start : start + size] = plane.contiguous().view(torch.uint8).reshape(-1)
        return cls(type_id, rows, cols, data.to(device))

    @classmethod
    def from_blocks(cls, type_id: int, blocks: torch.Tensor, cols: int, device) -> TritonPackedMatrix:
        """The matrix of GGUF blocks ``blocks`` (``uint8 [rows, row_bytes]``, the file's
        layout: a ``gguf.GGUFReader`` tensor's data with a row per matrix row) of ggml type
        ``type_id``, ``cols`` values a row, decoded on the CPU and moved to ``device``.
        ValueError for a type not in ``TYPES``, a width its blocks do not divide, or
        blocks of the wrong dtype or shape."""
        expected = row_bytes(type_id, cols)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
            raise ValueError(f"{TYPES[type_id][0]} blocks for {cols} columns must be uint8 [rows, {expected}], "
                             f"got {blocks.dtype} {list(blocks.shape)}")  # fmt: skip
        rows = blocks.shape[0]
        block_bytes = TYPES[type_id][2]
        raw = blocks.detach().cpu().contiguous().numpy().reshape(-1, block_bytes)
        codes, scales, mins = _decode(type_id, raw)
        codes = codes.reshape(rows, cols)
        if LAYOUTS[type_id].nibbles:  # byte i: value 2i low, 2i + 1 high
            codes = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
        codes, scales, mins = (None if p is None else torch.from_numpy(np.ascontiguousarray(p).reshape(rows, -1))
                               for p in (codes, scales, mins))  # fmt: skip
        return cls._from_planes(type_id, cols, codes, scales, mins, device)

    @property
    def type_name(self) -> str:
        return TYPES[self.type_id][0]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def paths_agree(self) -> bool:
        """True: ``linear`` has one path, whatever ``dense`` says."""
        return True

    def __repr__(self) -> str:
        return f"TritonPackedMatrix({self.type_name}, {list(self.shape)}, {self.device})"

    def _values(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
        """The float32 values ``[n, cols]`` of rows given by their planes."""
        n, group = codes.shape[0], self.layout.group
        if self.layout.nibbles:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).view(n, self.cols)
        w = (codes.to(torch.int32) - self.layout.offset).to(torch.float32).view(n, self.cols // group, group)
        w = w * scales[:, :, None]
        if mins is not None:
            w = w + mins[:, :, None]
        return w.view(n, self.cols)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 ``[rows, cols]`` on its device: equal, bit for bit,
        to ``gguf.quants.dequantize`` of the blocks it was made from."""
        return self._values(self.codes, self.scales, self.mins)

    def rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (every row when None) dequantized to float32 ``[len(ids), cols]`` on
        the matrix's device: an embedding lookup. IndexError for ids outside ``[0, rows)``."""
        if ids is None:
            return self.dequantize()
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if ids.numel() and bool(((ids < 0) | (ids >= self.shape[0])).any()):  # one sync where ids are on a GPU
            raise IndexError(f"row ids must be in [0, {self.shape[0]})")
        ids = ids.to(self.device)
        mins = None if self.mins is None else self.mins[ids]
        return self._values(self.codes[ids], self.scales[ids], mins)

    @staticmethod
    def stack(parts: list[TritonPackedMatrix]) -> TritonPackedMatrix | None:
        """One matrix of the parts' rows in order (their planes concatenated, on their
        device), or None when their types, widths or devices differ (the caller keeps them
        apart)."""
        first = parts[0]
        if any(p.type_id != first.type_id or p.cols != first.cols or p.device != first.device for p in parts):
            return None
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        codes = torch.cat([p.codes for p in parts])
        scales = torch.cat([p.scales for p in parts])
        return TritonPackedMatrix._from_planes(first.type_id, first.cols, codes, scales, mins, first.device)

    def linear(self, x: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
        """``x @ W.T`` for ``x [..., cols]`` (float32, bfloat16 or float16, on the matrix's
        device): ``[..., rows]`` in ``x``'s dtype, accumulated in float32. One kernel
        for any number of tokens; ``dense`` (``PackedMatrix``'s choice of path) is
        ignored. ValueError for another dtype, width or device."""
        if x.dtype not in DOT_TYPES or x.shape[-1] != self.cols or x.device != self.device:
            raise ValueError(f"input must be float32, bfloat16 or float16 [..., {self.cols}] on {self.device}, "
                             f"got {x.dtype} {list(x.shape)} on {x.device}")  # fmt: skip
        lead, rows = x.shape[:-1], self.shape[0]
        x2 = x.reshape(-1, self.cols).contiguous()
        tokens = x2.shape[0]
        out = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
        if tokens == 0:
            return out.view(*lead, rows)
        t = tile(tokens)
        mins = self.scales if self.mins is None else self.mins  # (unused without HAS_MIN)
        _qlinear[(triton.cdiv(rows, t.block_n), triton.cdiv(tokens, t.block_m))](
            x2, self.codes, self.scales, mins, out, tokens, rows,
            K=self.cols, NIBBLES=self.layout.nibbles, GROUP=self.layout.group, OFFSET=self.layout.offset,
            HAS_MIN=self.layout.has_min, NATIVE_DOT=x.is_cuda and x.dtype != torch.float32,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=block_k(self.cols), num_warps=t.warps, num_stages=t.stages,
        )  # fmt: skip
        return out.view(*lead, rows)
