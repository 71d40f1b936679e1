"""The attention backend interface."""

from __future__ import annotations

import torch


class AttentionBackend:
    """One instance serves one forward pass at a time: ``plan`` it, then call
    ``forward`` for each layer."""

    name = ""
    quantized_kv = False  # reads every quantized format (int8, int4, fp8); see KVView.gather
    quantized_dtypes: frozenset = frozenset()  # else the quantized KV dtypes it reads (Triton: int8, int4)

    def plan(self, batch) -> None:
        """Build whatever index data the batch needs, once for all layers."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D], the new tokens' K, already stored in ``kv``
        v: torch.Tensor,  # [T, Hkv, D]
        kv,  # the layer's KV: .k, .v [num_pages, page_size, Hkv, D], .format; see KVView
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Attend; ``kv`` already holds the new tokens at the batch's ``out_slots`` (the
        pool wrote them). A backend reads ``kv`` and never writes it; it may read the new
        tokens from ``k``/``v`` instead when they equal what the pool stored."""
        raise NotImplementedError


def stored_as(t: torch.Tensor, kv, part: str) -> torch.Tensor:
    """``t`` (new tokens' K, ``part="k"``, or V) as the pool stored it and a backend
    reads it back, in ``t.dtype``: itself when the format keeps its dtype, else rounded
    (quantized and dequantized) by the format."""
    return kv.stored(t, part)
