"""Quantize on seal: how a pool of a paged format (int4) stores and reads KV.

A paged format quantizes K per channel over a whole page, so a page can only be
quantized once all its tokens are written. Until then its rows wait in full precision
in a small staging area beside the pool; the write that fills the page seals it
(quantizes the whole page at once). A sealed page's bytes therefore depend only on the
K/V of its own tokens, never on how they were chunked.

    page  |== sealed: int4 codes + params ==|== sealed ==|== staged: float32 rows ==|
    query at position p reads:  pages before p's page as sealed  |  p's own page in full precision

What a query reads is fixed by where it stands, not by when it runs: the pages before
its own page as they are sealed, the tokens of its own page up to itself in full
precision (``gather`` and ``gather_own``; the torch backend combines them). A token
decoded alone, or prefilled in a chunk that fills its page, sees the same values, so
prefill = decode, cache on = cache off and batched = alone hold within the format.

Staging slots come and go with partial pages: a page that fills keeps its slot until
the next forward begins (its own tokens still read it in full precision in this one),
and a page freed loses it at once. The area grows when more pages are partial at once.
Not thread-safe (one thread owns the pool).
"""

from __future__ import annotations

import numpy as np
import torch


class Sealer:
    """Staging and sealing for one ``KVPool`` of a paged format."""

    def __init__(self, pool, capacity: int = 16):
        c = pool.config
        self.pool = pool
        self.format = pool.format
        self.page_size = c.page_size
        self.heads, self.dim = c.num_kv_heads, c.head_dim
        self.device = c.device
        empty = (0, self.page_size, self.heads, self.dim)
        self.k = [torch.empty(empty, device=self.device) for _ in range(c.num_layers)]
        self.v = [torch.empty(empty, device=self.device) for _ in range(c.num_layers)]
        self.capacity = 0
        self._free_slots: list[int] = []
        self._grow(capacity)
        self.slot_of = np.full(pool.num_pages, -1, dtype=np.int64)  # page -> staging slot (host, for planning)
        self._slot_of = torch.full((pool.num_pages,), -1, dtype=torch.int64, device=self.device)  # its copy, for reads
        self.sealed = torch.zeros(pool.num_pages, dtype=torch.bool, device=self.device)
        self._pending: np.ndarray = np.empty(0, dtype=np.int64)  # sealed last forward: slots to release
        self._plan: dict | None = None

    # -- writing ---------------------------------------------------------------------------

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write one layer's new rows: into staging for pages that stay partial, and
        seal every page this write fills. Layer 0 plans the forward (every layer writes
        the same slots)."""
        if layer == 0:
            self._plan = self._plan_writes(slots)
        p = self._plan
        rows = (-1, self.heads, self.dim)
        if p["stage_rows"] is not None:
            self.k[layer].view(rows).index_copy_(0, p["stage_dest"], k.index_select(0, p["stage_rows"]).float())
            self.v[layer].view(rows).index_copy_(0, p["stage_dest"], v.index_select(0, p["stage_rows"]).float())
        if p["seal_pages"] is None:
            return
        parts_k, parts_v = [], []
        if p["full_rows"] is not None:  # pages written whole by this call
            parts_k.append(k.float()[p["full_rows"]])
            parts_v.append(v.float()[p["full_rows"]])
        if p["seal_slots"] is not None:  # staged pages this call completes
            parts_k.append(self.k[layer].index_select(0, p["seal_slots"]))
            parts_v.append(self.v[layer].index_select(0, p["seal_slots"]))
        kc, kp, vc, vp = self.format.quantize_pages(torch.cat(parts_k), torch.cat(parts_v))
        pool, pages = self.pool, p["seal_pages"]
        pool.k[layer].index_copy_(0, pages, kc)
        pool.k_params[layer].index_copy_(0, pages, kp)
        pool.v[layer].index_copy_(0, pages, vc)
        pool.v_params[layer].index_copy_(0, pages, vp)

    def _plan_writes(self, slots: torch.Tensor) -> dict:
        """Which rows go to staging, which pages seal, from what."""
        self._release(self._pending)
        ps = self.page_size
        s = slots.cpu().numpy()
        pages, offsets = s // ps, s % ps
        uniq, inverse, counts = np.unique(pages, return_inverse=True, return_counts=True)
        ends = np.zeros(uniq.size, dtype=bool)
        ends[inverse[offsets == ps - 1]] = True  # this write reaches the page's last slot
        whole = counts == ps  # every slot of the page written now: seal from this call's rows
        self._release(uniq[whole])  # (a page written whole again needs no staging rows)
        staged = ~whole
        need = uniq[staged & (self.slot_of[uniq] < 0)]
        self._take_slots(need)
        dev = self.device
        plan = {"stage_rows": None, "stage_dest": None, "full_rows": None, "seal_slots": None, "seal_pages": None}
        in_stage = staged[inverse]
        if in_stage.any():
            rows = np.flatnonzero(in_stage)
            plan["stage_rows"] = torch.from_numpy(rows).to(dev)
            plan["stage_dest"] = torch.from_numpy(self.slot_of[pages[rows]] * ps + offsets[rows]).to(dev)
        seal_full, seal_staged = uniq[whole], uniq[staged & ends]
        if seal_full.size:
            order = np.argsort(pages * ps + offsets, kind="stable")  # rows by (page, offset)
            full_rows = order[np.isin(pages[order], seal_full)].reshape(-1, ps)
            plan["full_rows"] = torch.from_numpy(full_rows).to(dev)
        if seal_staged.size:
            plan["seal_slots"] = torch.from_numpy(self.slot_of[seal_staged]).to(dev)
        sealing = np.concatenate([seal_full, seal_staged])
        if sealing.size:
            plan["seal_pages"] = torch.from_numpy(sealing).to(dev)
            self.sealed[plan["seal_pages"]] = True
        self._pending = seal_staged  # their own tokens read the staging rows until this forward ends
        return plan

    # -- reading ---------------------------------------------------------------------------

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` as stored: dequantized from sealed pages, the staged
        rows of partial pages as written."""
        ps, h = self.page_size, self.heads
        pages = slots // ps
        pool = self.pool
        k = self.format.dequantize_k_rows(
            pool.k[layer].view(-1, h, self.dim // 2).index_select(0, slots), pool.k_params[layer].index_select(0, pages), dtype
        )  # fmt: skip
        v = self.format.dequantize_v_rows(
            pool.v[layer].view(-1, h, self.dim // 2).index_select(0, slots),
            pool.v_params[layer].view(-1, h, 2).index_select(0, slots), dtype,
        )  # fmt: skip
        partial = torch.nonzero(~self.sealed.index_select(0, pages))[:, 0]
        if partial.numel():
            ks, vs = self._staged_rows(layer, slots.index_select(0, partial), dtype)
            k[partial], v[partial] = ks, vs
        return k, v

    def gather_own(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` in full precision from staging (a page's own tokens, as
        the queries in that page read them); zeros where a page has no staging rows."""
        k = torch.zeros(slots.numel(), self.heads, self.dim, dtype=dtype, device=slots.device)
        v = torch.zeros_like(k)
        have = torch.nonzero(self._slot_of.index_select(0, slots // self.page_size) >= 0)[:, 0]
        if have.numel():
            k[have], v[have] = self._staged_rows(layer, slots.index_select(0, have), dtype)
        return k, v

    def staging(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For kernels that read staged rows in place: layer ``layer``'s staging K and V
        (``[capacity, page_size, H, D]`` float32) and the page -> staging slot map
        (``[num_pages]`` int64 on the pool's device, -1: none). Valid for one forward:
        layer 0's store may grow (reallocate) the area."""
        return self.k[layer], self.v[layer], self._slot_of

    def _staged_rows(self, layer, slots, dtype):
        ps = self.page_size
        idx = self._slot_of.index_select(0, slots // ps) * ps + slots % ps
        rows = (-1, self.heads, self.dim)
        return self.k[layer].view(rows).index_select(0, idx).to(dtype), self.v[layer].view(rows).index_select(0, idx).to(dtype)

    # -- slots -------------------------------------------------------------------------------

    def forget(self, pages: np.ndarray) -> None:
        """Pages went free: unsealed, and their staging slots released."""
        if not pages.size:
            return
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.device)
        self.sealed[idx] = False
        self._release(pages)

    def _release(self, pages: np.ndarray) -> None:
        if not pages.size:
            return
        slots = self.slot_of[pages]
        held = slots >= 0
        if held.any():
            self._free_slots.extend(slots[held].tolist())
            self._assign(pages[held], np.full(int(held.sum()), -1, dtype=np.int64))

    def _take_slots(self, pages: np.ndarray) -> None:
        if not pages.size:
            return
        if len(self._free_slots) < pages.size:
            self._grow(max(self.capacity, pages.size - len(self._free_slots)))
        self._assign(pages, np.array([self._free_slots.pop() for _ in range(pages.size)], dtype=np.int64))

    def _assign(self, pages: np.ndarray, slots: np.ndarray) -> None:
        """``slot_of[pages] = slots`` (-1: none), on the host and on the device."""
        self.slot_of[pages] = slots
        self._slot_of[torch.from_numpy(pages.astype(np.int64)).to(self.device)] = torch.from_numpy(slots).to(self.device)

    def _grow(self, more: int) -> None:
        """``more`` staging slots (NaN until written), the lowest free slot next."""
        shape = (more, self.page_size, self.heads, self.dim)
        self.k = [torch.cat([t, torch.full(shape, float("nan"), device=self.device)]) for t in self.k]
        self.v = [torch.cat([t, torch.full(shape, float("nan"), device=self.device)]) for t in self.v]
        self._free_slots.extend(range(self.capacity + more - 1, self.capacity - 1, -1))
        self.capacity += more

    def staged_pages(self) -> int:
        """Pages holding a staging slot now."""
        return int((self.slot_of >= 0).sum())
