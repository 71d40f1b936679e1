"""Reference attention backend in plain torch: gather each sequence's pages, then SDPA.

Correct on CPU and GPU for any page size; the other backends are tested against it.
A batch made only of single-token sequences (decode) runs as one padded SDPA call;
anything else runs sequence by sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixkv.kernels.base import AttentionBackend, stored_as


class TorchBackend(AttentionBackend):
    name = "torch"
    quantized_kv = True  # dequantizes what it gathers

    def plan(self, batch) -> None:
        super().plan(batch)
        ps = batch.page_size
        device = batch.kv_indices.device
        offsets = torch.arange(ps, device=device, dtype=torch.int64)
        slots = (batch.kv_indices.to(torch.int64)[:, None] * ps + offsets).flatten()  # [nnz * ps]
        kv_ptr = batch.kv_indptr.tolist()
        self.kv_slots = [slots[kv_ptr[i] * ps : kv_ptr[i] * ps + n] for i, n in enumerate(batch.seq_lens)]
        self.qo_lens = batch.qo_lens
        self.seq_lens = batch.seq_lens
        self.out_slots = batch.out_slots
        self._masks: dict = {}  # sliding window -> sequence index -> mask, filled by the first layer
        self.decode = len(self.qo_lens) > 1 and all(n == 1 for n in self.qo_lens)
        self.pad_slots = None  # the padded decode tables, built by the first layer that needs them

    def _pad_decode(self) -> None:
        device = self.out_slots.device
        longest = max(self.seq_lens)
        pad = torch.empty(len(self.seq_lens), longest, dtype=torch.int64, device=device)
        for i, s in enumerate(self.kv_slots):
            pad[i, : len(s)] = s
            pad[i, len(s) :] = s[0]  # masked out; any written slot keeps garbage (NaN) away
        self.pad_slots = pad
        self.pad_pos = torch.arange(longest, device=device)[None, :]
        self.pad_len = torch.tensor(self.seq_lens, device=device)[:, None]

    def forward(self, q, k, v, kv, scale, sliding_window=None, logit_softcap=None):
        if kv.format.paged:
            out = torch.empty_like(q)
            self.attend_paged(q, k, v, kv, scale, sliding_window, logit_softcap, out)
        elif self.decode:
            if self.pad_slots is None:
                self._pad_decode()
            out = self._decode(q, kv, scale, sliding_window, logit_softcap)
        else:
            out = torch.empty_like(q)
            k_stored, v_stored = stored_as(k, kv, "k"), stored_as(v, kv, "v")
            self.attend_sequences(q, k_stored, v_stored, kv, scale, sliding_window, logit_softcap, out)
        if self.mass:
            self._observe(q, k, kv, scale, sliding_window, logit_softcap)
        return out

    def attend_sequences(self, q, k, v, kv, scale, sliding_window, logit_softcap, out,
                         skip: frozenset[int] = frozenset()) -> None:  # fmt: skip
        """Attention sequence by sequence into ``out``, leaving the sequences in ``skip``;
        ``k``/``v``: the new tokens as stored (``stored_as``); cached KV is read (and
        dequantized) through ``kv.gather``."""
        start = 0
        masks: dict = self._masks.setdefault(sliding_window, {})
        for i, (n, total, slots) in enumerate(zip(self.qo_lens, self.seq_lens, self.kv_slots)):
            if i in skip:
                start += n
                continue
            if n == total:  # nothing cached: the new K/V (as stored) are the whole sequence
                ki, vi = k[start : start + n], v[start : start + n]
            else:
                ki, vi = kv.gather(slots, q.dtype)
            # 4-D [1, H, len, D]: SDPA's fused CPU kernel handles GQA only in this form.
            qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[start : start + n], ki, vi))
            if logit_softcap is None and sliding_window is None and (n == total or n == 1):
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=n > 1, scale=scale, enable_gqa=True)
            else:
                mask = masks.get(i)
                if mask is None:  # the first layer builds it; the others reuse it
                    q_pos = torch.arange(total - n, total, device=q.device)[:, None]
                    kv_pos = torch.arange(total, device=q.device)[None, :]
                    mask = kv_pos <= q_pos
                    if sliding_window is not None:
                        mask &= kv_pos > q_pos - sliding_window
                    masks[i] = mask
                oi = _attend_masked(qi, ki, vi, mask, scale, logit_softcap)
            out[start : start + n] = oi[0].transpose(0, 1)
            start += n

    def attend_paged(self, q, k, v, kv, scale, sliding_window, logit_softcap, out,
                     skip: frozenset[int] = frozenset()) -> None:  # fmt: skip
        """Attention over a paged format (quantized on seal; see radixkv.cache.sealing):
        a query at position p reads the pages before its own page as sealed
        (``kv.gather``) and its own page's tokens up to itself in full precision
        (``kv.gather_own``, this call's K/V for the new tokens):

            keys   |== sealed pages (dequantized) ==|== own page, full precision ==|
            query p                                  ^ page start       p ^
        """
        ps, start = kv.page_size, 0
        for i, (n, total, slots) in enumerate(zip(self.qo_lens, self.seq_lens, self.kv_slots)):
            if i in skip:
                start += n
                continue
            k_sealed, v_sealed = kv.gather(slots, q.dtype)
            k_own, v_own = kv.gather_own(slots, q.dtype)
            k_own[total - n :], v_own[total - n :] = k[start : start + n], v[start : start + n]
            q_pos = torch.arange(total - n, total, device=q.device)[:, None]
            kv_pos = torch.arange(total, device=q.device)[None, :]
            own_start = q_pos // ps * ps
            visible = kv_pos <= q_pos
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
            mask = torch.cat([visible & (kv_pos < own_start), visible & (kv_pos >= own_start)], 1)
            ki, vi = torch.cat([k_sealed, k_own]), torch.cat([v_sealed, v_own])
            qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[start : start + n], ki, vi))
            oi = _attend_masked(qi, ki, vi, mask, scale, logit_softcap)
            out[start : start + n] = oi[0].transpose(0, 1)
            start += n

    def _decode(self, q, kv, scale, sliding_window, logit_softcap):
        shape = (*self.pad_slots.shape, *kv.k.shape[2:])
        kb, vb = kv.gather(self.pad_slots.view(-1), q.dtype)
        kb = kb.view(shape).permute(0, 2, 1, 3)
        vb = vb.view(shape).permute(0, 2, 1, 3)
        mask = self.pad_pos < self.pad_len  # [B, L]
        if sliding_window is not None:
            mask &= self.pad_pos >= self.pad_len - sliding_window
        mask = mask[:, None, None, :]
        qb = q[:, :, None, :]  # [B, Hq, 1, D]
        return _attend_masked(qb, kb, vb, mask, scale, logit_softcap)[:, :, 0, :]


def _attend_masked(q, k, v, mask, scale, logit_softcap):
    """Attention under a boolean ``mask``: SDPA, or explicitly with soft-capped logits."""
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return _attend(q, k, v, mask, scale, logit_softcap)


def _attend(q, k, v, mask, scale, logit_softcap):
    """Explicit attention, for what SDPA cannot express (soft-capped logits)."""
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)
