"""KV page pool: preallocated K/V tensors and a reference-counted page allocator.

Two classes:

- ``PageAllocator`` hands out page ids from a free stack and keeps one reference
  count per page. It owns no tensors, so the hit-rate simulator uses it alone.
- ``KVPool`` is a ``PageAllocator`` that also owns the K and V pages of every layer,
  in FlashInfer's NHD paged layout ``[num_pages, page_size, H, D]`` and one KV format
  (``radixkv.cache.formats``); it alone writes them (``store_kv``).

Owners of a reference are the radix tree (one per page it holds) and each running
sequence (one per page of its own: computed but not yet in the tree). A page goes back
to the free stack exactly when its count reaches 0. The engine's pages each have one
owner (``KVCacheManager``: a sequence reads the tree's pages under a lock on their
node, not through a reference), so ``free`` serves it in one pass over the ids.

Page ids are ``np.int32`` arrays everywhere: they fit FlashInfer's int32
``kv_indices`` and convert to tensors without a copy (``torch.from_numpy``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from radixkv.cache.formats import KVFormat, KVScales, KVView, kv_format
from radixkv.cache.sealing import Sealer
from radixkv.errors import IntegrityError, OutOfPagesError
from radixkv.kernels import pages as page_loops

MAX_PAGES = 2**31 - 1  # page ids must fit int32


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process could still take on ``device``: on the CPU the kernel's
    ``MemAvailable``, lowered to what a cgroup (v2) memory limit leaves; on CUDA the
    device's free memory. None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            free = min(free, int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    return max(free, 0)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor. On the CPU its memory is an anonymous mapping of its own, which the
    system commits page by page as it is first written: a pool sized for a share of free
    memory costs resident memory only as the cache fills (torch.zeros would write every
    byte now; ``PoolConfig.commit`` does that on purpose). Not calloc: below malloc's
    mapping threshold (a part of a small pool) calloc may hand out reused heap memory,
    which it zeroes, and so commits, at once. Private (mmap's default is shared memory,
    which takes no transparent huge pages) and advised to take huge pages, as numpy
    advises its large arrays: a first write then commits 2 MiB at once, 2.3x faster a
    byte here, and the attention kernels' page reads miss the TLB less."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system: calloc's memory
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)

PageIds = np.ndarray  # 1-D np.int32
_ONE = np.int32(1)  # ufunc.at takes a fast path when the operand's dtype matches


def as_page_ids(pages, field: str = "pages") -> PageIds:
    """Return ``pages`` as a 1-D ``np.int32`` array (no copy when it already is one).

    Raises ValueError when the input is not a 1-D sequence of integers within int32.
    """
    if isinstance(pages, np.ndarray) and pages.dtype == np.int32 and pages.ndim == 1:
        return pages if pages.flags.c_contiguous else pages.copy()
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().cpu().numpy()
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise ValueError(f"{field} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{field} must hold integers, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.min() < 0 or arr.max() > MAX_PAGES:
            raise ValueError(f"{field} must lie in [0, {MAX_PAGES}]")
        arr = arr.astype(np.int32)
    return arr


def _repeated(pages: PageIds) -> PageIds:
    """The ids listed more than once in ``pages``, ascending."""
    ids, counts = np.unique(pages, return_counts=True)
    return ids[counts > 1]


class PageAllocator:
    """Free stack plus one reference count per page.

    ``alloc`` returns ascending ids from a fresh pool and reuses freed pages last in,
    first out (the pages one call frees come back in the order it listed them). Every
    method validates its input before it changes anything, so a call that raises
    leaves the allocator exactly as it was. The loops over ids run in
    ``radixkv.kernels.pages`` (compiled, or numpy without a C compiler).
    """

    def __init__(self, num_pages: int, loops=None):
        """``loops``: the implementation of ``radixkv.kernels.pages`` to use (default
        ``pages.native()``: compiled when a C compiler is here; ``pages.NumpyPages``)."""
        if not isinstance(num_pages, (int, np.integer)) or isinstance(num_pages, bool):
            raise TypeError(f"num_pages must be an int, got {type(num_pages).__name__}")
        if not 0 < num_pages <= MAX_PAGES:
            raise ValueError(f"num_pages must be in [1, {MAX_PAGES}], got {num_pages}")
        self.num_pages = int(num_pages)
        self._refs = np.zeros(self.num_pages, dtype=np.int32)
        self.loops = loops or page_loops.native()
        # Free stack: the top is the end of the array, so the lowest ids come out first.
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self._top = self.num_pages

    # -- queries ---------------------------------------------------------------

    page_bytes = 0  # an allocator owns no tensors: its pages have no bytes (KVPool's do)

    def read_pages(self, pages: PageIds) -> np.ndarray:
        """The pages' bytes, ``[len(pages), page_bytes]`` uint8: none here (the
        simulator's tiers move pages without bytes). Does not mutate."""
        return np.zeros((len(as_page_ids(pages)), 0), dtype=np.uint8)

    def write_pages(self, pages: PageIds, data: np.ndarray) -> None:
        """Put ``read_pages``' bytes into ``pages``: nothing to put here."""

    copies_rows = True  # copy_rows works (a KVPool of a paged format's cannot: its pages seal whole)

    def copy_rows(self, src: int, dst: int, count: int) -> None:
        """Copy the KV of the first ``count`` token slots of page ``src`` into page
        ``dst`` (owned by the caller): nothing to copy here."""

    def num_free(self) -> int:
        """Pages on the free stack. Does not mutate."""
        return self._top

    def num_used(self) -> int:
        """Pages with a reference count above 0. Does not mutate."""
        return self.num_pages - self._top

    def refcount(self, pages) -> np.ndarray:
        """Reference counts of ``pages`` (a copy). Does not mutate."""
        return self._counts(as_page_ids(pages))

    def refcounts(self) -> np.ndarray:
        """Every page's reference count, as a read-only view (for integrity checks)."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    # -- mutations -------------------------------------------------------------

    def alloc(self, n: int) -> PageIds:
        """Take ``n`` free pages, each with reference count 1.

        Mutates the free stack. Raises ValueError for a negative ``n`` and
        OutOfPagesError (changing nothing) when fewer than ``n`` pages are free.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._top:
            raise OutOfPagesError(n, self._top)
        top = self._top
        pages = self._stack[top - n : top][::-1].copy()
        self._top = top - n
        self.loops.fill(self._refs, pages, 1)
        return pages

    def incref(self, pages) -> None:
        """Add one reference to each entry of ``pages`` (a page listed twice gets two).

        Raises ValueError, changing nothing, if an id is out of range or a page is free:
        a new owner can only share a page that somebody already owns.
        """
        pages = as_page_ids(pages)
        counts = self._counts(pages)
        if np.count_nonzero(counts) != counts.size:
            raise ValueError(f"pages not owned by anybody cannot be shared: {pages[counts == 0][:8].tolist()}")
        np.add.at(self._refs, pages, _ONE)

    def free(self, pages) -> int:
        """Give back pages their one owner holds alone (reference count 1, each listed
        once): the sole-owner fast path of ``decref``, one pass over the ids. Returns
        how many went free (``len(pages)``).

        Mutates the free stack. Raises ValueError, changing nothing, if an id is out of
        range, a page has another count than 1, or an id is listed twice.
        """
        pages = as_page_ids(pages)
        top = self._free_sole(pages)
        if top >= 0:
            return top
        if top == page_loops.NOT_SOLE:
            counts = self._refs.take(pages)
            raise ValueError(f"pages must have exactly one owner to be freed: {pages[counts != 1][:8].tolist()}")
        if top == page_loops.TWICE:
            raise ValueError(f"pages lists ids twice: {_repeated(pages)[:8].tolist()}")
        self._counts(pages)  # ValueError for ids out of range
        raise IntegrityError(f"the free stack cannot take {pages.size} pages at {self._top}")

    def decref(self, pages) -> int:
        """Drop one reference from each entry of ``pages``; return how many pages became free.

        Pages whose count reaches 0 go back on the free stack. Raises ValueError,
        changing nothing, if an id is out of range or more references are dropped
        than a page has.
        """
        pages = as_page_ids(pages)
        self._counts(pages)
        return self.release(pages)

    def _free_sole(self, pages: PageIds) -> int:
        """Free ``pages`` if each has count 1 and is listed once; how many went free, or
        the loops' negative status (nothing changed)."""
        top = self.loops.free_sole(self._refs, self._stack, self._top, pages)
        if top < 0:
            return top
        freed, self._top = top - self._top, top
        return freed

    def _counts(self, pages: PageIds) -> np.ndarray:
        """Reference counts of ``pages``; ValueError for ids outside the pool (read as
        unsigned, a negative id is out of range too)."""
        try:
            return self._refs.take(pages.view(np.uint32))
        except IndexError:
            raise ValueError(f"pages must lie in [0, {self.num_pages}), got {pages.min()}..{pages.max()}") from None

    def release(self, pages: PageIds) -> int:
        """``decref`` for an int32 array of ids in range that the caller holds (the tree,
        dropping its own pages). Still raises ValueError, changing nothing, when more
        references are dropped than a page has."""
        if not pages.size:
            return 0
        freed = self._free_sole(pages)  # the caller owns each alone: as ``free``
        if freed >= 0:
            return freed
        refs = self._refs
        np.subtract.at(refs, pages, _ONE)
        after = refs.take(pages)
        if np.count_nonzero(after < 0):
            np.add.at(refs, pages, _ONE)
            raise ValueError(f"pages released more often than owned: {pages[after < 0][:8].tolist()}")
        zero = pages[after == 0]
        _, first = np.unique(zero, return_index=True)  # a page listed twice reached 0 once
        freed = zero[np.sort(first)]
        top = self._top
        self._stack[top : top + freed.size] = freed[::-1]  # as ``free``: the first listed on top
        self._top = top + freed.size
        return int(freed.size)

    # -- checks ----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Prove ``free + referenced == total`` and that no page is both.

        Does not mutate. Raises IntegrityError describing the first violation.
        """
        free = self._stack[: self._top]
        if np.unique(free).size != free.size:
            raise IntegrityError("a page is on the free stack twice")
        if (self._refs < 0).any():
            raise IntegrityError("negative reference count")
        if (self._refs[free] != 0).any():
            raise IntegrityError(f"pages both free and referenced: {free[self._refs[free] != 0][:8].tolist()}")
        referenced = int((self._refs > 0).sum())
        if referenced + free.size != self.num_pages:
            raise IntegrityError(
                f"free ({free.size}) + referenced ({referenced}) != total ({self.num_pages})"
            )


@dataclass(frozen=True)
class PoolConfig:
    """Shape of the KV pool. Give ``num_pages`` or ``memory_bytes`` (not both).

    ``kv_dtype``: the KV format (a ``KVFormat``, its name or a torch dtype; see
    ``radixkv.cache.formats``), independent of the weights' dtype. Bytes per page
    follow from the format."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    kv_dtype: str | torch.dtype | KVFormat = "fp32"
    device: str = "cpu"
    num_pages: int | None = None
    memory_bytes: int | None = None
    kv_scales: KVScales | None = None  # a head-scaled format's (fp8) per-(layer, KV head) scales
    commit: bool = False  # on the CPU: write every page now (see KVPool), not as the cache first fills it

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        object.__setattr__(self, "kv_dtype", kv_format(self.kv_dtype))
        fmt, scales = self.kv_dtype, self.kv_scales
        fmt.check_scales(scales is not None)
        if fmt.paged and self.head_dim % 2:
            raise ValueError(f"kv_dtype {fmt.name} packs two codes per byte: head_dim must be even, got {self.head_dim}")
        if scales is not None and (scales.k.shape != (self.num_layers, self.num_kv_heads) or scales.v.shape != scales.k.shape):
            raise ValueError(f"kv_scales must be [num_layers, num_kv_heads] = [{self.num_layers}, {self.num_kv_heads}], "
                             f"got {list(scales.k.shape)} and {list(scales.v.shape)}")  # fmt: skip
        if (self.num_pages is None) == (self.memory_bytes is None):
            raise ValueError("give exactly one of num_pages and memory_bytes")
        if self.memory_bytes is not None and self.memory_bytes < self.bytes_per_page:
            raise ValueError(
                f"memory_bytes must hold at least one page ({self.bytes_per_page} bytes), "
                f"got {self.memory_bytes}"
            )

    @property
    def format(self) -> KVFormat:
        return self.kv_dtype  # normalised to a KVFormat by __post_init__

    @property
    def kv_identity(self) -> str:
        """The KV format's identity with these scales (``KVFormat.identity``)."""
        return self.format.identity(self.kv_scales)

    @property
    def bytes_per_page(self) -> int:
        """K and V of one page across all layers, in the pool's format."""
        return self.format.bytes_per_page(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    def resolved_num_pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return min(self.memory_bytes // self.bytes_per_page, MAX_PAGES)


class KVPool(PageAllocator):
    """A page allocator that owns the K/V pages of every layer, in one KV format.

    The pool is the only writer of KV: ``store_kv`` puts new tokens at their slots
    (``slot = page * page_size + offset``); ``view(layer)`` describes a layer's KV to an
    attention backend, which only reads it. Per layer, K and V are
    ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD paged layout).
    """

    def __init__(self, config: PoolConfig):
        super().__init__(config.resolved_num_pages())
        self.config = config
        self.page_size = config.page_size
        self.format = fmt = config.format
        shape = (self.num_pages, config.page_size, config.num_kv_heads, config.head_dim)
        layers, device = range(config.num_layers), config.device
        codes = (*shape[:3], shape[3] // 2) if fmt.paged else shape  # paged: two 4-bit codes a byte
        self.k = [_zeros(codes, fmt.dtype, device) for _ in layers]
        self.v = [_zeros(codes, fmt.dtype, device) for _ in layers]
        self.k_params = self.v_params = None
        if fmt.scale_dtype is not None:  # per (slot, KV head), beside the pages
            params = (*shape[:3], fmt.row_params)
            k_params = (shape[0], shape[2], shape[3], 2) if fmt.paged else params  # paged K: per channel of a page
            self.k_params = [_zeros(k_params, fmt.scale_dtype, device) for _ in layers]
            self.v_params = [_zeros(params, fmt.scale_dtype, device) for _ in layers]
        self.sealer = Sealer(self) if fmt.paged else None
        self.commit_seconds: float | None = None  # how long committing the pages took (config.commit on the CPU)
        if config.commit and torch.device(device).type == "cpu":
            self._commit()
        rows = (-1, config.num_kv_heads, codes[3])  # one slot's row (a paged format's packed codes)
        # index_copy_ has no CPU kernel for 8-bit floats: write their bytes
        as_rows = (lambda t: t.view(rows).view(torch.uint8)) if fmt.head_scaled else (lambda t: t.view(rows))
        self._k_rows = [as_rows(t) for t in self.k]
        self._v_rows = [as_rows(t) for t in self.v]
        scales = config.kv_scales
        self._views = [
            KVView(self.k[i], self.v[i], fmt,
                   self.k_params[i] if self.k_params else None, self.v_params[i] if self.v_params else None,
                   scales.k[i].to(device) if scales is not None else None,
                   scales.v[i].to(device) if scales is not None else None, self.sealer, i)  # fmt: skip
            for i in layers
        ]

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write new tokens' K and V (``[T, num_kv_heads, head_dim]``, any float dtype)
        into layer ``layer`` at ``slots`` (``[T]`` int64 on the pool's device),
        converting to the pool's format (quantizing, with the parameters beside). Mutates
        that layer's pages only."""
        if self.sealer is not None:
            return self.sealer.store(layer, k, v, slots)
        view = self._views[layer]
        kq, kp = self.format.quantize(k, view.k_scale)
        vq, vp = self.format.quantize(v, view.v_scale)
        if self.format.head_scaled:
            kq, vq = kq.view(torch.uint8), vq.view(torch.uint8)
        self._k_rows[layer].index_copy_(0, slots, kq)
        self._v_rows[layer].index_copy_(0, slots, vq)
        if kp is not None:
            rows = (-1, self.config.num_kv_heads, self.format.row_params)
            self.k_params[layer].view(rows).index_copy_(0, slots, kp)
            self.v_params[layer].view(rows).index_copy_(0, slots, vp)

    def _commit(self) -> None:
        """Write every page's memory once (zeros over zeros: the content is unchanged), so
        that the system commits it now and no forward pays for it. A first write to a
        page costs the kernel a fault and a zeroed page, and a virtual machine's host its
        backing: ~1.4 ms a MiB on the 2-core VM of the benchmarks, 0.7 s of a RAG run's
        18.5 s when its forwards were the first to write the pool. Sets
        ``commit_seconds``."""
        t0 = time.perf_counter()
        for part in self._page_parts():
            part.view(torch.uint8).zero_()
        self.commit_seconds = time.perf_counter() - t0

    def resident_bytes(self) -> int | None:
        """Bytes of the pool's page memory the system holds in RAM now: its memory pages
        that are resident (Linux ``mincore`` over every page part, so a part's first and
        last memory page count whole). A CPU pool's memory is committed as it is first
        written unless ``config.commit``. None where that cannot be told (not Linux, not
        the CPU)."""
        if torch.device(self.config.device).type != "cpu":
            return None
        try:
            mincore = ctypes.CDLL(None, use_errno=True).mincore
        except (OSError, AttributeError):
            return None
        mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for part in self._page_parts():
            start = part.data_ptr() // page * page
            end = part.data_ptr() + part.numel() * part.element_size()
            flags = np.zeros(-(-(end - start) // page), dtype=np.uint8)
            if mincore(start, end - start, flags.ctypes.data) != 0:
                return None
            total += int(np.count_nonzero(flags & 1)) * page
        return total

    def _page_parts(self) -> list[torch.Tensor]:
        """Every tensor that holds a page's KV, each indexed by page id on dim 0: per
        layer K, V and (quantized) their parameters."""
        parts = []
        for layer in range(self.config.num_layers):
            parts += [self.k[layer], self.v[layer]]
            if self.k_params is not None:
                parts += [self.k_params[layer], self.v_params[layer]]
        return parts

    def read_pages(self, pages: PageIds) -> np.ndarray:
        """The bytes of ``pages`` (whole pages, sealed if the format seals) as one
        ``[len(pages), page_bytes]`` uint8 array on the host: every layer's K and V and
        their parameters, in ``_page_parts`` order (what a store keeps). Does not
        mutate."""
        idx = torch.from_numpy(as_page_ids(pages).astype(np.int64)).to(self.config.device)
        rows = [t.index_select(0, idx).view(torch.uint8).reshape(len(idx), w) for t, w in self._widths()]
        return torch.cat(rows, 1).cpu().numpy()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page as ``read_pages`` lays it out."""
        return sum(w for _, w in self._widths())

    def _widths(self) -> list[tuple[torch.Tensor, int]]:
        return [(t, t[0].numel() * t.element_size()) for t in self._page_parts()]

    def write_pages(self, pages: PageIds, data: np.ndarray) -> None:
        """Put ``read_pages``' bytes (``[len(pages), page_bytes]`` uint8) into ``pages``
        (owned by the caller, e.g. just allocated); a paged format's pages are sealed
        as they come. Mutates those pages only. Raises ValueError for the wrong shape."""
        pages = as_page_ids(pages)
        if data.dtype != np.uint8 or data.shape != (len(pages), self.page_bytes):
            raise ValueError(f"page data must be uint8 [{len(pages)}, {self.page_bytes}], got {data.dtype} {list(data.shape)}")
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.config.device)
        src = torch.from_numpy(np.ascontiguousarray(data)).to(self.config.device)
        at = 0
        for t, w in self._widths():  # each part's bytes, as rows of its pages
            t.view(torch.uint8).view(t.shape[0], w).index_copy_(0, idx, src[:, at : at + w])
            at += w
        if self.sealer is not None:
            self.sealer.sealed[idx] = True

    @property
    def copies_rows(self) -> bool:
        """Whether ``copy_rows`` works: not for a paged format (its pages are sealed whole)."""
        return not self.format.paged

    def copy_rows(self, src: int, dst: int, count: int) -> None:
        """Copy the KV (every layer's K and V and their parameters) of the first
        ``count`` token slots of page ``src`` into page ``dst`` (owned by the caller,
        e.g. just allocated): the same bytes. Mutates ``dst`` only. Raises ValueError for
        a paged format (``copies_rows`` False: its K parameters cover a page) or a count
        outside ``1..page_size``."""
        if not self.copies_rows:
            raise ValueError(f"kv_dtype {self.format.name} seals whole pages: their rows cannot be copied apart")
        if not 0 < count <= self.page_size:
            raise ValueError(f"count must be in [1, {self.page_size}], got {count}")
        for part in self._page_parts():
            part[dst, :count] = part[src, :count]

    @property
    def identity(self) -> str:
        """The KV format's identity (``PoolConfig.kv_identity``)."""
        return self.config.kv_identity

    def view(self, layer: int) -> KVView:
        """Layer ``layer``'s KV for an attention backend. Does not mutate."""
        return self._views[layer]

    def free(self, pages) -> int:
        pages = as_page_ids(pages)
        freed = super().free(pages)
        if self.sealer is not None:
            self.sealer.forget(pages)
        return freed

    def release(self, pages: PageIds) -> int:
        freed = super().release(pages)
        if self.sealer is not None and freed:
            self.sealer.forget(pages[self._refs.take(pages) == 0])
        return freed

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at ``slots`` (``[T, num_kv_heads, head_dim]`` copies) as a
        backend reads them: in the format's dtype, or dequantized to float32 for a
        quantized format. Does not mutate."""
        dtype = torch.float32 if self.format.quantized else self.format.dtype
        return self._views[layer].gather(slots, dtype)

    def slots(self, pages, start: int, stop: int) -> torch.Tensor:
        """Slot ids (int64) of token positions ``start..stop-1`` of a sequence whose
        page table is ``pages``. Does not mutate."""
        if not 0 <= start <= stop:
            raise ValueError(f"need 0 <= start <= stop, got start={start} stop={stop}")
        pages = as_page_ids(pages)
        if stop > pages.size * self.page_size:
            raise ValueError(f"stop={stop} is past the page table ({pages.size} pages of {self.page_size})")
        pos = np.arange(start, stop, dtype=np.int64)
        slots = pages[pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size
        return torch.from_numpy(slots).to(self.config.device)
