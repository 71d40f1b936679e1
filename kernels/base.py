"""The attention backend interface, and the attention mass every backend can observe."""

from __future__ import annotations

from typing import NamedTuple

import torch

# Logits the generic observation holds at once (query rows x heads x keys): 16 MiB of float32.
OBSERVE_BLOCK_ELEMENTS = 1 << 22


class Observed(NamedTuple):
    """One entry of ``batch.observe`` as ``AttentionBackend._observe`` reads it."""

    seq: int  # the sequence's index in the batch
    q_start: int  # row of q holding its first new token
    first: int  # its first observed new token (it and the later ones are observed)
    qo_len: int  # its new tokens
    seq_len: int  # its KV entries, the new tokens included
    slots: torch.Tensor  # [seq_len] int64, on the KV's device: entry j's pool slot
    offset: int  # where its mass starts in the flat tensor that ``mass``'s tensors view


class AttentionBackend:
    """One instance serves one forward pass at a time: ``plan`` it, then call
    ``forward`` for each layer.

    Attention mass (for KV eviction policies such as H2O and SnapKV): for each entry
    ``(i, f)`` of ``batch.observe``, ``mass`` holds a float32 tensor of sequence i's
    ``seq_lens[i]`` KV entries (in page-table order) to which every ``forward`` adds,
    for each entry j, the softmax probability that each of sequence i's new tokens
    f, f + 1, ... puts on j, summed over those tokens and over the query heads; after
    a forward pass's layers, mass[j] is that sum over the layers too. Keys are read as
    the backend's attention reads them (dequantized; a paged format's own page in full
    precision), under the same causal rule, sliding window and soft-cap."""

    name = ""
    quantized_kv = False  # reads every quantized format (int8, int4, fp8); see KVView.gather
    quantized_dtypes: frozenset = frozenset()  # else the quantized KV dtypes it reads (Triton: int8, int4)
    mass: list[torch.Tensor]  # one per entry of batch.observe, in its order; see the class docstring

    def plan(self, batch) -> None:
        """Build whatever index data the batch needs, once for all layers. This base
        part, which every backend's ``plan`` calls, resets ``mass``: zeros for each of
        ``batch.observe``'s sequences (views of one flat tensor, in their order, on the
        KV's device); an empty list, and nothing else, when ``batch.observe`` is empty."""
        self.mass = []
        self._observed: list[Observed] = []
        observe = getattr(batch, "observe", ())  # optional in the batch contract (see radixkv.kernels)
        if not observe:
            return
        ps, device = batch.page_size, batch.kv_indices.device
        lens = [batch.seq_lens[i] for i, _ in observe]
        self.mass = list(torch.zeros(sum(lens), dtype=torch.float32, device=device).split(lens))
        kv_ptr = batch.kv_indptr.tolist()
        q_ptr = [0]
        for n in batch.qo_lens:
            q_ptr.append(q_ptr[-1] + n)
        in_page, offset = torch.arange(ps, device=device, dtype=torch.int64), 0
        for i, first in observe:
            pages = batch.kv_indices[kv_ptr[i] : kv_ptr[i + 1]].to(torch.int64)
            slots = (pages[:, None] * ps + in_page).flatten()[: batch.seq_lens[i]]
            self._observed.append(Observed(i, q_ptr[i], first, batch.qo_lens[i], batch.seq_lens[i], slots, offset))
            offset += batch.seq_lens[i]

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
        tokens from ``k``/``v`` instead when they equal what the pool stored. Adds this
        layer's attention probabilities to ``mass`` (see the class docstring)."""
        raise NotImplementedError

    def forward_rows(self, q, k, v, kv, scale: float, rows: torch.Tensor, sliding_window: int | None = None,
                     logit_softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """``forward``'s output for the query rows ``rows`` alone (``[len(rows), Hq, D]``),
        where ``rows`` holds each sequence's last new token, in the batch's order (what a
        model reads past its last layer). Adds to ``mass`` as ``forward`` does. Here:
        ``forward`` over every row, then those; a backend may attend the rows alone,
        with the bits ``forward`` gives them."""
        return self.forward(q, k, v, kv, scale, sliding_window, logit_softcap)[rows]

    def step_kernels(self, kv, q_heads: int) -> dict[str, int] | None:
        """C kernels a model may call itself for this plan's attention of ``q_heads`` query
        heads over ``kv`` (a layer's view) in every layer, as ``CpuBackend`` offers them;
        None here: call ``forward``."""
        return None

    def _observe(self, q, k, kv, scale, sliding_window, logit_softcap, skip: frozenset[int] = frozenset()) -> None:
        """Add this layer's attention probabilities to ``mass`` for every observed
        sequence but those in ``skip`` (whose mass the backend computes itself), from
        the queries ``q`` [T, Hq, D] and keys read from ``kv`` (the new tokens' rows of
        a paged format's own pages from ``k`` [T, Hkv, D], as ``TorchBackend.attend_paged``
        reads them). Explicit logits in float32, a block of query rows at a time (about
        ``OBSERVE_BLOCK_ELEMENTS`` rows x heads x keys), each row's probabilities
        exp(logit - logsumexp of its row) summed over heads and rows. CPU or CUDA."""
        hq, paged = q.shape[1], kv.format.paged
        for entry, mass in zip(self._observed, self.mass):
            if entry.seq in skip:
                continue
            total, n, start = entry.seq_len, entry.qo_len, entry.q_start
            keys = kv.gather(entry.slots, q.dtype)[0].float()  # [L, Hkv, D]
            own = None
            if paged:  # full-precision rows of the own pages: staged, and this call's new tokens
                own = kv.gather_own(entry.slots, q.dtype)[0].float()
                own[total - n :] = k[start : start + n].float()
            block = max(1, OBSERVE_BLOCK_ELEMENTS // (hq * total))
            for t in range(entry.first, n, block):  # new tokens t .. t + rows - 1
                rows = min(block, n - t)
                first_pos = total - n + t  # the KV index of new token t
                qb = q[start + t : start + t + rows].float()
                mass[: first_pos + rows] += _row_mass(qb, keys, own, first_pos, scale, sliding_window, logit_softcap,
                                                      kv.page_size)  # fmt: skip


def _row_mass(q, keys, own, first_pos, scale, sliding_window, logit_softcap, page_size) -> torch.Tensor:
    """[first_pos + rows] float32: summed over the query heads and the rows of ``q``
    [rows, Hq, D], the softmax probability each of ``keys`` [L, Hkv, D] gets from the
    query at KV index ``first_pos + row``, which sees the entries j <= its index (and
    within the window; the later ones get nothing). With ``own`` (a paged format's
    full-precision rows), entries in the query's own page are read from ``own``."""
    rows, hq, dim = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    last = first_pos + rows  # the keys seen by the block's last query
    q_pos = torch.arange(first_pos, last, device=q.device)[:, None]
    kv_pos = torch.arange(last, device=q.device)[None, :]
    qh = q.reshape(rows, hkv, group, dim).permute(1, 2, 0, 3).reshape(hkv, group * rows, dim)

    def logits(k):  # [Hkv, group, rows, keys] for rows k [keys, Hkv, D]
        return torch.bmm(qh, k.permute(1, 2, 0)).view(hkv, group, rows, -1) * scale

    s = logits(keys[:last])
    if own is not None:
        lo = first_pos // page_size * page_size  # the block's first own page starts here
        own_start = q_pos // page_size * page_size
        s[..., lo:] = torch.where(kv_pos[:, lo:] >= own_start, logits(own[lo:last]), s[..., lo:])
    if logit_softcap is not None:
        s = torch.tanh(s / logit_softcap) * logit_softcap
    visible = kv_pos <= q_pos
    if sliding_window is not None:
        visible &= kv_pos > q_pos - sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)).sum((0, 1, 2))


def stored_as(t: torch.Tensor, kv, part: str) -> torch.Tensor:
    """``t`` (new tokens' K, ``part="k"``, or V) as the pool stored it and a backend
    reads it back, in ``t.dtype``: itself when the format keeps its dtype, else rounded
    (quantized and dequantized) by the format."""
    return kv.stored(t, part)
