"""Triton attention backend: paged decode (split-K) and extend kernels.

All kernels read K/V through the page table (``kv_indices``), for any page size, from
fp16/bf16/fp32 caches or int8 ones (``INT8_KV``), and accumulate in float32. They read
every position from the cache, the new tokens included (the pool stored them before
attention), so new tokens are attended to as stored: cache on = cache off in any format.

int8 (the ``int8`` format): codes c and, per (slot, KV head), a byte b naming the row's
scale (``scales[b]``, the format's ``log_scales`` table); the stored row is ``y = c *
scale``, the original ``x = y @ R^T`` (``R`` the format's rotation). The kernels read
the codes in tiles and fold the scales into the products (``q . y = scale * (q . c)``,
``sum p y = (p * scale) @ c``); nothing is dequantized to memory. The rotation stays outside the kernels: ``q . x = (q @ R) . y`` and
``sum p x = (sum p y) @ R^T``, so ``forward`` rotates the queries before and the output
(float32) back after them, two ``[T * Hq, D] x [D, D]`` matmuls per layer.

- ``_decode_partial`` + ``_decode_reduce``: one new token per sequence. Each program
  takes one sequence, one KV head (with all query heads of its GQA group as the rows of
  a ``tl.dot``) and one slice of the context; slices are merged by their log-sum-exp in
  the reduce kernel. Splitting the context keeps a small batch over long contexts busy.
- ``_extend``: several new tokens per sequence. Each program takes a block of one
  sequence's new tokens, either for one query head or (``PACK_GQA``) for all query heads
  of one KV head packed into its rows, so K/V is read once per group. It streams its
  context (cached pages, then the new tokens the pool just stored): whole blocks
  before its first row without any mask, then the causal diagonal masked; with a
  sliding window it starts at the first row's window. Scores are in log2 units (exp2).

Compiled, each program loops only over the context it needs (its split, or up to the
last position its rows may see). Under ``TRITON_INTERPRET=1`` a loop over any runtime
value fails with recent NumPy, so there the trip count is a constant (the batch's
longest context in blocks) and masks do the rest; both variants share one block body.
Page ids are widened to int64 before slot arithmetic.

``native_dot``: with a half-precision cache on a GPU, dot products take the cache dtype
(tensor cores), and with an int8 cache the queries' dtype when it is half precision
(codes -128..127 convert exactly); otherwise (fp32 caches or queries, the CPU
interpreter, which computes bf16 wrongly) operands are upcast to fp32 and multiplied in
IEEE fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixkv.kernels.base import AttentionBackend

_NEG_INF = tl.constexpr(float("-inf"))
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_block(
    qv, scales, k_cache, v_cache, k_params, v_params, kv_indices, page_start, start, seq_len, q_pos, m_i, l_i, acc,
    scale, softcap, window, stride_cs, stride_ch, stride_ps, stride_ph, kvh, d, dmask,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, INT8_KV: tl.constexpr,
):  # fmt: skip
    """Fold context positions start..start+BLOCK_N into the online softmax of the query
    rows at positions ``q_pos`` (causal: a row sees positions <= its own).

    Scores are kept in log2 units (``scale`` times log2(e) folded in, ``exp2``), so
    ``m_i`` is a base-2 maximum. ``MASKED=False`` is for blocks every row sees whole
    (inside the sequence, before the first row's position, no window): no bounds, causal
    or -inf handling.

    ``INT8_KV``: the caches hold int8 codes c and ``k_params``/``v_params`` a byte b per
    (slot, head); a stored element is ``c * scales[b]``. The scales are folded in, never
    applied to a tile: ``q . y = scale * (q . c)`` and ``sum_j p_j y_j = (p * scale) @
    c``."""
    pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = pos < seq_len
        page = tl.load(kv_indices + page_start + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        kvmask = valid[:, None] & dmask[None, :]
    else:
        page = tl.load(kv_indices + page_start + pos // PAGE_SIZE).to(tl.int64)
        kvmask = dmask[None, :]
    slot = page * PAGE_SIZE + pos % PAGE_SIZE
    offs = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
    if MASKED or not EVEN_D:
        k = tl.load(k_cache + offs, mask=kvmask, other=0.0)
        v = tl.load(v_cache + offs, mask=kvmask, other=0.0)
    else:
        k = tl.load(k_cache + offs)
        v = tl.load(v_cache + offs)
    if INT8_KV:
        poffs = slot * stride_ps + kvh * stride_ph  # each position's scale byte
        if MASKED:  # positions past the sequence read byte 0 (a valid entry), then weigh 0
            k_byte = tl.load(k_params + poffs, mask=valid, other=0)
            v_byte = tl.load(v_params + poffs, mask=valid, other=0)
        else:
            k_byte = tl.load(k_params + poffs)
            v_byte = tl.load(v_params + poffs)
        k_scale = tl.load(scales + k_byte.to(tl.int32))
        v_scale = tl.load(scales + v_byte.to(tl.int32))
        if NATIVE_DOT:  # codes -128..127 are exact in fp16 and bf16
            s = tl.dot(qv, tl.trans(k.to(qv.dtype)))
        else:
            s = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * k_scale[None, :]
    elif NATIVE_DOT:
        s = tl.dot(qv, tl.trans(k))
    else:
        s = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision="ieee")
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
    if INT8_KV:
        pv = p * v_scale[None, :]
        if NATIVE_DOT:
            pv = tl.dot(pv.to(qv.dtype), v.to(qv.dtype))
        else:
            pv = tl.dot(pv, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
    elif NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _decode_partial(
    q, k_cache, v_cache, k_params, v_params, scales, kv_indptr, kv_indices, seq_lens, mid_o, mid_lse,
    scale, softcap, window, chunk,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_ps, stride_ph,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr, NUM_BLOCKS: tl.constexpr, INT8_KV: tl.constexpr,
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
    if DYNAMIC_LOOP:
        for start in range(lo, tl.minimum(lo + chunk, seq_len), BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, scales, k_cache, v_cache, k_params, v_params, kv_indices, page_start, start, seq_len, q_pos,
                m_i, l_i, acc, scale, softcap, window, stride_cs, stride_ch, stride_ps, stride_ph, kvh, d, dmask,
                PAGE_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, BLOCK_D == HEAD_DIM, INT8_KV,
            )  # fmt: skip
    else:  # the interpreter: a constant trip count, masked
        for i in range(NUM_BLOCKS):
            m_i, l_i, acc = _attend_block(
                qv, scales, k_cache, v_cache, k_params, v_params, kv_indices, page_start, lo + i * BLOCK_N, seq_len,
                q_pos, m_i, l_i, acc, scale, softcap, window, stride_cs, stride_ch, stride_ps, stride_ph, kvh, d, dmask,
                PAGE_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, BLOCK_D == HEAD_DIM, INT8_KV,
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
    q, o, k_cache, v_cache, k_params, v_params, scales, qo_indptr, kv_indptr, kv_indices, seq_lens,
    scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_ps, stride_ph,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, PACK_GQA: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, NATIVE_DOT: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr, NUM_BLOCKS: tl.constexpr, INT8_KV: tl.constexpr,
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
    even_d = BLOCK_D == HEAD_DIM
    if DYNAMIC_LOOP:
        # Positions before this block's first row are visible to every row: whole
        # blocks of them need no masks. Then the diagonal, masked, up to the last row.
        first = seq_len - qo_len + mb * BLOCK_Q
        hi = tl.where(mb * BLOCK_Q < qo_len, tl.minimum(seq_len, first + BLOCK_Q), 0)  # 0: no rows here
        if USE_WINDOW:  # nothing before the first row's window; every block masked
            lo = tl.minimum(tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N, hi)
            full = lo
        else:
            lo = 0
            full = tl.minimum(first // BLOCK_N * BLOCK_N, hi)
        for start in range(lo, full, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, scales, k_cache, v_cache, k_params, v_params, kv_indices, page_start, start, seq_len, q_pos,
                m_i, l_i, acc, scale, softcap, window, stride_cs, stride_ch, stride_ps, stride_ph, kvh, d, dmask,
                PAGE_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, False, even_d, INT8_KV,
            )  # fmt: skip
        for start in range(full, hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                qv, scales, k_cache, v_cache, k_params, v_params, kv_indices, page_start, start, seq_len, q_pos,
                m_i, l_i, acc, scale, softcap, window, stride_cs, stride_ch, stride_ps, stride_ph, kvh, d, dmask,
                PAGE_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV,
            )  # fmt: skip
    else:  # the interpreter: a constant trip count, masked
        for i in range(NUM_BLOCKS):
            m_i, l_i, acc = _attend_block(
                qv, scales, k_cache, v_cache, k_params, v_params, kv_indices, page_start, i * BLOCK_N, seq_len, q_pos,
                m_i, l_i, acc, scale, softcap, window, stride_cs, stride_ch, stride_ps, stride_ph, kvh, d, dmask,
                PAGE_SIZE, BLOCK_N, USE_SOFTCAP, USE_WINDOW, NATIVE_DOT, True, even_d, INT8_KV,
            )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(o.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])  # fmt: skip


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _int8_kv(kv) -> bool:
    """Whether ``kv`` holds int8 codes with a log-scale byte per (slot, KV head) beside
    them (the ``int8`` format), which the kernels read with ``INT8_KV``; False
    for elements stored as they are (fp32, fp16, bf16). Raises ValueError for the other
    quantized formats (fp8 with per-head scales, int4 quantized per page)."""
    fmt = kv.format
    if not fmt.quantized:
        return False
    params = (kv.k_params, kv.v_params)
    if (
        fmt.dtype == torch.int8
        and fmt.log_scale
        and all(p is not None and p.dtype == torch.uint8 for p in params)
        and kv.v_params.stride() == kv.k_params.stride()
        and kv.v.stride() == kv.k.stride()
    ):
        return True
    raise ValueError(f"attention_backend 'triton' cannot read {fmt.dtype} KV yet: use torch or cpu")


class TritonBackend(AttentionBackend):
    """Paged attention in Triton. ``plan`` builds the per-batch scalars and tensors once;
    each ``forward`` launches either the decode kernels or the extend kernel."""

    name = "triton"
    quantized_dtypes = frozenset({torch.int8})  # the int8 format's pages; fp8 and int4 are refused
    BLOCK_N = 16  # decode: context positions per loop step
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
    MAX_SPLITS = 16
    TOKENS_PER_SPLIT = 256  # aim: each decode program streams at least this much context

    def __init__(self):
        self.interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if self.interpret:  # the interpreter pays per program and per loop step, not per element
            self.BLOCK_N = 64
            self.EXTEND_HALF = self.EXTEND_FP32 = (64, 64)

    def plan(self, batch) -> None:
        self.batch = batch
        self.seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=batch.kv_indices.device)
        self.max_seq_len = max(batch.seq_lens)
        self.max_qo_len = max(batch.qo_lens)
        self.decode = self.max_qo_len == 1
        splits = 1
        while splits < self.MAX_SPLITS and splits * self.TOKENS_PER_SPLIT < self.max_seq_len:
            splits *= 2
        self.num_splits = splits
        per_split = -(-self.max_seq_len // splits)
        self.chunk = -(-per_split // self.BLOCK_N) * self.BLOCK_N

    def forward(self, q, k, v, kv, scale, sliding_window=None, logit_softcap=None):
        # The new tokens' K/V are read from ``kv`` (the pool stored them before this
        # call), never from ``k``/``v``: attended to as stored, int8 codes included.
        batch = self.batch
        k_cache, v_cache = kv.k, kv.v
        _, hq, dim = q.shape
        hkv = k_cache.shape[2]
        group = hq // hkv
        q = q.contiguous()
        out_dtype = q.dtype
        int8 = _int8_kv(kv)
        unrotate = kv.format.row_map(dim, q.device) if int8 else None
        if unrotate is not None:  # q . (y M) = (q M^T) . y: queries into the stored rows' basis
            q = (q.float() @ unrotate.T).to(out_dtype)
        dot_dtype = q.dtype if int8 else k_cache.dtype  # int8 codes are converted to the queries' dtype
        native = not self.interpret and dot_dtype in (torch.float16, torch.bfloat16) and q.dtype == dot_dtype
        flags = dict(
            USE_SOFTCAP=logit_softcap is not None, USE_WINDOW=sliding_window is not None, NATIVE_DOT=native,
            GROUP=group, PAGE_SIZE=k_cache.shape[1], HEAD_DIM=dim, BLOCK_D=_pow2(dim),
            DYNAMIC_LOOP=not self.interpret, INT8_KV=int8,
        )  # fmt: skip
        softcap = float(logit_softcap or 1.0)
        window = int(sliding_window or 0)
        stride_cs, stride_ch = k_cache.stride(1), k_cache.stride(2)  # per slot, per head
        if int8:
            k_params, v_params, scales = kv.k_params, kv.v_params, kv.format.log_scales(q.device)
            stride_ps, stride_ph = k_params.stride(1), k_params.stride(2)
        else:  # unused by the kernels
            k_params, v_params, scales, stride_ps, stride_ph = k_cache, v_cache, k_cache, 0, 0
        # rotated int8: the output is in the stored basis until multiplied back, in float32
        out = torch.empty_like(q) if unrotate is None else torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if self.decode:
            b = q.shape[0]
            mid_o = torch.empty(b * hq * self.num_splits, dim, dtype=torch.float32, device=q.device)
            mid_lse = torch.empty(b * hq * self.num_splits, dtype=torch.float32, device=q.device)
            _decode_partial[(b, hkv, self.num_splits)](
                q, k_cache, v_cache, k_params, v_params, scales, batch.kv_indptr, batch.kv_indices, self.seq_lens,
                mid_o, mid_lse, scale, softcap, window, self.chunk,
                q.stride(0), q.stride(1), stride_cs, stride_ch, stride_ps, stride_ph,
                BLOCK_H=_pow2(group), BLOCK_N=self.BLOCK_N, NUM_SPLITS=self.num_splits,
                NUM_BLOCKS=self._static_blocks(self.chunk, self.BLOCK_N), **flags,
            )  # fmt: skip
            _decode_reduce[(b, hq)](
                mid_o, mid_lse, out, out.stride(0), out.stride(1),
                HEAD_DIM=dim, BLOCK_D=_pow2(dim), NUM_SPLITS=self.num_splits, BLOCK_S=_pow2(self.num_splits, 2),
            )  # fmt: skip
        else:
            block_m, block_n = self.EXTEND_HALF if native else self.EXTEND_FP32
            pack = self.PACK_GQA and group > 1 and block_m >= 2 * group
            block_q = block_m // group if pack else block_m
            grid = (hkv if pack else hq, triton.cdiv(self.max_qo_len, block_q), len(batch.qo_lens))
            _extend[grid](
                q, out, k_cache, v_cache, k_params, v_params, scales,
                batch.qo_indptr, batch.kv_indptr, batch.kv_indices, self.seq_lens, scale, softcap, window,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_cs, stride_ch, stride_ps, stride_ph,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_Q=block_q, PACK_GQA=pack,
                NUM_BLOCKS=self._static_blocks(self.max_seq_len, block_n), **flags,
                num_warps=self.EXTEND_WARPS, num_stages=self.EXTEND_STAGES,
            )  # fmt: skip
        if unrotate is not None:  # sum p (y M) = (sum p y) M
            out = (out @ unrotate).to(out_dtype)
        return out

    def _static_blocks(self, tokens: int, block: int) -> int:
        """Trip count for the interpreter's constant loops (1 when compiled: unused)."""
        return triton.cdiv(tokens, block) if self.interpret else 1
