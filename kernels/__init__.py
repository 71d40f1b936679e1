"""Attention backends (installed as ``radixkv.kernels``), chosen by name.

This package imports nothing from the rest of radixkv. A backend works on one
ragged batch described in FlashInfer's CSR convention by any object with these
attributes (``radixkv.model.batch.ForwardBatch`` is one):

    qo_indptr [B+1] int32, kv_indptr [B+1] int32, kv_indices [nnz] int32,
    kv_last_page_len [B] int32, out_slots [T] int64,
    qo_lens / seq_lens (host tuples of B ints), page_size (int),
    observe (optional: (sequence, first new token) pairs whose attention mass the backend
    sums into ``backend.mass``; see ``AttentionBackend``)

``plan(batch)`` runs once per forward pass; ``forward`` once per layer attends, causally
among a sequence's new tokens and fully to its cached prefix, with GQA/MQA. The layer's
KV comes as a view (``radixkv.cache.formats.KVView`` is one): ``.k``/``.v`` paged
tensors and ``.format`` (``.name``, ``.dtype``). The pool has already written the new
tokens into it; backends only read KV.
"""

from __future__ import annotations

from typing import Callable

from radixkv.kernels.base import AttentionBackend


def _torch() -> AttentionBackend:
    from radixkv.kernels.torch_ref import TorchBackend

    return TorchBackend()


def _triton() -> AttentionBackend:
    from radixkv.kernels.triton_backend import TritonBackend

    return TritonBackend()


def _cpu() -> AttentionBackend:
    from radixkv.kernels.cpu_backend import CpuBackend

    return CpuBackend()


def _flashinfer() -> AttentionBackend:
    from radixkv.kernels.flashinfer_backend import FlashInferBackend

    return FlashInferBackend()


def _quantized(dtype) -> bool:
    """Whether a KV dtype is a quantized format's: integer codes, or 8-bit floats
    (stored divided by per-head scales)."""
    return dtype is not None and (not dtype.is_floating_point or dtype.itemsize == 1)


def _reads(backend: AttentionBackend, dtype) -> bool:
    """Whether ``backend`` reads KV of ``dtype``: every unquantized dtype; a quantized one
    when it reads them all (``quantized_kv``) or lists it in ``quantized_dtypes`` (Triton
    reads int8 pages and int4's, uint8 codes two to a byte; not fp8's)."""
    return not _quantized(dtype) or backend.quantized_kv or dtype in backend.quantized_dtypes


def _auto(device: str = "cpu", dtype=None, q_dtype=None) -> AttentionBackend:
    """By where the KV lives: on CUDA, FlashInfer for half-precision KV read by queries of
    the same dtype when it imports, else Triton (which also reads fp32, mixed, int8 and
    int4 KV), and torch for the quantized KV Triton does not read (fp8); on the CPU the
    C decode kernel when it builds, else torch. The machine having a GPU does not
    matter, only ``device``."""
    import torch

    if str(device).startswith("cuda"):
        half = dtype in (torch.float16, torch.bfloat16) and q_dtype in (None, dtype)
        factories = (_flashinfer, _triton) if half else (_triton,)
    else:
        factories = (_cpu,)
    for factory in factories:
        try:
            backend = factory()
        except ImportError:
            continue
        if _reads(backend, dtype):
            return backend
    return _torch()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _torch,
    "cpu": _cpu,
    "triton": _triton,
    "flashinfer": _flashinfer,
    "auto": _auto,
}


def get_backend(name: str = "torch", device: str = "cpu", dtype=None, q_dtype=None) -> AttentionBackend:
    """A fresh backend instance by name. ``device`` and ``dtype`` (of the KV cache) and
    ``q_dtype`` (of the queries: the model's) only steer ``auto``. Raises ValueError
    naming the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)}, got {name!r}")
    if name == "auto":
        return _auto(device, dtype, q_dtype)
    backend = BACKENDS[name]()
    if not _reads(backend, dtype):
        raise ValueError(f"attention_backend {name!r} cannot read {dtype} KV yet: use torch or cpu")
    return backend


__all__ = ["AttentionBackend", "BACKENDS", "get_backend"]
