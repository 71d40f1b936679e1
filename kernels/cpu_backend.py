"""CPU attention backend: decode rows through a small C kernel, the rest through torch.

Decode (one new token per sequence) is the step a serving engine repeats most, and on
the CPU the reference backend spends it copying every sequence's pages into a padded
batch before SDPA: per step that copy moves the whole context's K/V of every layer
twice. ``cpu_decode.c`` reads K/V in place through the page table instead, one OpenMP
task per sequence (or per range of a long context), accumulating in float32. It reads
fp32 pages, and int8 pages with their log-scale byte per token and KV head without
dequantizing them: the scales (looked up in ``kv.format.log_scales()``) are folded into the
dot products and the weighted sum, so an int8 decode step moves about a quarter of fp32's
bytes. When the format stores rows
in another basis (rotated before quantizing), the kernel reads them in that basis: it
turns the queries into it and its sums back (``kv.format.row_map`` gives it the map).

Sequences with more than one new token (prefill, chunked prefill, extend) keep the
reference path (SDPA per sequence); in a mixed batch the decode rows go to the kernel
and the others to SDPA. Queries other than float32, and caches other than fp32 or int8
(bf16, fp16, fp8, int4), run wholly on the reference path.

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
_ARGTYPES = [_ptr] * 12 + [_i64] * 5 + [ctypes.c_float, _i64, ctypes.c_float, _i64]
_KV_FP32, _KV_INT8 = 0, 1  # cpu_decode.c's kv_format codes


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
    return lib


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        self._lib = load_library()

    def plan(self, batch) -> None:
        super().plan(batch)
        rows = [i for i, n in enumerate(batch.qo_lens) if n == 1]
        self.decode_rows = frozenset(rows)
        if rows:  # host int tensors for the kernel: each decode sequence's query row, page table start, length
            idx = torch.tensor(rows, dtype=torch.int64)
            self._q_rows = batch.qo_indptr.cpu().to(torch.int64)[idx + 1] - 1
            self._kv_starts = batch.kv_indptr.cpu().to(torch.int32)[idx].contiguous()
            self._kv_indices = batch.kv_indices.cpu().to(torch.int32).contiguous()
            self._decode_lens = torch.tensor([batch.seq_lens[i] for i in rows], dtype=torch.int32)

    def forward(self, q, k, v, kv, scale, sliding_window=None, logit_softcap=None):
        k_cache, v_cache = kv.k, kv.v
        kv_format = _kernel_format(q, kv) if self.decode_rows else None
        if kv_format is None:
            return super().forward(q, k, v, kv, scale, sliding_window, logit_softcap)
        k_params = v_params = scales = basis = 0  # int8's parameters, scale table and row map (none: 0), by address
        if kv_format == _KV_INT8:
            k_params, v_params = kv.k_params.data_ptr(), kv.v_params.data_ptr()
            scales = kv.format.log_scales().data_ptr()
            row_map = kv.format.row_map(q.shape[2])
            basis = 0 if row_map is None else row_map.data_ptr()
        q = q.contiguous()
        out = torch.empty_like(q)
        if len(self.decode_rows) < len(self.qo_lens):  # the other sequences through SDPA
            k, v = stored_as(k, kv, "k"), stored_as(v, kv, "v")  # the new tokens as the pool stored them
            self.attend_sequences(q, k, v, kv, scale, sliding_window, logit_softcap, out, skip=self.decode_rows)
        status = self._lib.radixkv_paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_params, v_params, scales, basis, self._q_rows.data_ptr(),
            self._kv_starts.data_ptr(), self._kv_indices.data_ptr(), self._decode_lens.data_ptr(), out.data_ptr(),
            len(self.decode_rows), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
            sliding_window or 0, logit_softcap or 0.0, kv_format,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("cpu decode attention could not allocate its scratch buffers")
        return out


def _kernel_format(q: torch.Tensor, kv) -> int | None:
    """The kernel's code for reading ``kv`` with ``q``, or None when the kernel cannot
    (then the reference path does): float32 queries on the CPU over contiguous CPU
    caches, either float32 pages or int8 pages with their contiguous log-scale bytes
    beside them."""
    caches = (kv.k, kv.v)
    if not (q.device.type == "cpu" and q.dtype == torch.float32):
        return None
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in caches):
        return None
    if kv.k_params is None:
        return _KV_FP32 if all(t.dtype == torch.float32 for t in caches) else None
    params = (kv.k_params, kv.v_params)
    int8 = (
        kv.format.name == "int8"
        and all(t.dtype == torch.int8 for t in caches)
        and kv.format.log_scale
        and all(p.dtype == torch.uint8 and p.device.type == "cpu" and p.is_contiguous() for p in params)
        and all(p.shape == (*c.shape[:3], 1) for p, c in zip(params, caches))
    )
    return _KV_INT8 if int8 else None
