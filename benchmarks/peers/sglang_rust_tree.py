"""Replay a token trace through SGLang's Rust radix tree core, the whole per-request
KV lifecycle, for side-by-side figures with radixkv's ``KVCacheManager``.

SGLang (``sglang==0.5.23``, installed by ``setup_sglang.sh`` into ``.peers/sglang``) is
imported, never copied. Its Rust TreeCore is the PyO3 extension
``sglang.srt.mem_cache.rust_tree_core.mem_cache`` bundled in the wheel; SGLang's
``UnifiedRadixCache`` drives it through ``rust_tree_core/adapter.py`` (the
``RustUnifiedTreeCore`` class), whose import chain needs orjson, the HiCache
modules and more. This module calls the extension's binding directly, the way the
adapter does, with the adapter's Python wrapping left out (no MatchResult / action
dataclasses built per call): what is timed is the Rust core plus the least Python a
caller can put around it.

How the extension is loaded, as SGLang's own loader does for a wheel install
(``load_rust_extension`` in mode ``auto`` without a source checkout: a plain import
of the bundled module), with ``sglang/__init__.py`` not run (see ``sglang_tree``)
and torch imported first so that libtorch is resident before the ``dlopen``. The
extension links against libtorch, so torch must be in SGLang's supported range
(checked by ``available()``).

The tree is a FULL-attention-only TreeCore on CPU with SGLang's default LRU policy,
over a free-page list that mirrors SGLang's ``PagedTokenToKVPoolAllocator`` (see
``_PagedFreeList``).
"""

from __future__ import annotations

import functools
import gc
import importlib
import re
import sys
import time
from array import array
from types import ModuleType

import torch

from benchmarks.peers.sglang_tree import PEER_DIR, SGLANG_VERSION, load_failure, register_package, replay_result
_EXTENSION = "sglang.srt.mem_cache.rust_tree_core.mem_cache"
_FULL = 0  # sglang.srt.mem_cache.unified_cache.component_type.ComponentType.FULL


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType:
    """Import the Rust TreeCore extension from ``PEER_DIR``; raise ImportError if it cannot."""
    register_package()
    from sglang.srt.rust_extensions.torch_build import _MAX_SUPPORTED_TORCH, _MIN_SUPPORTED_TORCH

    found = re.match(r"^(\d+)\.(\d+)", torch.__version__)
    if found is None or not (
        _MIN_SUPPORTED_TORCH <= (int(found.group(1)), int(found.group(2))) <= _MAX_SUPPORTED_TORCH
    ):
        raise ImportError(f"torch {torch.__version__} is outside the Rust TreeCore's supported range")
    return importlib.import_module(_EXTENSION)


def available() -> str | None:
    """None if SGLang's Rust tree core imports, else a one-line reason and how to fix it."""
    return load_failure("SGLang Rust tree core", _load)


class _PagedFreeList:
    """SGLang's ``PagedTokenToKVPoolAllocator`` free list (with ``page_size`` 1, the
    token allocator's) on CPU, without its Triton kernels, in its ``need_sort`` mode:
    freed pages are staged and merged (sorted) into ``free_pages`` only when an
    allocation runs short. (Outside prefill/decode disaggregation SGLang instead
    concatenates each free onto the GPU-resident list, an asynchronous kernel of
    constant CPU cost; on a CPU tensor that copy grows with the pool, which would
    charge the peer for an artefact of running its allocator on the CPU.)

    Pages ``1..capacity_pages`` (SGLang keeps page 0 as the padding slot); the KV slot
    of token ``offset`` in page ``p`` is ``p * page_size + offset``. Allocation takes
    the head of ``free_pages``.
    """

    def __init__(self, capacity_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = torch.arange(1, capacity_pages + 1, dtype=torch.int64)
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def num_free(self) -> int:
        """Free pages, staged ones included (SGLang's ``available_size`` in pages)."""
        return len(self.free_pages) + self.num_staged_pages

    def all_free_pages(self) -> torch.Tensor:
        """Every free page id, staged ones included."""
        return torch.cat((self.free_pages, *self.staged_pages))

    def merge_and_sort_free(self) -> None:
        """Fold the staged pages into ``free_pages``, sorted."""
        if self.staged_pages:
            self.free_pages, _ = torch.sort(self.all_free_pages())
            self.staged_pages = []
            self.num_staged_pages = 0

    def alloc_extend(self, prefix_len: int, seq_len: int) -> torch.Tensor:
        """Slots for tokens ``[prefix_len, seq_len)`` of a row whose first
        ``prefix_len`` (page-aligned) tokens are already placed: whole new pages, the
        last one possibly partly used. The caller checked ``num_free``."""
        num_pages = -(-seq_len // self.page_size) - prefix_len // self.page_size
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)[: seq_len - prefix_len]

    def free_segment(self, free_index: torch.Tensor) -> None:
        """Free a segment that starts on a page boundary: each page it touches once
        (its first slot every ``page_size`` entries), as SGLang's ``free_segment``."""
        if free_index.numel():
            page_ids = free_index if self.page_size == 1 else free_index[:: self.page_size] // self.page_size
            self.staged_pages.append(page_ids)
            self.num_staged_pages += len(page_ids)


def _apply_actions(actions: list, allocator: _PagedFreeList) -> None:
    """Apply the tree's tagged cache actions the way ``UnifiedRadixCache`` does for a
    FULL-only cache: free the KV the tree gave up. Raises on anything else."""
    for action in actions:
        if action[0] in ("free_device_kv", "free_device_kv_full_only"):
            for indices in action[1]:
                allocator.free_segment(indices)
        else:
            raise RuntimeError(f"unexpected cache action from the Rust tree core: {action[0]}")


def _evict(tree, allocator: _PagedFreeList, num_tokens: int) -> None:
    """``UnifiedRadixCache._evict_components`` for the FULL component: a step-wise
    device-eviction walk for ``num_tokens`` tokens, freeing each evicted leaf's KV."""
    tracker = {_FULL: 0}
    tree.evict_device_start(_FULL, num_tokens)
    try:
        while True:
            step = tree.evict_device_next_node(_FULL, tracker)
            for indices in step.new_device_frees.get(_FULL, ()):
                allocator.free_segment(indices)
            _apply_actions(step.cache_actions, allocator)
            for component, delta in step.tracker.items():
                tracker[component] += delta
            if step.node_id is None:
                if not step.made_progress:
                    break
                continue
            leaf = tree.evict_device_leaf(step.node_id)
            for indices in leaf.new_device_frees.get(_FULL, ()):
                allocator.free_segment(indices)
            _apply_actions(leaf.cache_actions, allocator)
            for component, delta in leaf.tracker.items():
                tracker[component] += delta
    finally:
        tree.evict_device_end(_FULL)


def _insert(tree, allocator: _PagedFreeList, params) -> int:
    """``UnifiedRadixCache.insert``: pump the resumable insert, applying each step's
    actions (the duplicate KV it frees) at its barrier. Returns the insert's
    ``prefix_len``."""
    try:
        step = tree.begin_insert(params)
        while True:
            _apply_actions(step.actions, allocator)
            if step.result is not None:
                return step.result.prefix_len
            step = tree.resume_insert()
    finally:
        _apply_actions(tree.end_insert(), allocator)


def replay(prompts: list[list[int]], capacity_pages: int, page_size: int) -> dict:
    """Replay ``prompts`` one at a time through SGLang's Rust tree core, each request's
    whole KV lifecycle as SGLang's scheduler drives ``UnifiedRadixCache`` (prefill
    only, no output tokens), timed as one span (``perf_counter_ns``, gc off, torch
    on one thread: its intra-op threads only add contention on tensors this small,
    and radixkv's numpy side runs on one):

    1. ``match_prefix`` of ``prompt[:-1]`` (SGLang's ``_compute_max_prefix_len``:
       the last prompt token is always computed, for its logits);
    2. ``inc_lock_ref`` on the matched node;
    3. if the free list is short of the request's new pages
       (``ceil(len / page_size) - matched / page_size``), an eviction walk for the
       shortfall; still short: the request is rejected (unlocked, counted, its time
       kept);
    4. the row: the matched slots (``collect_full_device_indices`` of the path) +
       ``alloc_extend`` of the rest;
    5. release with checkpoint (``checkpoint_into_tree`` + ``release_kv_cache``):
       insert the prompt's whole pages with their slots and
       ``prev_prefix_len = matched``, freeing the slots the tree reports as
       duplicates; free the partial last page; ``dec_lock_ref``.

    SGLang's checkpoint also moves the request's lock to the inserted node and
    rewrites its row from the tree before the unlock; this replay skips that
    (the request ends right after), so it does less per request than SGLang does.

    Returns ``hit_rate`` (hit / prompt tokens), ``queried_tokens`` (prompt tokens),
    ``hit_tokens``, ``evicted_pages``, ``rejected`` and ``request_ns`` (one wall time
    per request). Raises RuntimeError if the core is not importable, or if at the end
    a lock is left or the free pages plus the tree's are not each page exactly once.
    """
    if page_size < 1 or capacity_pages < 0:
        raise ValueError(f"need page_size >= 1 and capacity_pages >= 0, got {page_size}, {capacity_pages}")
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    ext = _load()
    tree = ext.RustUnifiedTreeCoreBinding(
        ext.TreeCoreInitParamsBinding(eviction_policy="lru", page_size=page_size, device="cpu"), [_FULL]
    )
    allocator = _PagedFreeList(capacity_pages, page_size)
    root = tree.root_node_handle(None)
    match_params, insert_params, unlock_params = (
        ext.MatchParamsBinding, ext.InsertParamsBinding, ext.DecLockRefParamsBinding,
    )  # fmt: skip
    empty = torch.empty(0, dtype=torch.int64)
    # Token ids as SGLang holds a request's (an int64 array); converted untimed.
    keys = [array("q", p) for p in prompts]
    request_ns: list[int] = []
    queried_tokens = hit_tokens = evicted_pages = rejected = 0
    clock = time.perf_counter_ns
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.disable()
    try:
        for key in keys:
            num_tokens = len(key)
            queried_tokens += num_tokens
            free_before = allocator.num_free()
            t0 = clock()
            match = tree.match_prefix(match_params(key=key[:-1]))
            _apply_actions(match.cache_actions, allocator)
            matched, node = match.device_prefix_len, match.last_device_node_id
            lock = tree.inc_lock_ref(node, [])
            receipt = unlock_params(
                node_id=lock.node_id,
                skipped_lock_components=list(lock.skipped_lock_components),
                component_lock_uuids=dict(lock.component_lock_uuids),
                component_host_lock_uuids=dict(lock.component_host_lock_uuids),
            )
            need = -(-num_tokens // page_size) - matched // page_size
            short = need - allocator.num_free()
            if short > 0:
                _evict(tree, allocator, short * page_size)
                if allocator.num_free() < need:
                    tree.dec_lock_ref(node, receipt, False)
                    request_ns.append(clock() - t0)
                    evicted_pages += allocator.num_free() - free_before
                    hit_tokens += matched
                    rejected += 1
                    continue
                evicted = allocator.num_free() - free_before
            else:
                evicted = 0
            prefix = tree.collect_full_device_indices(node, root)[:matched] if matched else empty
            row = torch.cat((prefix, allocator.alloc_extend(matched, num_tokens)))
            aligned = num_tokens // page_size * page_size
            if aligned:
                value = row[:aligned].clone()
                _insert(tree, allocator, insert_params(key=key[:aligned], value=value, prev_prefix_len=matched))
            allocator.free_segment(row[aligned:])
            tree.dec_lock_ref(node, receipt, False)
            request_ns.append(clock() - t0)
            evicted_pages += evicted
            hit_tokens += matched
    finally:
        gc.enable()
        torch.set_num_threads(threads)

    _check_no_leak(tree, allocator, capacity_pages)
    return replay_result(queried_tokens, hit_tokens, evicted_pages, rejected, request_ns=request_ns)


def _check_no_leak(tree, allocator: _PagedFreeList, capacity_pages: int) -> None:
    """Raise RuntimeError unless no lock is left and free pages + tree pages are the
    ``capacity_pages`` pages, each exactly once."""
    if tree.protected_size() != 0:
        raise RuntimeError(f"replay leaked locks: {tree.protected_size()} tokens still protected")
    page_size = allocator.page_size
    held_tokens = tree.total_size()[0]
    held_pages: list[int] = []
    if held_tokens:
        held_pages = torch.unique(tree.all_values_flatten() // page_size).tolist()
    if len(held_pages) * page_size != held_tokens or sorted(allocator.all_free_pages().tolist() + held_pages) != list(
        range(1, capacity_pages + 1)
    ):
        raise RuntimeError(
            f"replay leaks KV pages: {allocator.num_free()} free + {len(held_pages)} in tree "
            f"({held_tokens} tokens) != {capacity_pages} pages, each exactly once"
        )


if __name__ == "__main__":  # python -m benchmarks.peers.sglang_rust_tree
    _reason = available()
    print(_reason or f"SGLang {SGLANG_VERSION} Rust tree core importable from {PEER_DIR}")
    sys.exit(1 if _reason else 0)
