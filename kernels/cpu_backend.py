"""CPU attention backend: decode rows through a small C kernel, the rest through torch.

Decode (one new token per sequence) is the step a serving engine repeats most, and on
the CPU the reference backend spends it copying every sequence's pages into a padded
batch before SDPA: per step that copy moves the whole context's K/V of every layer
twice. ``cpu_decode.c`` reads K/V in place through the page table instead, one OpenMP
task per (sequence, KV head), float32 throughout.

Sequences with more than one new token (prefill, chunked prefill, extend) keep the
reference path (SDPA per sequence); in a mixed batch the decode rows go to the kernel
and the others to SDPA. A non-float32 cache or query runs wholly on the reference path.

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
from radixkv.kernels.torch_ref import TorchBackend

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_ARGTYPES = [_ptr] * 8 + [_i64] * 5 + [ctypes.c_float, _i64, ctypes.c_float]


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
        if not (self.decode_rows and _kernel_can_read(q, k_cache, v_cache)):
            return super().forward(q, k, v, kv, scale, sliding_window, logit_softcap)
        q = q.contiguous()
        out = torch.empty_like(q)
        if len(self.decode_rows) < len(self.qo_lens):  # the other sequences through SDPA
            self.attend_sequences(q, k, v, kv, scale, sliding_window, logit_softcap, out, skip=self.decode_rows)
        status = self._lib.radixkv_paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self._q_rows.data_ptr(), self._kv_starts.data_ptr(),
            self._kv_indices.data_ptr(), self._decode_lens.data_ptr(), out.data_ptr(), len(self.decode_rows),
            q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale, sliding_window or 0, logit_softcap or 0.0,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("cpu decode attention could not allocate its scratch buffers")
        return out


def _kernel_can_read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 CPU tensors with contiguous caches: what the C kernel reads."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k_cache, v_cache)) and (
        k_cache.is_contiguous() and v_cache.is_contiguous()
    )
