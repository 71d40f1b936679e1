"""Attention through FlashInfer's paged-KV wrappers (GPU only, optional dependency).

Written against flashinfer-python 0.6.18.post1 (the ``gpu`` extra). FlashInfer reads
the pool in place: our per-layer ``[num_pages, page_size, Hkv, D]`` K and V tensors are
its "NHD" paged layout, and the batch metadata is already in its CSR convention.

What happens when:

- construction: imports flashinfer (ImportError with an install hint if missing);
  nothing is allocated yet.
- ``plan(batch)``, once per forward pass: on first use, allocates the one workspace
  buffer (on the batch's device) and the prefill wrapper; records the batch's page
  table and host-side indptr arrays. No FlashInfer plan runs yet, because the
  softmax scale, sliding window and soft-cap only arrive with ``forward``.
- first ``forward`` after ``plan``: runs the FlashInfer plan, with the decode wrapper
  when every sequence has exactly one new token and the causal prefill wrapper
  otherwise. Later layers reuse that plan; it is redone only when the scale, window,
  soft-cap, head counts or dtypes differ from the previous layer's.
- every ``forward``: runs on the layer's KV view, which the pool has already written;
  with observed sequences (``batch.observe``), adds their attention mass through
  ``AttentionBackend._observe`` (FlashInfer does not return probabilities per key).
"""

from __future__ import annotations

import torch

from radixkv.kernels.base import AttentionBackend

INSTALL_HINT = "the flashinfer attention backend needs flashinfer-python: pip install 'radixkv[gpu]'"
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended size for split-k scratch


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's ``window_left`` for our ``sliding_window``.

    Ours: a query at position p sees kv positions > p - W (W positions, itself included).
    FlashInfer's kernels keep kv_idx >= p - window_left (inclusive), so
    window_left = W - 1; -1 means no window.
    """
    if sliding_window is None:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return sliding_window - 1


class FlashInferBackend(AttentionBackend):
    """FlashInfer batch decode / prefill over the paged pool. One instance serves one
    forward pass at a time (it holds one plan)."""

    name = "flashinfer"

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        self._fi = flashinfer
        self._workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._prefill = None
        self._decode: dict[bool, object] = {}  # use_tensor_cores -> decode wrapper
        self._batch = None
        self._planned: tuple | None = None  # what the current FlashInfer plan was made for
        self._wrapper = None

    def plan(self, batch) -> None:
        """Record the batch; allocate the workspace on first use. FlashInfer's own plan
        runs lazily in the first ``forward``."""
        device = batch.kv_indices.device
        if device.type != "cuda":
            raise ValueError(f"the flashinfer backend runs on CUDA tensors, the batch is on {device}")
        super().plan(batch)
        if self._workspace is None or self._workspace.device != device:
            # zero-filled: FlashInfer asks for a zeroed float workspace on first use
            self._workspace = torch.zeros(self._workspace_bytes, dtype=torch.uint8, device=device)
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._decode = {}
        ps = batch.page_size
        # Host copies of the CSR arrays, from the batch's host tuples (no device sync):
        # FlashInfer's planner reads them on the CPU. They follow the batch contract:
        # a sequence of n tokens holds ceil(n / page_size) pages, the last one
        # (n - 1) % page_size + 1 full.
        pages = [-(-n // ps) for n in batch.seq_lens]
        self._qo_indptr = _indptr(batch.qo_lens)
        self._kv_indptr = _indptr(pages)
        self._last_page_len = torch.tensor([(n - 1) % ps + 1 for n in batch.seq_lens], dtype=torch.int32)
        self._kv_indices = batch.kv_indices
        self._page_size = ps
        self._is_decode = all(n == 1 for n in batch.qo_lens)
        self._batch = batch
        self._planned = None

    def forward(self, q, k, v, kv, scale, sliding_window=None, logit_softcap=None):
        k_cache, v_cache = kv.k, kv.v
        if self._batch is None:
            raise RuntimeError("FlashInferBackend.forward called before plan(batch)")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend takes float16 or bfloat16 queries, got {q.dtype}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")
        _, page_size, hkv, dim = k_cache.shape
        if page_size != self._page_size:
            raise ValueError(f"k_cache has pages of {page_size} tokens, the batch was built for {self._page_size}")
        if q.dtype != k_cache.dtype:
            raise ValueError(f"the flashinfer backend reads KV in the queries' dtype ({q.dtype}), got {kv.format.name}")
        key = (q.shape[1], hkv, dim, q.dtype, k_cache.dtype, float(scale), window_left(sliding_window), logit_softcap)
        if key != self._planned:
            self._plan_flashinfer(*key)
        out = self._wrapper.run(q.contiguous(), (k_cache, v_cache))
        if self.mass:  # FlashInfer returns no per-key probabilities: the generic path
            self._observe(q, k, kv, scale, sliding_window, logit_softcap)
        return out

    def _plan_flashinfer(self, hq, hkv, dim, q_dtype, kv_dtype, scale, win, softcap):
        """Run FlashInfer's plan for the recorded batch and these layer settings."""
        options = dict(
            sm_scale=scale,
            window_left=win,
            logits_soft_cap=softcap,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )
        if self._is_decode:
            # CUDA-core decode handles query groups of up to 4 heads per KV head;
            # larger groups (and odd ones like 5, 7) go to the tensor-core path.
            tensor_cores = hq // hkv > 4
            if tensor_cores not in self._decode:
                self._decode[tensor_cores] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores
                )
            wrapper = self._decode[tensor_cores]
            wrapper.plan(
                self._kv_indptr, self._kv_indices, self._last_page_len, hq, hkv, dim, self._page_size, **options
            )
        else:
            wrapper = self._prefill
            wrapper.plan(
                self._qo_indptr,
                self._kv_indptr,
                self._kv_indices,
                self._last_page_len,
                hq,
                hkv,
                dim,
                self._page_size,
                causal=True,
                **options,
            )
        self._wrapper = wrapper
        self._planned = (hq, hkv, dim, q_dtype, kv_dtype, scale, win, softcap)


def _indptr(counts) -> torch.Tensor:
    """[len(counts) + 1] int32 CPU prefix sums, starting at 0."""
    out = torch.zeros(len(counts) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return out
