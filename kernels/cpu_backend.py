"""CPU attention backend: decode rows, prefills and extends through C kernels, the rest through torch.

Decode (one new token per sequence) is the step a serving engine repeats most, and on
the CPU the reference backend spends it copying every sequence's pages into a padded
batch before SDPA: per step that copy moves the whole context's K/V of every layer
twice. ``cpu_decode.c`` reads K/V in place through the page table instead, one OpenMP
task per range of ~128 positions of a sequence's context (by its length alone, so a row
is the same bits in any batch and on any thread count), accumulating in float32. It reads
fp32 pages, bf16 and fp16 pages (each row widened to float32 as it is read: exact, so the
sums are fp32's over the values the cache holds, at half the bytes; where the CPU has
AVX512-BF16, bf16 rows of head size 64 without a soft cap multiply in bf16 instead, as
extends do below, ``bf16_decode``: the query and the softmax weights rounded to bf16,
every sum float32), int8 pages and
int4 pages without dequantizing them: int8's log-scale byte per token and KV head (looked
up in ``kv.format.log_scales()``), and int4's fp16 (scale, offset) per channel of a page
(K) and per token (V), are folded into the dot products and
the weighted sums, so a decode step moves about a quarter (int8) or a sixth (int4, pages
of 16) of fp32's bytes. When the format stores rows in another basis (rotated before
quantizing), the kernel reads them in that basis: it turns the queries into it and its
sums back (``kv.format.row_map`` gives it the map).

int4 is quantized on seal (``radixkv.cache.sealing``): a decode query reads the pages
before its own page sealed and its own page in full precision, the earlier rows from the
sealer's staging area (``Sealer.staging``, read in place) and the new token from this
forward's ``k``/``v``, as ``TorchBackend.attend_paged`` does.

Prefills and extends (several new tokens, after cached ones or not: a prompt, a question
after a shared prefix, a branch, a chunk of a long prompt) over float32, bf16 or fp16 pages go
to a second kernel, ``radixkv_paged_extend``: tasks of a sequence, a KV head and up to 96 of
its query rows against blocks of 16 positions read in place from the pages, online
softmax, so each block's K/V serves all of the task's rows (per-sequence SDPA cost more:
1.8x on a 512-token prefill). Where the build has AVX-512 its float32 tiles take 16 rows a
vector, the AVX2 tiles' operations in the same order: the same bits, 1.05-1.09x as fast.
On bf16 pages it multiplies in bf16 where the CPU has AVX512-BF16 (``bf16_products``):
the queries and the softmax weights rounded to bf16, sums in float32, as GPU kernels do
on a bf16 cache, in the AVX-512 tiles' shapes on pairs of dims or positions (1.5-1.6x the
float32 pages' speed); elsewhere bf16 blocks, and
fp16 ones always, are widened to float32 once per task and block. It needs AVX2 + FMA,
head sizes a multiple of 32 and no soft-capped logits.
The others, and int8 or int4 prefills and extends, keep the reference path (SDPA per
sequence; ``attend_paged`` for int4); in a mixed batch each sequence goes its own way. Queries
other than float32, and caches other than fp32, bf16, fp16, int8 or int4 (fp8), run
wholly on the reference path.

Attention mass (``batch.observe``, see ``AttentionBackend``): the kernel adds its
observed decode rows' probabilities into ``mass`` in place (from the exponentials its
softmax pass computes anyway); observed prefill and extend rows, and every observed row
on the reference path, go through the generic ``AttentionBackend._observe``.

The kernel is compiled on first use with ``-O3 -march=native -fopenmp`` by
``radixkv.kernels.build`` (the system C compiler; cached in ``$RADIXKV_CACHE_DIR``,
named by a hash of the source, the compiler, the flags and this CPU). Without
a compiler, or if the build fails, constructing the backend raises ImportError, and
``auto`` falls back to ``torch``.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from radixkv.kernels import build
from radixkv.kernels.base import stored_as
from radixkv.kernels.torch_ref import TorchBackend

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_ARGTYPES = [_ptr] * 19 + [_i64] * 5 + [ctypes.c_float, _i64, ctypes.c_float, _i64]
_KV_FP32, _KV_INT8, _KV_INT4, _KV_BF16, _KV_FP16 = 0, 1, 2, 3, 4  # cpu_decode.c's kv_format codes
# pages of floats by their dtype (16-bit ones widened as read): both kernels and the one-call step read them
_FLOAT_CODES = {torch.float32: _KV_FP32, torch.bfloat16: _KV_BF16, torch.float16: _KV_FP16}
_FLOAT_PAGES = tuple(_FLOAT_CODES.values())


def load_library() -> ctypes.CDLL:
    """The compiled kernel, built into the cache directory on first use."""
    global _library
    with _lock:
        if _library is None:
            try:
                _library = _build_and_load()
            except OSError as e:  # an unwritable cache directory, a library that will not load
                raise ImportError(f"the cpu attention backend is unavailable: {e}") from e
        return _library


def _build_and_load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build.build("cpu_decode", SOURCE, FLAGS, depends_on=(build.cpu_id(),), libs=("-lm",))))
    lib.radixkv_paged_decode.argtypes = _ARGTYPES
    lib.radixkv_paged_decode.restype = ctypes.c_int
    lib.radixkv_paged_extend.argtypes = [_ptr] * 9 + [_i64] * 5 + [ctypes.c_float, _i64, _i64]
    lib.radixkv_paged_extend.restype = ctypes.c_int
    return lib


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._lib = load_library()
        # the kernels' addresses, for a model that calls them itself (step_kernels)
        self._decode_address = ctypes.cast(self._lib.radixkv_paged_decode, ctypes.c_void_p).value
        self._extend_address = ctypes.cast(self._lib.radixkv_paged_extend, ctypes.c_void_p).value
        # the extend kernel needs AVX2 + FMA (it answers -1 without them, 0 for an empty batch)
        self._extend_kernel = self._lib.radixkv_paged_extend(*[None] * 9, 0, 1, 1, 32, 1, 1.0, 0, _KV_FP32) == 0
        # bf16 pages' extends: products in bf16 (AVX512-BF16), else rows widened to float32
        self.bf16_products = self._extend_kernel and self._lib.radixkv_extend_bf16_products() == 1
        # bf16 pages' decode rows of head size 64: products in bf16 as well (the same CPUs)
        self.bf16_decode = self._lib.radixkv_decode_bf16_products() == 1

    def plan(self, batch) -> None:
        super().plan(batch)
        rows = [i for i, n in enumerate(batch.qo_lens) if n == 1]
        self.decode_rows = frozenset(rows)
        # prefills and extends (several new tokens, after cached ones or not), for the extend kernel
        ext = [i for i, n in enumerate(batch.qo_lens) if n > 1] if self._extend_kernel else []
        self.extends = frozenset(ext)
        if rows or ext:  # both kernels read the page tables
            self._kv_indices = batch.kv_indices.cpu().to(torch.int32).contiguous()
        if rows:  # host int tensors for the kernel: each decode sequence's query row, page table start, length
            idx = torch.tensor(rows, dtype=torch.int64)
            self._dec_seq = idx  # forward_rows: a decode sequence's row among one row per sequence
            self._q_rows = batch.qo_indptr.cpu().to(torch.int64)[idx + 1] - 1
            self._kv_starts = batch.kv_indptr.cpu().to(torch.int32)[idx].contiguous()
            self._decode_lens = torch.tensor([batch.seq_lens[i] for i in rows], dtype=torch.int32)
        # observed decode rows: the kernel adds their mass in place, at these offsets (-1: not observed)
        at = {e.seq: e.offset for e in self._observed if e.seq in self.decode_rows}
        self._kernel_observed = frozenset(at)
        self._mass_at = torch.tensor([at.get(i, -1) for i in rows], dtype=torch.int64) if at else None
        if ext:  # each extend's first query row, new tokens, page table start and length
            idx = torch.tensor(ext, dtype=torch.int64)
            self._ext_q = batch.qo_indptr.cpu().to(torch.int64)[idx].contiguous()
            self._ext_n = torch.tensor([batch.qo_lens[i] for i in ext], dtype=torch.int32)
            self._ext_kv = batch.kv_indptr.cpu().to(torch.int32)[idx].contiguous()
            self._ext_len = torch.tensor([batch.seq_lens[i] for i in ext], dtype=torch.int32)
            self._ext_seq, self._ext_one = idx, torch.ones(len(ext), dtype=torch.int32)  # forward_rows: last rows

    def step_kernels(self, kv, q_heads: int) -> dict[str, int] | None:
        """For a model that runs a whole step's layers in C (``radixkv_native_forward``):
        the addresses of the two kernels and of this plan's arrays for them (alive until the
        next plan), their counts and the kernel's code for the pages' format, as
        ``Attention``'s fields by name (``forward_rows``' arrays too, for a model that reads
        only each sequence's last row past the last layer). When every sequence goes to a
        kernel (decode rows to the decode kernel, prefills and extends to the extend
        kernel), nothing is observed and ``kv`` (a layer's view; every layer's is alike)
        holds float32, bfloat16 or half pages both read for ``q_heads`` query heads; else None."""
        if self.mass or len(self.decode_rows) + len(self.extends) < len(self.qo_lens):
            return None
        kv_format = _pages_format(kv)  # float pages: no parameters, no sealer (that is int4's)
        if kv_format not in _FLOAT_PAGES or (
                self.extends and not self._extend_reads(q_heads, kv.k.shape[3], kv, kv_format, None)):
            return None
        f = {"kv_indices": self._kv_indices.data_ptr(), "kv_format": kv_format}
        if self.decode_rows:
            f.update(decode=self._decode_address, rows=self._q_rows.data_ptr(), kv_starts=self._kv_starts.data_ptr(),
                     seq_lens=self._decode_lens.data_ptr(), n_decode=len(self.decode_rows),
                     dec_seq=self._dec_seq.data_ptr())  # fmt: skip
        if self.extends:
            f.update(extend=self._extend_address, ext_q=self._ext_q.data_ptr(), ext_n=self._ext_n.data_ptr(),
                     ext_starts=self._ext_kv.data_ptr(), ext_lens=self._ext_len.data_ptr(), n_extend=len(self.extends),
                     ext_seq=self._ext_seq.data_ptr(), ones=self._ext_one.data_ptr())  # fmt: skip
        return f

    def forward(self, q, k, v, kv, scale, sliding_window=None, logit_softcap=None):
        kv_format = _kernel_format(q, kv) if self.decode_rows or self.extends else None
        reads = self._extend_reads(q.shape[1], q.shape[2], kv, kv_format, logit_softcap)
        extends = self.extends if reads else frozenset()
        if kv_format is None or not (self.decode_rows or extends):
            return super().forward(q, k, v, kv, scale, sliding_window, logit_softcap)
        # by address, 0 where the format has none: parameters, int8's scale table, the row map,
        # and int4's own-page rows (the new tokens' K/V; the staging rows and their slot map)
        k_params = v_params = scales = basis = k_new = v_new = stage_k = stage_v = stage_of = 0
        if kv_format in (_KV_INT8, _KV_INT4):
            k_params, v_params = kv.k_params.data_ptr(), kv.v_params.data_ptr()
            row_map = kv.format.row_map(q.shape[2])
            basis = 0 if row_map is None else row_map.data_ptr()
        if kv_format == _KV_INT8:
            scales = kv.format.log_scales().data_ptr()
        if kv_format == _KV_INT4:
            k, v = k.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()  # alive until the call returns
            staged_k, staged_v, slot_of = kv.sealer.staging(kv.layer)
            k_new, v_new = k.data_ptr(), v.data_ptr()
            stage_k, stage_v, stage_of = staged_k.data_ptr(), staged_v.data_ptr(), slot_of.data_ptr()
        q = q.contiguous()
        out = torch.empty_like(q)
        in_kernels = self.decode_rows | extends
        if len(in_kernels) < len(self.qo_lens):  # the other sequences through the reference path
            if kv.format.paged:  # sealed pages, and the own page's rows in full precision
                self.attend_paged(q, k, v, kv, scale, sliding_window, logit_softcap, out, skip=in_kernels)
            else:
                k, v = stored_as(k, kv, "k"), stored_as(v, kv, "v")  # the new tokens as the pool stored them
                self.attend_sequences(q, k, v, kv, scale, sliding_window, logit_softcap, out, skip=in_kernels)
        if extends:
            self._run_extend(q, kv, out, self._ext_q, self._ext_n, scale, sliding_window, kv_format)
        if self.mass:  # the observed sequences the decode kernel does not do
            self._observe(q, k, kv, scale, sliding_window, logit_softcap, skip=self._kernel_observed)
        if not self.decode_rows:
            return out
        mass, mass_at = 0, 0
        if self._mass_at is not None:  # mass's tensors view one flat tensor, which starts at the first's start
            mass, mass_at = self.mass[0].data_ptr(), self._mass_at.data_ptr()
        self._run_decode(q, kv, out, self._q_rows, scale, sliding_window, logit_softcap, kv_format,
                     (k_params, v_params, scales, basis, k_new, v_new, stage_k, stage_v, stage_of), mass, mass_at)
        return out

    def forward_rows(self, q, k, v, kv, scale, rows, sliding_window=None, logit_softcap=None):
        """Each sequence's last row alone through the kernels, when every sequence goes to
        one (decode rows to the decode kernel, prefills and extends to the extend kernel, as
        one new token that sees its whole context) over float pages and none is observed:
        each kernel gives a row the same bits whatever else it computes (the extend kernel
        sums over the same blocks of positions in the same order per row). Else every row
        (``AttentionBackend.forward_rows``)."""
        kv_format = _kernel_format(q, kv)
        if (self.mass or len(self.decode_rows) + len(self.extends) < len(self.qo_lens)
                or not self._extend_reads(q.shape[1], q.shape[2], kv, kv_format, logit_softcap)):
            return super().forward_rows(q, k, v, kv, scale, rows, sliding_window, logit_softcap)  # fmt: skip
        q = q[rows].contiguous()  # row i: sequence i's last
        out = torch.empty_like(q)
        if self.extends:
            self._run_extend(q, kv, out, self._ext_seq, self._ext_one, scale, sliding_window, kv_format)
        if self.decode_rows:
            self._run_decode(q, kv, out, self._dec_seq, scale, sliding_window, None, kv_format)
        return out

    @staticmethod
    def _extend_reads(q_heads: int, head_dim: int, kv, kv_format, logit_softcap) -> bool:
        """Whether the extend kernel can attend ``q_heads`` query heads of ``head_dim``
        over ``kv``: float pages, no soft-cap, head size a multiple of 32, whole query
        groups per KV head (``forward``, ``forward_rows`` and ``step_kernels`` alike)."""
        return (kv_format in _FLOAT_PAGES and logit_softcap is None and head_dim % 32 == 0
                and q_heads % kv.k.shape[2] == 0)  # fmt: skip

    def _run_extend(self, q, kv, out, q_start, n_new, scale, sliding_window, kv_format) -> None:
        """The extend kernel over this plan's extends: sequence i's queries are ``n_new[i]``
        rows of ``q`` from ``q_start[i]``, its results the same rows of ``out``."""
        if self._lib.radixkv_paged_extend(
            q.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(), q_start.data_ptr(), n_new.data_ptr(),
            self._ext_kv.data_ptr(), self._kv_indices.data_ptr(), self._ext_len.data_ptr(), out.data_ptr(),
            len(self.extends), q.shape[1], kv.k.shape[2], q.shape[2], kv.k.shape[1], scale, sliding_window or 0,
            kv_format,
        ) != 0:  # fmt: skip
            raise MemoryError("cpu extend attention could not allocate its buffers")

    def _run_decode(self, q, kv, out, q_rows, scale, sliding_window, logit_softcap, kv_format, extras=(0,) * 9,
                mass=0, mass_at=0) -> None:  # fmt: skip
        """The decode kernel over this plan's decode rows: row ``q_rows[i]`` of ``q`` and
        ``out``; ``extras``: the addresses of a quantized format's parameters, scale
        table, row map and int4's own-page rows (0 where none), ``mass``, ``mass_at``:
        observed rows' mass (see ``forward``)."""
        if self._lib.radixkv_paged_decode(
            q.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(), *extras, q_rows.data_ptr(), self._kv_starts.data_ptr(),
            self._kv_indices.data_ptr(), self._decode_lens.data_ptr(), out.data_ptr(), mass, mass_at,
            len(self.decode_rows), q.shape[1], kv.k.shape[2], q.shape[2], kv.k.shape[1], scale,
            sliding_window or 0, logit_softcap or 0.0, kv_format,
        ) != 0:  # fmt: skip
            raise MemoryError("cpu decode attention could not allocate its scratch buffers")


def _kernel_format(q: torch.Tensor, kv) -> int | None:
    """The kernel's code for reading ``kv`` with ``q``, or None when the kernel cannot
    (then the reference path does): float32 queries on the CPU, over pages it reads
    (``_pages_format``)."""
    if not (q.device.type == "cpu" and q.dtype == torch.float32):
        return None
    return _pages_format(kv)


def _pages_format(kv) -> int | None:
    """The kernel's code for ``kv``'s pages, or None when it cannot read them: contiguous
    CPU caches, either float32, bfloat16 or half pages, int8 pages with their contiguous
    log-scale bytes beside them, or int4 pages (``int4``, ``int4_norot``) with their
    contiguous fp16 parameters and their sealer's float32 staging rows."""
    caches = (kv.k, kv.v)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in caches):
        return None
    if kv.k_params is None:
        return _FLOAT_CODES.get(kv.k.dtype) if kv.v.dtype == kv.k.dtype else None
    params = (kv.k_params, kv.v_params)
    if not all(p.device.type == "cpu" and p.is_contiguous() for p in params):
        return None
    fmt = kv.format
    if fmt.name == "int8" and fmt.log_scale:
        int8 = all(t.dtype == torch.int8 for t in caches) and all(
            p.dtype == torch.uint8 and p.shape == (*c.shape[:3], 1) for p, c in zip(params, caches)
        )
        return _KV_INT8 if int8 else None
    if fmt.paged and fmt.levels == 16 and kv.sealer is not None:
        pages, page_size, heads, half = kv.k.shape
        staged_k, staged_v, slot_of = kv.sealer.staging(kv.layer)
        int4 = (
            all(t.dtype == torch.uint8 and t.shape == kv.k.shape for t in caches)
            and all(p.dtype == torch.float16 for p in params)
            and kv.k_params.shape == (pages, heads, 2 * half, 2)
            and kv.v_params.shape == (pages, page_size, heads, 2)
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                    for t in (staged_k, staged_v))
            and staged_k.shape[1:] == (page_size, heads, 2 * half) and staged_v.shape == staged_k.shape
            and slot_of.dtype == torch.int64 and slot_of.device.type == "cpu" and slot_of.is_contiguous()
            and slot_of.shape == (pages,)
        )  # fmt: skip
        return _KV_INT4 if int4 else None
    return None
