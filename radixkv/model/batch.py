"""Batch metadata for one forward pass, in FlashInfer's CSR convention.

Prefill, extend (prefill after a cache hit) and decode are one thing here: every
sequence has some tokens already in the KV pool and some new ones to compute.

    sequence i:   |==== cached (in pages) ====|=== new: qo_lens[i] ===|
                  0                          cached_i                seq_lens[i]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from radixkv.validate import ceil_div


class SeqInput(NamedTuple):
    """One sequence of a batch: ``new_tokens`` follow ``num_cached`` KV entries already
    in its pages; ``pages`` is its page table, covering those and the new tokens.

    ``positions`` are the new tokens' positions in the sequence (what RoPE sees), kept
    apart from where their KV goes: by default ``num_cached, num_cached + 1, ...``; a
    sequence that keeps only part of its past (long-context eviction) has fewer KV
    entries than its position says."""

    new_tokens: Sequence[int]
    num_cached: int
    pages: np.ndarray  # int32
    positions: Sequence[int] | None = None
    observe_from: int | None = None  # sum the attention mass of new tokens observe_from.. (see ForwardBatch.observe)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, device: the new tokens of all sequences, in order
    positions: torch.Tensor  # [T] int64, device: each new token's position in its sequence (RoPE), not its KV index
    qo_indptr: torch.Tensor  # [B+1] int32, device: new tokens of sequence i are qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [B+1] int32, device: pages of sequence i are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [nnz] int32, device: page ids
    kv_last_page_len: torch.Tensor  # [B] int32, device: (seq_len - 1) % page_size + 1
    out_slots: torch.Tensor  # [T] int64, device: pool slot where each new token's K/V goes
    qo_lens: tuple[int, ...]  # host: new tokens per sequence
    seq_lens: tuple[int, ...]  # host: cached + new tokens per sequence
    page_size: int
    # (sequence index, first new token observed): the backend sums, over layers, query heads
    # and those new tokens, each KV entry's attention probability (``backend.mass``)
    observe: tuple[tuple[int, int], ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, seqs: Sequence[SeqInput], page_size: int, device: str | torch.device = "cpu") -> ForwardBatch:
        """Metadata for ``seqs``. Raises ValueError naming the sequence and field when a
        sequence has no new tokens or its page table is too short."""
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        qo_lens, seq_lens, ids, positions, slots, tables, observe = [], [], [], [], [], [], []
        for i, s in enumerate(seqs):
            n = len(s.new_tokens)
            if n == 0:
                raise ValueError(f"sequence {i}: new_tokens must not be empty")
            if s.num_cached < 0:
                raise ValueError(f"sequence {i}: num_cached must be >= 0, got {s.num_cached}")
            total = s.num_cached + n
            pages = np.asarray(s.pages, dtype=np.int32)
            need = ceil_div(total, page_size)
            if len(pages) < need:
                raise ValueError(f"sequence {i}: pages holds {len(pages)} ids, {total} tokens need {need}")
            pages = pages[:need]
            kv_index = np.arange(s.num_cached, total, dtype=np.int64)  # where the new K/V go
            if s.positions is None:
                pos = kv_index
            else:
                pos = np.asarray(s.positions, dtype=np.int64)
                if pos.shape != (n,) or (n and pos.min() < 0):
                    raise ValueError(f"sequence {i}: positions must be {n} ints >= 0 (one per new token)")
            if s.observe_from is not None:
                if not 0 <= s.observe_from < n:
                    raise ValueError(f"sequence {i}: observe_from must lie in [0, {n}), got {s.observe_from}")
                observe.append((i, int(s.observe_from)))
            qo_lens.append(n)
            seq_lens.append(total)
            ids.append(np.asarray(s.new_tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(pages[kv_index // page_size].astype(np.int64) * page_size + kv_index % page_size)
            tables.append(pages)
        kv_counts = [len(t) for t in tables]

        def dev(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

        return cls(
            input_ids=dev(np.concatenate(ids), np.int64),
            positions=dev(np.concatenate(positions), np.int64),
            qo_indptr=dev(np.concatenate([[0], np.cumsum(qo_lens)]), np.int32),
            kv_indptr=dev(np.concatenate([[0], np.cumsum(kv_counts)]), np.int32),
            kv_indices=dev(np.concatenate(tables), np.int32),
            kv_last_page_len=dev([(t - 1) % page_size + 1 for t in seq_lens], np.int32),
            out_slots=dev(np.concatenate(slots), np.int64),
            qo_lens=tuple(qo_lens),
            seq_lens=tuple(seq_lens),
            page_size=page_size,
            observe=tuple(observe),
        )
