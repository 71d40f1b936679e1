"""The attention backend interface."""

from __future__ import annotations

import torch


class AttentionBackend:
    """One instance serves one forward pass at a time: ``plan`` it, then call
    ``forward`` for each layer."""

    name = ""

    def plan(self, batch) -> None:
        """Build whatever index data the batch needs, once for all layers."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D], new tokens
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write ``k``/``v`` at the batch's ``out_slots``, then attend."""
        raise NotImplementedError
