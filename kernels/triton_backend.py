"""Triton attention backend: paged decode (split-K) and extend kernels.

All kernels read K/V through the page table (``kv_indices``), for any page size, from
fp16/bf16/fp32 caches, int8 ones (``INT8_KV``) or int4 ones (``INT4_KV``), and
accumulate in float32. They read every position from the cache, the new tokens included
(the pool stored them before attention), so new tokens are attended to as stored: cache
on = cache off in any format. (int4 reads its own page's new tokens from the forward's
``k``/``v``, which are what the pool staged: see below.)

int8 (the ``int8`` format): codes c and, per (slot, KV head), a byte b naming the row's
scale (entry b of the format's ``log_scales`` table, which the kernels compute from b:
``_log_scale``); the stored row is ``y = c * scale``, the original ``x = y @ R^T``
(``R`` the format's rotation). The kernels read the codes in tiles and fold the scales
into the products (``q . y = scale * (q . c)``, ``sum p y = (p * scale) @ c``); nothing
is dequantized to memory. The rotation stays outside the kernels: ``q . x = (q @ R) .
y`` and ``sum p x = (sum p y) @ R^T``, so ``forward`` rotates the queries before and the
output (float32) back after them, two ``[T * Hq, D] x [D, D]`` matmuls per layer. On the GPU
(tensor-core dots) K's codes go to the dot as 8-bit values, read as a ``[D, BLOCK_N]``
tile so that the dot's reduced dimension is the contiguous one; V's, whose reduced
dimension (positions) is not, are turned into the queries' half dtype in registers first
(``_int8_to_half``, byte permutes rather than conversion instructions), because Triton
reads a transposed 8-bit operand from shared memory a byte at a time.

int4 (``int4``, ``int4_norot``; quantized on seal, see ``radixkv.cache.sealing``): a
sealed page holds 4-bit codes two to a byte (``[P, page_size, H, D / 2]``, the even
channel in the low nibble), K's (scale, offset) per channel of the page (``[P, H, D,
2]``) and V's per token (``[P, page_size, H, 2]``), both fp16; a stored element is
``code * scale + offset``. A query at position p reads the pages before its own page
(``p // page_size``) sealed, and its own page up to p in full precision:

    keys     |== pages before p's page: int4 codes, in tiles ==|== p's page: float32 rows ==|
    from        the pool (read in place)                          staging (cached tokens of the page)
                                                                  or this call's k/v (new tokens)

- Sealed tiles: the packed bytes ``[BLOCK_N, D / 2]`` are loaded once, split into their
  nibbles and interleaved back into channel order (``tl.interleave``); K's scale and
  offset are loaded per (page, channel) for the block's pages (a run of ``PARAM_RUN``
  positions shares a page) and applied to the code tile in registers; V's per-token
  scale is folded into the weights and its offset into one row sum (``sum_j p_j (c_j
  s_j + o_j) = (p * s) @ c + sum_j p_j o_j``). Nothing is dequantized to memory.
- Own page: a block that may hold a row's own page (``OWN``: the causal diagonal, and
  in decode the sequence's last page) also reads those positions' float32 rows, from
  the staging area (``Sealer.staging``: the page's staging slot) for tokens cached by
  an earlier forward and from ``k``/``v`` for this call's, and takes per (row, position)
  the sealed or the full-precision score and value. A page sealed by this call keeps its
  staging rows until the forward ends; a page written whole (or any page of size 1) has
  none, and all its positions are new.
- Rotation (``int4``): sealed rows are stored rotated (``y = x @ R``), staged rows and
  ``k``/``v`` are in the model's basis. As for int8, the kernels work in the stored
  basis, with queries rotated before and the output rotated back after; the few
  full-precision rows a block reads are turned into that basis as they are read (``x @
  R``, one ``[BLOCK_N, D] x [D, D]`` product for K and one for V, in ``OWN`` blocks only),
  so one accumulator and one copy of the queries serve both kinds of rows.
  ``int4_norot`` has no rotation anywhere.

- ``_decode_partial`` + ``_decode_reduce``: one new token per sequence. Each program
  takes one sequence, one KV head (with all query heads of its GQA group as the rows of
  a ``tl.dot``) and one slice of the context; slices are merged by their log-sum-exp in
  the reduce kernel. Splitting the context keeps a small batch over long contexts busy.
- ``_extend``: several new tokens per sequence. Each program takes a block of one
  sequence's new tokens, either for one query head or (``PACK_GQA``) for all query heads
  of one KV head packed into its rows, so K/V is read once per group. It streams its
  context (cached pages, then the new tokens the pool just stored): whole blocks
  before its first row (int4: before its first row's page) without any mask, then the
  causal diagonal masked; with a sliding window it starts at the first row's window.
  Scores are in log2 units (exp2).

Compiled, each program loops only over the context it needs (its split, or up to the
last position its rows may see). Under ``TRITON_INTERPRET=1`` a loop over any runtime
value fails with recent NumPy, so there the trip count is a constant (the batch's
longest context in blocks) and masks do the rest (int4: every block ``OWN``); both
variants share one block body. Page ids are widened to int64 before slot arithmetic.

``native_dot``: with a half-precision cache on a GPU, dot products take the cache dtype
(tensor cores), and with an int8 or int4 cache the queries' dtype when it is half
precision (int8 codes -128..127 and int4's V codes 0..15 convert exactly; int4's K tile,
codes with their page's parameters applied, is rounded to it, as the torch reference
rounds the rows it gathers; full-precision rows are rotated in tf32); otherwise (fp32
caches or queries, the CPU interpreter, which computes bf16 wrongly) operands are upcast
to fp32 and multiplied in IEEE fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixkv.cache.formats import SCALE_STEPS
from radixkv.kernels.base import AttentionBackend

_NEG_INF = tl.constexpr(float("-inf"))
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load(ptrs, mask, USE_MASK: tl.constexpr):
    """``tl.load``, masked (zeros elsewhere) only when ``USE_MASK``."""
    if USE_MASK:
        x = tl.load(ptrs, mask=mask, other=0)
    else:
        x = tl.load(ptrs)
    return x


# int8's scale bytes: b stands for 2 ** ((b - 128) / SCALE_STEPS) (the format's
# ``log_scales`` table). With b - 128 = 8 q + j that is 2 ** q * 2 ** (j / 8): the power of two
# is built in the exponent bits, the fraction is one of eight float32 constants, and their
# product is exact, so every entry equals the table's (tested) without reading it.
if SCALE_STEPS != 8:
    raise ImportError(f"the Triton int8 kernels are written for SCALE_STEPS = 8, not {SCALE_STEPS}")
_R1, _R2, _R3, _R4, _R5, _R6, _R7 = (tl.constexpr(2.0 ** (j / 8)) for j in range(1, 8))  # 2 ** (j / 8)


@triton.jit
def _log_scale(b):
    """The float32 scale a log-scale byte (uint8 tensor) stands for, computed, not looked up:
    a gather from a table would be one more dependent memory access per block."""
    b = b.to(tl.int32)
    j = b & 7
    root = tl.where(j < 4, tl.where(j < 2, tl.where(j == 0, 1.0, _R1), tl.where(j == 2, _R2, _R3)),
                    tl.where(j < 6, tl.where(j == 4, _R4, _R5), tl.where(j == 6, _R6, _R7)))  # fmt: skip
    power = (((b >> 3) - 16 + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** q, q = (b >> 3) - 16 in -16..15
    return root * power


# int8 codes to half precision without the conversion instructions (I2F, F2F), which an
# H100/H200 SM issues at a quarter of its integer and float rate: four codes at a time,
# bytes permuted into float bit patterns (PRMT), one subtraction each, as FasterTransformer
# converts 8-bit weights (and as Triton lowers an 8-bit dot operand it converts itself,
# K's here; what this one adds is where it runs, see _int8_to_half). bf16: c + 128 becomes the
# low byte of the float32 2^23 + (c + 128); minus 2^23 + 128 leaves c, exact in bf16's 8
# significant bits, so its upper half is c as a bf16. fp16: c + 128 becomes the low byte of
# the fp16 1024 + (c + 128); minus 1152 leaves c.
_I8_TO_BF16 = tl.constexpr("""{
.reg .b32 u, f0, f1, f2, f3;
xor.b32 u, $2, 0x80808080;
prmt.b32 f0, u, 0x4B000000, 0x7650;
prmt.b32 f1, u, 0x4B000000, 0x7651;
prmt.b32 f2, u, 0x4B000000, 0x7652;
prmt.b32 f3, u, 0x4B000000, 0x7653;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}""")
_I8_TO_FP16 = tl.constexpr("""{
.reg .b32 u, h0, h1, m;
xor.b32 u, $2, 0x80808080;
prmt.b32 h0, u, 0x64646464, 0x4140;
prmt.b32 h1, u, 0x64646464, 0x4342;
mov.b32 m, 0x64806480;
sub.f16x2 $0, h0, m;
sub.f16x2 $1, h1, m;
}""")


@triton.jit
def _int8_to_half(c, dtype: tl.constexpr):
    """int8 codes (a tensor) as ``dtype``, bf16 or fp16, exactly (GPU only: PTX). Not
    pure, so Triton keeps it where it is, before the tile goes through shared memory for
    the dot: the tile crosses as 16-bit values, which the transposed operand loads
    (``ldmatrix.trans``) take, where 8-bit ones would be read a byte at a time."""
    if dtype == tl.bfloat16:
        h = tl.inline_asm_elementwise(_I8_TO_BF16, "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        h = tl.inline_asm_elementwise(_I8_TO_FP16, "=r,=r,r", [c], dtype=tl.float16, is_pure=False, pack=4)
    return h


@triton.jit
def _mma(a, b, like, NATIVE_DOT: tl.constexpr):
    """``a @ b``: in ``like``'s (half-precision) dtype on tensor cores when ``NATIVE_DOT``,
    else in IEEE fp32."""
    if NATIVE_DOT:
        c = tl.dot(a.to(like.dtype), b.to(like.dtype))
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return c


@triton.jit
def _codes4(ptrs, mask, USE_MASK: tl.constexpr):
    """A tile of packed 4-bit codes (``[N, BLOCK_D / 2]`` bytes at ``ptrs``) as float32
    ``[N, BLOCK_D]`` in channel order: byte i holds channel 2i low, 2i + 1 high."""
    packed = _load(ptrs, mask, USE_MASK)
    return tl.interleave(packed & 15, packed >> 4).to(tl.float32)


@triton.jit
def _sealed4(
    caches, strides, kv_indices, page_start, start, slot, limit, kvh, d, dmask,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PARAM_RUN: tl.constexpr, USE_MASK: tl.constexpr,
):  # fmt: skip
    """Positions start..start+BLOCK_N (at ``slot``) of sealed int4 pages, those before
    ``limit`` (all when not ``USE_MASK``): K as float32 ``[BLOCK_N, BLOCK_D]`` (codes
    with their page's per-channel scale and offset applied, in registers), V's codes
    ``[BLOCK_N, BLOCK_D]`` and its per-token scale and offset ``[BLOCK_N]``; zeros
    for positions not read. K's parameters are loaded once per run of ``PARAM_RUN``
    positions in one page (``[BLOCK_N / PARAM_RUN, BLOCK_D]``)."""
    k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis = caches
    stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph, stride_fs, stride_fh = strides
    seal = start + tl.arange(0, BLOCK_N) < limit
    d2 = tl.arange(0, BLOCK_D // 2)
    cmask = seal[:, None] & (d2 < HEAD_DIM // 2)[None, :]
    coffs = slot[:, None] * stride_cs + kvh * stride_ch + d2[None, :]
    k = _codes4(k_cache + coffs, cmask, USE_MASK)
    v = _codes4(v_cache + coffs, cmask, USE_MASK)
    RUNS: tl.constexpr = BLOCK_N // PARAM_RUN
    run = start + tl.arange(0, RUNS) * PARAM_RUN
    run_seal = run < limit
    run_page = _load(kv_indices + page_start + run // PAGE_SIZE, run_seal, USE_MASK).to(tl.int64)
    pair = tl.arange(0, 2)  # parameters come as (scale, offset) pairs: loaded together, then split
    poffs = (run_page[:, None] * stride_kp + kvh * stride_kph + d[None, :] * 2)[:, :, None] + pair[None, None, :]
    pmask = (run_seal[:, None] & dmask[None, :])[:, :, None]
    k_scale, k_offset = tl.split(_load(k_params + poffs, pmask, USE_MASK).to(tl.float32))
    k = tl.reshape(k, [RUNS, PARAM_RUN, BLOCK_D]) * k_scale[:, None, :] + k_offset[:, None, :]
    voffs = (slot * stride_ps + kvh * stride_ph)[:, None] + pair[None, :]
    v_scale, v_offset = tl.split(_load(v_params + voffs, seal[:, None], USE_MASK).to(tl.float32))
    return tl.reshape(k, [BLOCK_N, BLOCK_D]), v, v_scale, v_offset


@triton.jit
def _own_rows(
    caches, strides, pos, page, own_lo, seq_len, new_start, tok0, kvh, d, dmask,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NATIVE_DOT: tl.constexpr, ROTATED: tl.constexpr,
):  # fmt: skip
    """The float32 K and V rows ``[BLOCK_N, BLOCK_D]`` of positions ``pos`` in
    ``[own_lo, seq_len)`` (zeros elsewhere), as a query in their page reads them: the
    tokens cached before ``new_start`` from their page's staging slot, this call's from
    ``k_new``/``v_new`` (token ``tok0 + pos``). ``ROTATED``: turned into the stored rows'
    basis (``x @ R``; ``basis`` holds ``M = R^T``, the format's ``row_map``)."""
    k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis = caches
    stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph, stride_fs, stride_fh = strides
    want = (pos >= own_lo) & (pos < seq_len)
    cached = want & (pos < new_start)
    stage_slot = tl.load(slot_of + page, mask=cached, other=-1)
    staged = cached & (stage_slot >= 0)
    fresh = want & (pos >= new_start)
    soffs = (stage_slot * PAGE_SIZE + pos % PAGE_SIZE)[:, None] * stride_fs + kvh * stride_fh + d[None, :]
    noffs = (tok0 + pos).to(tl.int64)[:, None] * stride_fs + kvh * stride_fh + d[None, :]
    smask = staged[:, None] & dmask[None, :]
    nmask = fresh[:, None] & dmask[None, :]
    k = tl.load(k_stage + soffs, mask=smask, other=0.0) + tl.load(k_new + noffs, mask=nmask, other=0.0).to(tl.float32)
    v = tl.load(v_stage + soffs, mask=smask, other=0.0) + tl.load(v_new + noffs, mask=nmask, other=0.0).to(tl.float32)
    if ROTATED:
        rot = tl.load(basis + d[None, :] * HEAD_DIM + d[:, None], mask=dmask[:, None] & dmask[None, :], other=0.0)  # R
        if NATIVE_DOT:
            k = tl.dot(k, rot, input_precision="tf32")
            v = tl.dot(v, rot, input_precision="tf32")
        else:
            k = tl.dot(k, rot, input_precision="ieee")
            v = tl.dot(v, rot, input_precision="ieee")
    return k, v


@triton.jit
def _attend_block(
    qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, start, seq_len, q_pos, new_start, tok0,
    scale, softcap, window, kvh, d, dmask,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, INT8_KV: tl.constexpr,
    INT4_KV: tl.constexpr, OWN: tl.constexpr, ROTATED: tl.constexpr, PARAM_RUN: tl.constexpr,
):  # fmt: skip
    """Fold context positions start..start+BLOCK_N into the online softmax of the query
    rows at positions ``q_pos`` (causal: a row sees positions <= its own).

    Scores are kept in log2 units (``scale`` times log2(e) folded in, ``exp2``), so
    ``m_i`` is a base-2 maximum. ``MASKED=False`` is for blocks every row sees whole
    (inside the sequence, before the first row's position, no window): no bounds, causal
    or -inf handling.

    ``caches``: the K/V caches, their parameters (``k_params``, ``v_params``), and
    int4's full-precision rows (``k_new``, ``v_new``, ``k_stage``, ``v_stage``,
    ``slot_of``) and ``basis``; ``strides``: the caches' per slot and
    head, the parameters' (V: per slot and head; int4's K: per page and head) and the
    full-precision rows' (per row and head, shared by staging and the new tokens).
    The new tokens are positions ``new_start`` on, token ``tok0 + pos`` of the forward.

    ``INT8_KV``: the caches hold int8 codes c and ``k_params``/``v_params`` a byte b per
    (slot, head); a stored element is ``c * _log_scale(b)``. The scales are folded in, never
    applied to a tile: ``q . y = scale * (q . c)`` and ``sum_j p_j y_j = (p * scale) @
    c``.

    ``INT4_KV``: pages before a row's own page are read sealed (``_sealed4``); with
    ``OWN`` (the block may hold a row's own page, whose positions it then reads in full
    precision, ``_own_rows``) each (row, position) takes one or the other. Without
    ``OWN`` every position is before every row's own page."""
    k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis = caches
    stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph, stride_fs, stride_fh = strides
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < seq_len  # (every position, unless MASKED)
    page = _load(kv_indices + page_start + pos // PAGE_SIZE, valid, MASKED).to(tl.int64)
    slot = page * PAGE_SIZE + pos % PAGE_SIZE
    if INT4_KV:
        # each row's own page starts at own_start (rows past the sequence: its last page)
        own_start = tl.minimum(q_pos, seq_len - 1) // PAGE_SIZE * PAGE_SIZE
        limit = seq_len  # positions read sealed: before the last row's own page
        if OWN:
            limit = tl.minimum(tl.max(own_start, 0), seq_len)
        k, v, v_scale, v_offset = _sealed4(
            caches, strides, kv_indices, page_start, start, slot, limit, kvh, d, dmask,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, PARAM_RUN, MASKED or not EVEN_D,
        )  # fmt: skip
        s = _mma(qv, tl.trans(k), qv, NATIVE_DOT)
        if OWN:
            k_full, v_full = _own_rows(
                caches, strides, pos, page, tl.min(own_start, 0), seq_len, new_start, tok0, kvh, d, dmask,
                PAGE_SIZE, HEAD_DIM, NATIVE_DOT, ROTATED,
            )  # fmt: skip
            own = pos[None, :] >= own_start[:, None]
            s = tl.where(own, _mma(qv, tl.trans(k_full), qv, NATIVE_DOT), s)
    else:
        offs = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        v = _load(v_cache + offs, kvmask, MASKED or not EVEN_D)
        if INT8_KV and NATIVE_DOT:
            v = _int8_to_half(v, qv.dtype)
        kt = _load(k_cache + tl.trans(offs), tl.trans(kvmask), MASKED or not EVEN_D)  # K^T: [BLOCK_D, BLOCK_N]
        s = _mma(qv, kt, qv, NATIVE_DOT)  # int8 codes -128..127 are exact in fp16 and bf16
        if INT8_KV:  # positions past the sequence read byte 0 (a valid entry), then weigh 0
            poffs = slot * stride_ps + kvh * stride_ph  # each position's scale byte
            k_scale = _log_scale(_load(k_params + poffs, valid, MASKED))
            v_scale = _log_scale(_load(v_params + poffs, valid, MASKED))
            s = s * k_scale[None, :]
    if USE_SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap)) * _LOG2E
    else:
        s = s * (scale * _LOG2E)
    if MASKED:
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, _NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if INT4_KV:
        if OWN:
            p_own = tl.where(own, p, 0.0)
            p = tl.where(own, 0.0, p)  # the weights of sealed positions
        # sum_j p_j (c_j s_j + o_j) = (p * s) @ c + sum_j p_j o_j; codes 0..15 are exact in fp16 and bf16
        pv = _mma(p * v_scale[None, :], v, qv, NATIVE_DOT) + tl.sum(p * v_offset[None, :], 1)[:, None]
        if OWN:
            pv += _mma(p_own, v_full, qv, NATIVE_DOT)
        acc = acc * alpha[:, None] + pv
    elif INT8_KV:
        acc = acc * alpha[:, None] + _mma(p * v_scale[None, :], v, qv, NATIVE_DOT)
    else:  # (native: the queries' dtype is the cache's)
        acc = acc * alpha[:, None] + _mma(p, v, qv, NATIVE_DOT)
    return m_new, l_i, acc


@triton.jit
def _decode_partial(
    q, k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis,
    kv_indptr, kv_indices, seq_lens, mid_o, mid_lse,
    scale, softcap, window, chunk,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph, stride_fs, stride_fh,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr, NUM_BLOCKS: tl.constexpr, INT8_KV: tl.constexpr,
    INT4_KV: tl.constexpr, ROTATED: tl.constexpr, PARAM_RUN: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens + b)
    page_start = tl.load(kv_indptr + b).to(tl.int64)
    hr = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + hr
    hmask = hr < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qv = tl.load(q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    if not NATIVE_DOT:
        qv = qv.to(tl.float32)
    m_i = tl.full([BLOCK_H], _NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = split * chunk
    q_pos = tl.zeros([BLOCK_H], tl.int32) + seq_len - 1
    caches = (k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis)
    strides = (stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph, stride_fs, stride_fh)
    new_start = seq_len - 1  # the one new token: token b of the forward
    tok0 = b - new_start
    even_d = BLOCK_D == HEAD_DIM
    if DYNAMIC_LOOP:
        end = tl.minimum(lo + chunk, seq_len)
        own = end
        if INT4_KV:  # blocks from the one holding the last page's start read it in full precision too
            own = tl.minimum(tl.maximum(new_start // PAGE_SIZE * PAGE_SIZE // BLOCK_N * BLOCK_N, lo), end)
        for start in range(lo, own, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, start, seq_len, q_pos, new_start, tok0,
                scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV, INT4_KV, False, ROTATED, PARAM_RUN,
            )  # fmt: skip
        for start in range(own, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, start, seq_len, q_pos, new_start, tok0,
                scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV, INT4_KV, INT4_KV, ROTATED, PARAM_RUN,
            )  # fmt: skip
    else:  # the interpreter: a constant trip count, masked
        for i in range(NUM_BLOCKS):
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, lo + i * BLOCK_N, seq_len, q_pos, new_start,
                tok0, scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV, INT4_KV, INT4_KV, ROTATED, PARAM_RUN,
            )  # fmt: skip
    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2, _NEG_INF)  # natural log
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    row = (b * num_q_heads + heads) * NUM_SPLITS + split
    tl.store(mid_o + row[:, None] * HEAD_DIM + d[None, :], out, mask=hmask[:, None] & dmask[None, :])
    tl.store(mid_lse + row, lse, mask=hmask)


@triton.jit
def _decode_reduce(
    mid_o, mid_lse, o, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    lse = tl.load(mid_lse + row * NUM_SPLITS + s, mask=smask, other=_NEG_INF)
    m = tl.max(lse, 0)
    w = tl.where(lse == _NEG_INF, 0.0, tl.exp(lse - m))
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    parts = tl.load(mid_o + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o + b * stride_ot + h * stride_oh + d, out.to(o.dtype.element_ty), mask=dmask)


@triton.jit
def _extend(
    q, o, k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis,
    qo_indptr, kv_indptr, kv_indices, seq_lens,
    scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_ps, stride_ph,
    stride_kp, stride_kph, stride_fs, stride_fh,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, PACK_GQA: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr, NUM_BLOCKS: tl.constexpr, INT8_KV: tl.constexpr,
    INT4_KV: tl.constexpr, ROTATED: tl.constexpr, PARAM_RUN: tl.constexpr,
):  # fmt: skip
    # Grid (heads, row blocks, sequences), heads fastest: programs running side by side
    # read the same sequence's K/V (from L2). Row blocks go last to first, so the ones
    # with the longest causal context start first.
    hid = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    qo_start = tl.load(qo_indptr + b)
    qo_len = tl.load(qo_indptr + b + 1) - qo_start
    seq_len = tl.load(seq_lens + b)
    page_start = tl.load(kv_indptr + b).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    if PACK_GQA:  # rows are (position, query head of this KV head's group) pairs
        kvh = hid
        heads = kvh * GROUP + r % GROUP
        qi = r // GROUP
        rows = mb * BLOCK_Q + qi
        rmask = (qi < BLOCK_Q) & (rows < qo_len)
    else:  # rows are positions of one query head
        kvh = hid // GROUP
        heads = hid + r * 0
        rows = mb * BLOCK_Q + r
        rmask = rows < qo_len
    q_pos = seq_len - qo_len + rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    tok = (qo_start + rows).to(tl.int64)
    qv = tl.load(q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    if not NATIVE_DOT:
        qv = qv.to(tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    caches = (k_cache, v_cache, k_params, v_params, k_new, v_new, k_stage, v_stage, slot_of, basis)
    strides = (stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph, stride_fs, stride_fh)
    new_start = seq_len - qo_len  # position new_start + i is token qo_start + i of the forward
    tok0 = qo_start - new_start
    even_d = BLOCK_D == HEAD_DIM
    if DYNAMIC_LOOP:
        # Positions before this block's first row are visible to every row (int4: those
        # before its page, read sealed by every row): whole blocks of them need no masks.
        # Then the diagonal, masked (int4: with the rows' own pages), up to the last row.
        first = seq_len - qo_len + mb * BLOCK_Q
        hi = tl.where(mb * BLOCK_Q < qo_len, tl.minimum(seq_len, first + BLOCK_Q), 0)  # 0: no rows here
        clean = first
        if INT4_KV:
            clean = first // PAGE_SIZE * PAGE_SIZE
        own = tl.minimum(clean // BLOCK_N * BLOCK_N, hi)
        if USE_WINDOW:  # nothing before the first row's window; every block masked
            lo = tl.minimum(tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N, own)
            full = lo
        else:
            lo = 0
            full = own
        for start in range(lo, full, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, start, seq_len, q_pos, new_start, tok0,
                scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, False, even_d, INT8_KV, INT4_KV, False, ROTATED, PARAM_RUN,
            )  # fmt: skip
        for start in range(full, own, BLOCK_N):  # (with a window)
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, start, seq_len, q_pos, new_start, tok0,
                scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV, INT4_KV, False, ROTATED, PARAM_RUN,
            )  # fmt: skip
        for start in range(own, hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, start, seq_len, q_pos, new_start, tok0,
                scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV, INT4_KV, INT4_KV, ROTATED, PARAM_RUN,
            )  # fmt: skip
    else:  # the interpreter: a constant trip count, masked
        for i in range(NUM_BLOCKS):
            m_i, l_i, acc = _attend_block(
                qv, m_i, l_i, acc, caches, strides, kv_indices, page_start, i * BLOCK_N, seq_len, q_pos, new_start,
                tok0, scale, softcap, window, kvh, d, dmask, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D,
                USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV, INT4_KV, INT4_KV, ROTATED, PARAM_RUN,
            )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(o.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])  # fmt: skip


@dataclass(frozen=True)
class DecodeTile:
    """How the decode kernel runs: context positions per loop step, warps, pipeline stages
    (1: none), and the most slices a sequence's context is split into."""

    block_n: int
    num_warps: int
    num_stages: int
    max_splits: int


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _param_run(page_size: int, block_n: int) -> int:
    """Positions of a block (aligned to ``block_n``) that share a page in runs of this
    many: int4 loads K's per-channel parameters once per run. 1 when neither of page
    size and block divides the other (a run per position)."""
    if page_size % block_n == 0 or block_n % page_size == 0:
        return min(page_size, block_n)
    return 1


def _kv_kind(kv) -> str | None:
    """How the kernels read ``kv``: None for elements stored as they are (fp32, fp16,
    bf16); ``"int8"``: int8 codes with a log-scale byte per (slot, KV head) beside them
    (``INT8_KV``); ``"int4"``: a paged format's sealed 4-bit pages with its staging
    area (``INT4_KV``). Raises ValueError for the other quantized formats (fp8 with
    per-head scales) and for layouts the kernels do not address."""
    fmt = kv.format
    if not fmt.quantized:
        return None
    params = (kv.k_params, kv.v_params)
    if (
        fmt.dtype == torch.int8
        and fmt.log_scale
        and all(p is not None and p.dtype == torch.uint8 for p in params)
        and kv.v_params.stride() == kv.k_params.stride()
        and kv.v.stride() == kv.k.stride()
    ):
        return "int8"
    if (
        fmt.paged
        and fmt.dtype == torch.uint8
        and fmt.levels == 16
        and kv.sealer is not None
        and all(p is not None and p.dtype == torch.float16 and p.is_contiguous() for p in params)
        and kv.k.is_contiguous()
        and kv.v.is_contiguous()
    ):
        return "int4"
    raise ValueError(f"attention_backend 'triton' cannot read {fmt.dtype} KV yet: use torch or cpu")


class TritonBackend(AttentionBackend):
    """Paged attention in Triton. ``plan`` builds the per-batch scalars and tensors once;
    each ``forward`` launches either the decode kernels or the extend kernel."""

    name = "triton"
    quantized_dtypes = frozenset({torch.int8, torch.uint8})  # the int8 format's pages and int4's (codes two to a byte)
    # decode: context positions per loop step, warps, pipeline stages and most splits of the
    # context, by the kind of pages read ("half": fp16/bf16; "int8"); the others (fp32, whose
    # tiles take twice the registers and shared memory, and int4) take DECODE. Measured on
    # an H200 (bench_attention, 2026-11-27, see RESULTS): bf16 pages 64 x 4 warps (0.255 ms
    # for 8 x 32k against 0.306 at 16); int8 pages 128 positions a step (the same bytes as
    # 64 bf16 rows) without software pipelining and in 32 splits. fp32 and int4: unmeasured.
    DECODE = DecodeTile(16, 4, 3, 16)
    DECODE_BY_KIND = {"half": DecodeTile(64, 4, 3, 16), "int8": DecodeTile(128, 4, 1, 32)}
    TOKENS_PER_SPLIT = 256  # aim: each decode program streams at least this much context
    # extend (BLOCK_M query rows, BLOCK_N context positions), warps, pipeline stages.
    # Half-precision KV on an H100 (bench_attention's extend problem, 2026-11-22, with
    # unmasked interior blocks and exp2): 128x64 packed 0.74 ms, per head 0.78; 128x32
    # 0.81, 64x32 0.94, 128x128 1.57; 8 warps or 2 stages slower (FlashInfer 0.57).
    # fp32 KV (IEEE dots) keeps small tiles: its operands are twice the registers.
    EXTEND_HALF = (128, 64)
    EXTEND_FP32 = (16, 16)
    EXTEND_WARPS = 4
    PACK_GQA = True  # extend rows hold all query heads of a KV head: K/V read once per group
    EXTEND_STAGES = 3

    def __init__(self):
        self.interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if self.interpret:  # the interpreter pays per program and per loop step, not per element
            self.DECODE = DecodeTile(64, 4, 3, 16)
            self.DECODE_BY_KIND = {}
            self.EXTEND_HALF = self.EXTEND_FP32 = (64, 64)

    def plan(self, batch) -> None:
        super().plan(batch)
        self.batch = batch
        self.seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=batch.kv_indices.device)
        self.max_seq_len = max(batch.seq_lens)
        self.max_qo_len = max(batch.qo_lens)
        self.decode = self.max_qo_len == 1
        self._decode_shapes: dict[DecodeTile, tuple[int, int]] = {}  # this batch's (splits, chunk) by tile

    def forward(self, q, k, v, kv, scale, sliding_window=None, logit_softcap=None):
        # The new tokens' K/V are read from ``kv`` (the pool stored them before this
        # call), never from ``k``/``v``: attended to as stored, int8 codes included.
        # int4 reads the new tokens of its queries' own pages from ``k``/``v``: what
        # its staging holds (or, for pages written whole, what sealed them).
        if self.mass:  # the observed sequences' attention mass, through the generic path (before q is rotated)
            self._observe(q, k, kv, scale, sliding_window, logit_softcap)
        batch = self.batch
        k_cache, v_cache = kv.k, kv.v
        _, hq, dim = q.shape
        hkv = k_cache.shape[2]
        page_size = k_cache.shape[1]
        group = hq // hkv
        q = q.contiguous()
        out_dtype = q.dtype
        kind = _kv_kind(kv)
        unrotate = kv.format.row_map(dim, q.device) if kind else None
        if unrotate is not None:  # q . (y M) = (q M^T) . y: queries into the stored rows' basis
            q = (q.float() @ unrotate.T).to(out_dtype)
        dot_dtype = q.dtype if kind else k_cache.dtype  # int8 and int4 codes are converted to the queries' dtype
        native = not self.interpret and dot_dtype in (torch.float16, torch.bfloat16) and q.dtype == dot_dtype
        flags = dict(
            USE_SOFTCAP=logit_softcap is not None, USE_WINDOW=sliding_window is not None, NATIVE_DOT=native,
            GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=dim, BLOCK_D=_pow2(dim),
            DYNAMIC_LOOP=not self.interpret, INT8_KV=kind == "int8", INT4_KV=kind == "int4",
            ROTATED=kind == "int4" and unrotate is not None,
        )  # fmt: skip
        softcap = float(logit_softcap or 1.0)
        window = int(sliding_window or 0)
        stride_cs, stride_ch = k_cache.stride(1), k_cache.stride(2)  # per slot, per head
        # unused by the kernels unless their format's flag is set: any pointer will do
        k_params, v_params = k_cache, v_cache
        k_new, v_new, k_stage, v_stage, slot_of, basis = k_cache, v_cache, k_cache, v_cache, k_cache, k_cache
        stride_ps = stride_ph = stride_kp = stride_kph = stride_fs = stride_fh = 0
        if kind == "int8":
            k_params, v_params = kv.k_params, kv.v_params
            stride_ps, stride_ph = k_params.stride(1), k_params.stride(2)
        elif kind == "int4":
            k_params, v_params = kv.k_params, kv.v_params
            stride_ps, stride_ph = v_params.stride(1), v_params.stride(2)  # V: per slot, per head
            stride_kp, stride_kph = k_params.stride(0), k_params.stride(1)  # K: per page, per head
            k_stage, v_stage, slot_of = kv.sealer.staging(kv.layer)  # [capacity, page_size, Hkv, D] float32
            if k_stage.numel() == 0:  # no staging slots: never read
                k_stage = v_stage = torch.zeros(1, device=q.device)
            # staging rows and the new tokens' ([T, Hkv, D]) alike: contiguous rows of Hkv * D
            k_stage, v_stage, k_new, v_new = (t.contiguous() for t in (k_stage, v_stage, k, v))
            stride_fs, stride_fh = hkv * dim, dim
            basis = unrotate if unrotate is not None else k_stage
        rows = (k_new, v_new, k_stage, v_stage, slot_of, basis)
        # rotated int8 or int4: the output is in the stored basis until multiplied back, in float32
        out = torch.empty_like(q) if unrotate is None else torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if self.decode:
            b = q.shape[0]
            tile = self.decode_tile(kind, k_cache.dtype)
            block_n, (splits, chunk) = tile.block_n, self._decode_shape(tile)
            mid_o = torch.empty(b * hq * splits, dim, dtype=torch.float32, device=q.device)
            mid_lse = torch.empty(b * hq * splits, dtype=torch.float32, device=q.device)
            _decode_partial[(b, hkv, splits)](
                q, k_cache, v_cache, k_params, v_params, *rows,
                batch.kv_indptr, batch.kv_indices, self.seq_lens, mid_o, mid_lse, scale, softcap, window, chunk,
                q.stride(0), q.stride(1), stride_cs, stride_ch, stride_ps, stride_ph, stride_kp, stride_kph,
                stride_fs, stride_fh,
                BLOCK_H=_pow2(group), BLOCK_N=block_n, NUM_SPLITS=splits,
                NUM_BLOCKS=self._static_blocks(chunk, block_n), PARAM_RUN=_param_run(page_size, block_n),
                **flags, num_warps=tile.num_warps, num_stages=tile.num_stages,
            )  # fmt: skip
            _decode_reduce[(b, hq)](
                mid_o, mid_lse, out, out.stride(0), out.stride(1),
                HEAD_DIM=dim, BLOCK_D=_pow2(dim), NUM_SPLITS=splits, BLOCK_S=_pow2(splits, 2),
            )  # fmt: skip
        else:
            block_m, block_n = self.EXTEND_HALF if native else self.EXTEND_FP32
            pack = self.PACK_GQA and group > 1 and block_m >= 2 * group
            block_q = block_m // group if pack else block_m
            grid = (hkv if pack else hq, triton.cdiv(self.max_qo_len, block_q), len(batch.qo_lens))
            _extend[grid](
                q, out, k_cache, v_cache, k_params, v_params, *rows,
                batch.qo_indptr, batch.kv_indptr, batch.kv_indices, self.seq_lens, scale, softcap, window,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_cs, stride_ch, stride_ps, stride_ph,
                stride_kp, stride_kph, stride_fs, stride_fh,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_Q=block_q, PACK_GQA=pack,
                NUM_BLOCKS=self._static_blocks(self.max_seq_len, block_n), PARAM_RUN=_param_run(page_size, block_n),
                **flags, num_warps=self.EXTEND_WARPS, num_stages=self.EXTEND_STAGES,
            )  # fmt: skip
        if unrotate is not None:  # sum p (y M) = (sum p y) M
            out = (out @ unrotate).to(out_dtype)
        return out

    def decode_tile(self, kind: str | None, cache_dtype: torch.dtype) -> DecodeTile:
        """The decode kernel's tile for pages of ``kind`` (``_kv_kind``; None: elements as
        stored, in ``cache_dtype``)."""
        half = kind is None and cache_dtype in (torch.float16, torch.bfloat16)
        return self.DECODE_BY_KIND.get("half" if half else kind, self.DECODE)

    def _decode_shape(self, tile: DecodeTile) -> tuple[int, int]:
        """This batch's decode split count and positions per split (whole blocks) with
        ``tile``: worked out once per batch, not in every layer's call."""
        shape = self._decode_shapes.get(tile)
        if shape is None:
            splits = self._splits(tile.max_splits)
            chunk = triton.cdiv(triton.cdiv(self.max_seq_len, splits), tile.block_n) * tile.block_n
            shape = self._decode_shapes[tile] = (splits, chunk)
        return shape

    def _splits(self, most: int) -> int:
        """Slices of the context per decode sequence: doubled up to ``most`` while each
        still streams ``TOKENS_PER_SPLIT`` positions or more."""
        splits = 1
        while splits < most and splits * self.TOKENS_PER_SPLIT < self.max_seq_len:
            splits *= 2
        return splits

    def _static_blocks(self, tokens: int, block: int) -> int:
        """Trip count for the interpreter's constant loops (1 when compiled: unused)."""
        return triton.cdiv(tokens, block) if self.interpret else 1
