"""Replay a token trace against SGLang's own radix tree, for side-by-side figures.

SGLang (``sglang==0.5.23``) is imported, never copied: ``setup_sglang.sh``
installs the wheel and the few small packages its radix-tree import chain needs
into ``.peers/sglang``, which this module appends to ``sys.path``.

How the import is kept small (no torch upgrade, no triton, no transformers):

* ``sglang/__init__.py`` is not run. It only builds the frontend language API
  (IPython, aiohttp, tqdm, ...); the ``sglang`` package is registered without
  executing it so that ``sglang.srt.*`` submodules import on their own.
* A few modules that ``radix_cache`` reaches at import time but never uses on
  the path replayed here are stubbed while it imports (``_STUBBED_MODULES``
  says why each one is safe). Every name taken from a stub is a class that
  raises as soon as it is instantiated or called, so an unexpected use fails
  loudly instead of changing behaviour. The stubs are removed from
  ``sys.modules`` once the import is done.

The tree runs on CPU with SGLang's default LRU eviction policy, over a mock
paged KV allocator that keeps a free-page list (see ``_MockPagedAllocator``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import time
import types
from array import array
from pathlib import Path
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
PEER_DIR = Path(__file__).resolve().parents[2] / ".peers" / "sglang"
_SETUP_HINT = "run benchmarks/peers/setup_sglang.sh from the repo root"

# Module -> why stubbing it cannot change what RadixCache does here.
_STUBBED_MODULES: dict[str, str] = {
    "sglang.srt.utils.common": (
        "needs triton, starlette, PIL, requests; radix_cache takes only "
        "ceil_align from it, used by RadixCache.checkpoint, never called here"
    ),
    "sglang.srt.mem_cache.memory_pool": (
        "imports every model config (transformers, torchvision); "
        "base_prefix_cache uses ReqToTokenPool only in annotations"
    ),
    "sglang.srt.mem_cache.allocator": (
        "triton kernels; base_prefix_cache uses BaseTokenToKVPoolAllocator "
        "only in annotations (the mock allocator replaces it)"
    ),
    "sglang.srt.observability.metrics_collector": (
        "pulls in server_args and the model executor; used only when "
        "CacheInitParams.enable_metrics is set, which it is not"
    ),
    "sglang.kernels.ops.kvcache.mla_buffer": (
        "triton MLA KV-buffer kernels, re-exported by mem_cache.utils for "
        "the memory pools; the tree never calls them"
    ),
}


class _StubbedName:
    """A name imported from a stubbed module; any instantiation or call raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{type(self).__module__}.{type(self).__qualname__} was stubbed out by "
            "the radixkv SGLang peer adapter, yet the radix tree used it"
        )


class _StubModule(types.ModuleType):
    """Module whose every public attribute is a fresh ``_StubbedName`` subclass."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        stub = type(name, (_StubbedName,), {"__module__": self.__name__, "__qualname__": name})
        setattr(self, name, stub)
        return stub


@dataclasses.dataclass(frozen=True)
class _SGLang:
    """The SGLang classes the replay uses."""

    RadixCache: Any
    RadixKey: Any
    CacheInitParams: Any
    MatchPrefixParams: Any
    InsertParams: Any
    EvictParams: Any


def register_package() -> None:
    """Make ``sglang`` importable from ``PEER_DIR`` with its ``__init__`` registered but
    not run (it would pull in the whole server); check its version. Raises ImportError.
    Shared with ``sglang_rust_tree``."""
    package_dir = PEER_DIR / "sglang"
    if not (package_dir / "__init__.py").is_file():
        raise ImportError(f"sglang is not installed in {PEER_DIR}")
    if str(PEER_DIR) not in sys.path:
        sys.path.append(str(PEER_DIR))
    if "sglang" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "sglang",
            package_dir / "__init__.py",
            submodule_search_locations=[str(package_dir)],
        )
        if spec is None:
            raise ImportError(f"cannot load the sglang package from {package_dir}")
        sys.modules["sglang"] = importlib.util.module_from_spec(spec)
    from sglang.version import __version__

    if __version__ != SGLANG_VERSION:
        raise ImportError(f"found sglang {__version__}, the adapter is written for {SGLANG_VERSION}")


def unavailable(what: str, exc: BaseException) -> str:
    """The one-line reason a peer could not be loaded, with how to fix it."""
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{what} unavailable ({type(exc).__name__}: {first_line}); {_SETUP_HINT}"


@functools.lru_cache(maxsize=1)
def _load() -> _SGLang:
    """Import SGLang's radix tree from ``PEER_DIR``; raise ImportError if it cannot."""
    register_package()
    stubbed = [name for name in _STUBBED_MODULES if name not in sys.modules]
    for name in stubbed:
        sys.modules[name] = _StubModule(name)
    try:
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    finally:
        for name in stubbed:
            del sys.modules[name]
    return _SGLang(
        RadixCache=RadixCache,
        RadixKey=RadixKey,
        CacheInitParams=CacheInitParams,
        MatchPrefixParams=MatchPrefixParams,
        InsertParams=InsertParams,
        EvictParams=EvictParams,
    )


def load_failure(what: str, load) -> str | None:
    """None if ``load()`` succeeds, else ``unavailable(what, ...)`` for what it raised."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any import-time failure means "not available"
        return unavailable(what, exc)
    return None


def available() -> str | None:
    """None if SGLang's radix tree imports, else a one-line reason and how to fix it."""
    return load_failure("SGLang peer", _load)


class _MockPagedAllocator:
    """Stand-in for SGLang's paged ``token_to_kv_pool_allocator``.

    Holds a free-page list over ``capacity_pages`` pages; the KV slot of token
    ``offset`` in page ``page`` is ``page * page_size + offset``, as in SGLang.
    It offers what RadixCache calls on an allocator (``device``, ``page_size``,
    ``available_size``, ``free_segment``) plus ``alloc_slots`` for the replay.
    """

    def __init__(self, capacity_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.device = torch.device("cpu")
        self.free_pages: list[int] = list(range(capacity_pages))
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def available_size(self) -> int:
        """Free KV slots, in tokens (SGLang's unit)."""
        return len(self.free_pages) * self.page_size

    def alloc_slots(self, num_pages: int, num_tokens: int) -> torch.Tensor:
        """Take ``num_pages`` free pages; return the slots of their first ``num_tokens`` tokens."""
        split = len(self.free_pages) - num_pages
        if split < 0:
            raise RuntimeError(f"asked for {num_pages} pages, {len(self.free_pages)} free")
        pages = torch.tensor(self.free_pages[split:], dtype=torch.int64)
        del self.free_pages[split:]
        return (pages[:, None] * self.page_size + self._offsets).flatten()[:num_tokens]

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free a request-row segment, SGLang's paged contract: its start is
        page-aligned and every page it touches is released once (its first
        slot sits every ``page_size`` entries)."""
        if start_pos % self.page_size:
            raise ValueError(f"segment start {start_pos} is not page-aligned")
        self.free_pages.extend((free_index[:: self.page_size] // self.page_size).tolist())


def _elapsed_us(start_ns: int) -> float:
    """Microseconds since ``start_ns`` (a ``time.perf_counter_ns`` reading)."""
    return (time.perf_counter_ns() - start_ns) / 1000


def replay(prompts: list[list[int]], capacity_pages: int, page_size: int) -> dict:
    """Replay ``prompts`` one at a time through SGLang's RadixCache.

    Per request: time ``match_prefix``; time ``inc_lock_ref`` on its last
    node; if the allocator has fewer free pages than the request needs
    (``ceil(len / page_size) - matched // page_size``), time one ``evict`` for
    the shortfall and reject the request if it is still short; allocate the
    new pages, time ``insert`` of the whole prompt (value = matched slots +
    new slots), then, untimed, free what the tree did not take the way
    SGLang's scheduler does, and ``dec_lock_ref`` (timed into ``lock``).

    Returns ``hit_rate`` (hit/queried tokens, rejected requests included:
    their match still happened), ``queried_tokens``, ``hit_tokens``,
    ``evicted_pages``, ``rejected`` and ``timings_us`` (per-call µs lists for
    ``match``, ``insert``, ``evict``, ``lock``). Raises RuntimeError if
    SGLang is not importable, or if at the end the free pages plus the tree's
    pages are not exactly the ``capacity_pages`` pages (a leak).
    """
    if page_size < 1 or capacity_pages < 0:
        raise ValueError(
            f"need page_size >= 1 and capacity_pages >= 0, got {page_size}, {capacity_pages}"
        )
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    sgl = _load()

    allocator = _MockPagedAllocator(capacity_pages, page_size)
    tree = sgl.RadixCache(
        sgl.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        )
    )
    timings: dict[str, list[float]] = {"match": [], "insert": [], "evict": [], "lock": []}
    queried_tokens = hit_tokens = evicted_pages = rejected = 0

    for prompt in prompts:
        num_tokens = len(prompt)
        queried_tokens += num_tokens

        match_params = sgl.MatchPrefixParams(key=sgl.RadixKey(array("q", prompt)))
        start = time.perf_counter_ns()
        match = tree.match_prefix(match_params)
        timings["match"].append(_elapsed_us(start))
        matched = match.device_prefix_len
        node = match.last_device_node
        hit_tokens += matched

        start = time.perf_counter_ns()
        tree.inc_lock_ref(node)
        timings["lock"].append(_elapsed_us(start))

        need = -(-num_tokens // page_size) - matched // page_size
        free = len(allocator.free_pages)
        if free < need:
            evict_params = sgl.EvictParams(num_tokens=(need - free) * page_size)
            start = time.perf_counter_ns()
            tree.evict(evict_params)
            timings["evict"].append(_elapsed_us(start))
            evicted_pages += len(allocator.free_pages) - free
            if len(allocator.free_pages) < need:
                rejected += 1
                tree.dec_lock_ref(node)
                continue

        # Matched slots (what SGLang's prefix_device_indices reads) + new ones.
        value = torch.cat(
            (
                tree.path_device_indices(node)[:matched],
                allocator.alloc_slots(need, num_tokens - matched),
            )
        )
        insert_params = sgl.InsertParams(key=sgl.RadixKey(array("q", prompt)), value=value)
        start = time.perf_counter_ns()
        result = tree.insert(insert_params)
        timings["insert"].append(_elapsed_us(start))

        # As RadixCache._insert_cache does: free the new slots of the span the
        # tree already held, [matched, prefix_len); then, as release_kv_cache
        # does, free the row past the page-aligned part the tree keeps.
        allocator.free_segment(value[matched : result.prefix_len], start_pos=matched)
        aligned = num_tokens // page_size * page_size
        allocator.free_segment(value[aligned:], start_pos=aligned)
        start = time.perf_counter_ns()
        tree.dec_lock_ref(node)
        timings["lock"][-1] += _elapsed_us(start)

    _check_no_leak(tree, allocator, capacity_pages)
    return replay_result(queried_tokens, hit_tokens, evicted_pages, rejected, timings_us=timings)


def replay_result(queried_tokens: int, hit_tokens: int, evicted_pages: int, rejected: int, **measured) -> dict:
    """What a replay returns (here, in ``sglang_rust_tree`` and in ``bench_radix``): the
    counts, the hit rate they give, and the replay's own timings (``measured``)."""
    return {
        "hit_rate": hit_tokens / queried_tokens if queried_tokens else 0.0,
        "queried_tokens": queried_tokens,
        "hit_tokens": hit_tokens,
        "evicted_pages": evicted_pages,
        "rejected": rejected,
        **measured,
    }


def _check_no_leak(tree: Any, allocator: _MockPagedAllocator, capacity_pages: int) -> None:
    """Raise RuntimeError unless free pages + tree pages are each page once, and no lock is left."""
    if tree.protected_size() != 0:
        raise RuntimeError(f"adapter leaked locks: {tree.protected_size()} tokens still protected")
    page_size = allocator.page_size
    held_tokens = tree.total_size()
    held_pages: list[int] = []
    if held_tokens:
        held_pages = torch.unique(tree.all_values_flatten() // page_size).tolist()
    if len(held_pages) * page_size != held_tokens or sorted(
        allocator.free_pages + held_pages
    ) != list(range(capacity_pages)):
        raise RuntimeError(
            f"adapter leaks KV pages: {len(allocator.free_pages)} free + {len(held_pages)} in tree "
            f"({held_tokens} tokens) != {capacity_pages} pages, each exactly once"
        )


if __name__ == "__main__":
    _reason = available()
    print(_reason or f"SGLang {SGLANG_VERSION} radix tree importable from {PEER_DIR}")
    sys.exit(1 if _reason else 0)
