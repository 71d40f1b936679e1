"""Hit-rate simulator: replay a trace against the prefix cache at a given capacity.

A request goes through the same ``KVCacheManager`` calls the engine's scheduler makes
for it, minus the model, so the simulator's cached tokens per request are the engine's
(``tests/test_sim.py`` replays one trace through both):

    admit (match prompt[:-1], lock; a page the match ends inside: its leading tokens) ->
    prefill chunks of at most ``chunk_size`` tokens:
    reserve (evict; else finish the oldest request in flight) -> computed -> commit ->
    one decode step per output token but the last (its KV is never computed) ->
    (in flight) -> release (publish, unlock, free)

With arrival times (every request of the trace has an ``arrival``), requests are
replayed in arrival order (ties in trace order) and a request's time in flight is
modelled: it is admitted at its arrival, or when a slot frees if ``in_flight`` are
running (or when memory frees, if the pool is full), and finishes after its uncached
prompt tokens at ``prefill_tok_s`` plus its output tokens at ``decode_tok_s`` (one
sequence's rates, measured on the embedded model: ``DEFAULT_PREFILL_TOK_S``,
``DEFAULT_DECODE_TOK_S``). A request that finished before a later one arrives has
published its outputs to it; ones still running hold their pages locked and share
only their published prompt chunks. Without arrivals, a request stays in flight until
``in_flight`` newer ones have been admitted (``in_flight=1``: one at a time).

Two references bound what a policy can reach: the hit rate with unlimited capacity,
and Belady's offline policy, which evicts the cached page whose next use lies
farthest in the future (it reads the whole trace ahead).
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from array import array
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from radixkv.cache.formats import kv_format
from radixkv.cache.manager import KVCacheManager, SeqKV
from radixkv.cache.policy import EvictionPolicy, make_policy
from radixkv.cache.pool import PageAllocator
from radixkv.cache.radix import Node, RadixCache
from radixkv.cache.store import MemoryStore, PageStore
from radixkv.cache.tiers import HostTier, KVTiers
from radixkv.cache.traces import VOCAB, TraceRequest
from radixkv.validate import ceil_div

NEVER = math.inf


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity_pages: int
    page_size: int
    in_flight: int
    requests: int
    rejected: int  # requests that did not fit even in an empty pool
    queried_tokens: int
    hit_tokens: int
    evicted_pages: int
    cached_pages: int  # in the tree at the end
    cached_per_request: tuple[int, ...] = ()  # prompt tokens each request took from the cache
    host_hit_tokens: int = 0  # of hit_tokens, those promoted from the host tier (the rest: the device's tree)
    store_hit_tokens: int = 0  # of hit_tokens, those promoted from the store tier

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        """The figures as JSON-ready values (without the per-request list)."""
        d = asdict(self)
        del d["cached_per_request"]
        return {**d, "hit_rate": self.hit_rate}


def _outputs(trace: list[TraceRequest]) -> list[array]:
    """Output ids per request: given lists as they are; counts become ids outside the
    synthetic vocabulary that no prompt can repeat."""
    next_id = max(VOCAB, 1 + max(int(np.frombuffer(r.tokens, dtype=np.int32).max()) for r in trace))
    outs = []
    for r in trace:
        if isinstance(r.output_tokens, int):
            outs.append(array("i", range(next_id, next_id + r.output_tokens)))
            next_id += r.output_tokens
        else:
            outs.append(r.output_tokens)
    return outs


def total_pages(trace: list[TraceRequest], page_size: int) -> int:
    """Pages every request would hold alone: enough capacity never to evict."""
    return sum(ceil_div(len(r.tokens) + r.num_output, page_size) for r in trace)


DEFAULT_CHUNK_SIZE = 512  # EngineConfig.chunked_prefill_size's default (a test keeps them equal)

# One sequence's rates of the embedded model (SmolLM2-135M, fp32 weights and KV, default
# attention backend), measured with radixkv.engine.engine.Engine on 2026-11-23 on a 2-core
# x86_64 AMD EPYC VM shared with other work: a 2048-token prompt prefilled in 7.46 s
# (median of 3: 7.09, 7.46, 7.80 s), and 64 tokens decoded after a 256-token prompt at
# 13.1-13.9 tok/s. Re-measured under contention (load average 3.5-4.6 on the 2 cores) the
# same day: 107 tok/s prefill, 7-8 tok/s decode. `radixkv sim --prefill-tok-s /
# --decode-tok-s` override them.
DEFAULT_PREFILL_TOK_S = 275.0
DEFAULT_DECODE_TOK_S = 13.5


def timed(trace: list[TraceRequest]) -> bool:
    """Whether the trace carries arrival times (``load_jsonl`` ensures all or none)."""
    return bool(trace) and all(r.arrival is not None for r in trace)


def replay(
    trace: list[TraceRequest],
    capacity_pages: int | None,
    page_size: int = 1,
    policy: str | EvictionPolicy = "lru",
    in_flight: int = 1,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    host_pages: int | None = None,
    store_pages: int | None = None,
    arrivals: bool = True,
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S,
    decode_tok_s: float = DEFAULT_DECODE_TOK_S,
    partial_pages: bool = True,
) -> SimResult:
    """Replay ``trace`` with ``capacity_pages`` pages (None: unlimited), and with
    ``host_pages`` a host tier of that many pages below them, with ``store_pages`` a
    store of that many pages below those (radixkv.cache.tiers: eviction demotes,
    writing back; admission promotes; ``hit_tokens`` counts every tier).

    ``policy`` is a registered name or an offline reference: ``"belady"``, or
    ``"return-oracle"`` (``ReturnOracle``). With ``in_flight`` > 1 a request
    stays locked until ``in_flight`` newer ones have arrived, so it neither shares its
    own pages with them nor lets them be evicted. ``chunk_size`` is the engine's
    prefill chunk (None: whole prompts): every chunk's whole pages are published as the
    engine publishes them. A request that does not fit even with nothing else in
    flight is rejected (what it computed stays cached, as in the engine).

    With ``arrivals`` and a trace that has arrival times, requests run in arrival order
    and leave the flight when their modelled time is up (module docstring; the rates
    ``prefill_tok_s`` and ``decode_tok_s``). ``cached_per_request`` follows the trace's
    own order either way. ``partial_pages``: a match may end inside a page, as the
    engine's (``EngineConfig.partial_pages``; off for int4's sealed pages).
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if not (prefill_tok_s > 0 and decode_tok_s > 0):
        raise ValueError(f"prefill_tok_s and decode_tok_s must be > 0, got {prefill_tok_s}, {decode_tok_s}")
    order = None
    if arrivals and timed(trace):
        order = sorted(range(len(trace)), key=lambda j: (trace[j].arrival, j))
        trace = [trace[j] for j in order]
    if capacity_pages is None:
        capacity_pages = total_pages(trace, page_size) + 1
    if policy in OFFLINE:
        policy = OFFLINE[policy](trace, page_size)
    policy = make_policy(policy)
    allocator = PageAllocator(capacity_pages)
    tree = RadixCache(allocator, page_size, policy)
    tiers = None
    if host_pages or store_pages:
        host = HostTier(host_pages, page_cost=1) if host_pages else None
        store = PageStore(MemoryStore(store_pages), {"sim": page_size}) if store_pages else None
        tiers = KVTiers(allocator, "sim", "sim", host, store, page_size=page_size)
    kv = KVCacheManager(allocator, tree, page_size, tiers, partial_pages=partial_pages)
    outputs = _outputs(trace)
    running: deque = deque()  # untimed: (seq, tokens) in flight, oldest first
    flight: list = []  # timed: a heap of (finish time, index, seq, tokens)
    clock = 0.0
    rejected = 0
    cached = []

    def finish_oldest() -> bool:
        """Untimed: the oldest request in flight finishes; timed: the one that finishes
        first (the clock moves on to its finish if it lies ahead)."""
        nonlocal clock
        if order is None:
            if not running:
                return False
            kv.release(*running.popleft())
            return True
        if not flight:
            return False
        end, _, seq, tokens = heapq.heappop(flight)
        clock = max(clock, end)
        kv.release(seq, tokens)
        return True

    def compute(seq: SeqKV, tokens, upto: int, step: int) -> bool:
        """Compute ``tokens[:upto]`` in steps of ``step`` tokens, as the engine would."""
        while seq.computed < upto:
            count = min(upto - seq.computed, step)
            if not kv.reserve(seq, count, finish_oldest):
                return False
            kv.computed(seq, seq.computed + count)
            if count > 1:  # a prefill chunk, not a decode step
                kv.commit(seq, tokens)
        return True

    for i, req in enumerate(trace):
        if isinstance(policy, Belady):
            policy.now = i
        if order is not None:  # finished by its arrival; else wait for a slot
            clock = max(clock, req.arrival)
            while flight and (flight[0][0] <= clock or len(flight) >= in_flight):
                finish_oldest()
        tokens = req.tokens + outputs[i]
        prompt = len(req.tokens)
        seq = SeqKV(req.namespace, req.priority)
        cached.append(kv.admit(seq, req.tokens))
        # The last output token is sampled but never computed.
        if not (compute(seq, tokens, prompt, chunk_size or prompt) and compute(seq, tokens, len(tokens) - 1, 1)):
            kv.release(seq, tokens)
            rejected += 1
            continue
        if order is not None:
            end = clock + (prompt - cached[-1]) / prefill_tok_s + req.num_output / decode_tok_s
            heapq.heappush(flight, (end, i, seq, tokens))
            continue
        running.append((seq, tokens))
        if len(running) >= in_flight:
            finish_oldest()
    while running or flight:
        finish_oldest()
    kv.check([])
    if order is not None:  # back to the trace's order
        unsorted = [0] * len(cached)
        for pos, j in enumerate(order):
            unsorted[j] = cached[pos]
        cached = unsorted
    host_hits = tiers.stats.host_hit_tokens if tiers is not None else 0
    store_hits = tiers.stats.store_hit_tokens if tiers is not None else 0
    return SimResult(
        policy.name, capacity_pages, page_size, in_flight, len(trace), rejected,
        tree.queried_tokens, tree.hit_tokens + host_hits + store_hits, tree.evicted_pages, tree.cached_pages,
        tuple(cached), host_hits, store_hits,
    )  # fmt: skip


class _NextUse:
    """Offline index: the first request after ``now`` whose prompt starts with a given
    token prefix.

    Prompts are sorted as bytes, so the prompts sharing a prefix form one contiguous
    range; a merge-sort tree over that order answers "smallest request index above
    ``now`` in this range" with O(log n) binary searches.
    """

    def __init__(self, keys: list[bytes], indices: list[int]):
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.keys = [keys[j] for j in order]
        values = np.array([indices[j] for j in order], dtype=np.int64)
        size = 1
        while size < len(values):
            size *= 2
        self.size = size
        self.tree: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * (2 * size)
        for j, v in enumerate(values):
            self.tree[size + j] = np.array([v])
        for node in range(size - 1, 0, -1):
            self.tree[node] = np.sort(np.concatenate([self.tree[2 * node], self.tree[2 * node + 1]]))

    def first_after(self, prefix: bytes, now: int) -> float:
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_left(self.keys, _successor(prefix)) if prefix.strip(b"\xff") else len(self.keys)
        best = NEVER
        lo += self.size
        hi += self.size
        while lo < hi:
            if lo & 1:
                best = min(best, self._first_above(self.tree[lo], now))
                lo += 1
            if hi & 1:
                hi -= 1
                best = min(best, self._first_above(self.tree[hi], now))
            lo //= 2
            hi //= 2
        return best

    @staticmethod
    def _first_above(values: np.ndarray, now: int) -> float:
        k = np.searchsorted(values, now, side="right")
        return float(values[k]) if k < len(values) else NEVER


def _successor(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1])


class Belady(EvictionPolicy):
    """Offline reference: drop the cached page whose next use is farthest away.

    A page is used by a later request whose prompt contains the page's whole token
    path. Deeper pages are never used sooner than their ancestors, so the victim is
    always the tail of some leaf; the leaf keeps its pages that are needed no later
    than the runner-up leaf's tail. Ties (leaves no later request uses) go to the
    longer path, then to the leaf created last, so a replay is reproducible.

    Each leaf's next use is remembered with what fixes its path end, so a victim costs
    one pass over the leaves with no path built and no index query for a leaf whose
    path and next use still hold. A leaf's path only ever loses tail pages (splits and
    merges move its edge's start, not its end), and its parent's end cannot move while
    it has a child, so ``end(leaf) = end(parent) + len(leaf.key)`` is unchanged as long
    as the leaf has the same parent object and key length (a merge or split changes
    the parent; a tail eviction the length). The next use itself, the first request
    after ``now`` that contains the path, stays right until ``now`` reaches it.
    """

    name = "belady"
    lazy = False

    def __init__(self, trace: list[TraceRequest], page_size: int):
        self.page_size = page_size
        self.now = 0
        by_ns: dict = {}
        for i, r in enumerate(trace):
            keys, idx = by_ns.setdefault(r.namespace, ([], []))
            keys.append(r.tokens.tobytes())
            idx.append(i)
        self.index = {ns: _NextUse(k, i) for ns, (k, i) in by_ns.items()}
        # leaf -> (parent, len(key), path length in bytes, next use); holds nodes alive
        # until pruned (when it outgrows the leaves it is asked about)
        self._memo: dict[Node, tuple] = {}

    def _next_use(self, namespace, prefix: bytes) -> float:
        """Next use (request index after ``now``) of the page that ends ``prefix``."""
        return self.index[namespace].first_after(prefix, self.now)

    def _remember(self, leaf: Node) -> tuple[float, int]:
        """Look up ``leaf``'s next use; remember it with its path length (bytes) and
        return both."""
        path = leaf.path_key()
        value = self._next_use(leaf.namespace, path)
        self._memo[leaf] = (leaf.parent, len(leaf.key), len(path), value)
        return value, len(path)

    def choose(self, leaves: list[Node], need: int) -> tuple[Node, int]:
        memo, now, remember = self._memo, self.now, self._remember
        ranked = []
        for leaf in leaves:
            hit = memo.get(leaf)
            if hit is not None and hit[0] is leaf.parent and hit[1] == len(leaf.key) and hit[3] > now:
                ranked.append((hit[3], hit[2], leaf.created, id(leaf), leaf))
            else:
                ranked.append((*remember(leaf), leaf.created, id(leaf), leaf))
        top = heapq.nlargest(2, ranked)
        victim = top[0][4]
        runner_up = top[1][0] if len(top) > 1 else -NEVER
        if len(memo) > 2 * len(leaves) + 1024:  # forget nodes that are gone or no longer leaves
            self._memo = {leaf: memo[leaf] for leaf in leaves}
        # Largest k such that the k tail pages are all needed no sooner than runner_up.
        lo, hi = 1, min(need, len(victim.pages))
        if lo < hi:
            path = victim.path_key()
            width = 4 * self.page_size
            while lo < hi:
                k = (lo + hi + 1) // 2
                if self._next_use(victim.namespace, path[: len(path) - (k - 1) * width]) >= runner_up:
                    lo = k
                else:
                    hi = k - 1
        return victim, lo


class ReturnOracle(Belady):
    """Offline analysis: LRU told only *whether* a leaf is ever used again, not when.
    Leaves no later request uses go first (least recently used first), then the rest
    in LRU order. Where it lands between LRU and Belady says how much of the gap is the
    question "does this prefix come back at all", which is all an admission or
    classification policy can learn to answer. A lazy key: the answer changes only when
    a later request uses the leaf, which touches it."""

    name = "return-oracle"
    lazy = True

    def key(self, node: Node) -> tuple[int, int]:
        returns = self._next_use(node.namespace, node.path_key()) != NEVER
        return (int(returns), node.last_access)


OFFLINE = {"belady": Belady, "return-oracle": ReturnOracle}


def sweep(
    trace: list[TraceRequest],
    page_size: int = 1,
    policies: tuple[str, ...] = ("lru",),
    fractions: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8),
    capacity_pages: tuple[int, ...] | None = None,
    in_flight: int = 1,
    belady: bool = True,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    host_pages: int | None = None,
    store_pages: int | None = None,
    **timing,
) -> dict:
    """Replay every policy (and Belady) at every capacity, plus the unlimited bound;
    with ``host_pages`` / ``store_pages``, those tiers below every capacity.
    ``timing``: ``replay``'s ``arrivals``, ``prefill_tok_s``, ``decode_tok_s``.

    Capacities are ``capacity_pages`` when given, else ``fractions`` of the trace's
    unique pages (what unlimited capacity ends up caching). Returns a JSON-ready dict:
    ``unique_pages``, ``unlimited`` (its result) and ``runs`` (one result per policy
    and capacity, with the ``capacity_fraction`` of the unique pages); every result
    with ``prompt_tokens``, ``cached_tokens`` and its breakdowns (``breakdowns``), and
    ``live`` when the trace has the live run's cached tokens.
    """
    unlimited = replay(trace, None, page_size, "lru", in_flight, chunk_size, **timing)
    unique = unlimited.cached_pages
    if capacity_pages is None:
        capacity_pages = tuple(sorted({max(1, round(f * unique)) for f in fractions}))
    runs = []
    for name in (*policies, *(("belady",) if belady else ())):
        for cap in capacity_pages:
            result = replay(trace, cap, page_size, name, in_flight, chunk_size, host_pages, store_pages, **timing)
            runs.append({**run_dict(trace, result), "capacity_fraction": cap / unique if unique else 0.0})
    if belady:
        add_gap(runs)
    return {"unique_pages": unique, "unlimited": run_dict(trace, unlimited), "runs": runs, **_live(trace)}


def gap_closed(hit: float, lru: float | None, belady: float) -> float | None:
    """The share of the LRU-to-Belady gap that hit rate ``hit`` closes:
    ``(hit - lru) / (belady - lru)`` (0: LRU's, 1: Belady's; below 0 worse than LRU).
    None when there is no gap (or no ``lru``)."""
    if lru is None or belady == lru:
        return None
    return (hit - lru) / (belady - lru)


def add_gap(runs: list[dict]) -> None:
    """Add to every run, at each capacity where Belady ran, ``of_belady`` (hit rate /
    Belady's; None when Belady hit nothing) and ``gap_closed`` (``gap_closed`` against
    the ``lru`` run at that capacity; None without one). Mutates ``runs``."""
    best = {r["capacity_pages"]: r["hit_rate"] for r in runs if r["policy"] == "belady"}
    lru = {r["capacity_pages"]: r["hit_rate"] for r in runs if r["policy"] == "lru"}
    for r in runs:
        cap = r["capacity_pages"]
        if cap in best:
            r["of_belady"] = r["hit_rate"] / best[cap] if best[cap] else None
            r["gap_closed"] = gap_closed(r["hit_rate"], lru.get(cap), best[cap])


def byte_sweep(
    trace: list[TraceRequest],
    page_size: int,
    pool_bytes: tuple[int, ...],
    bytes_per_page: dict[str, int],
    policies: tuple[str, ...] = ("lru",),
    in_flight: int = 1,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    host_pages: int | None = None,
    store_pages: int | None = None,
    **timing,
) -> dict:
    """Replay every policy at every pool size in bytes for every KV format
    (``bytes_per_page``: format name -> bytes of one page of it, all layers, K and V,
    quantization parameters included; ``KVFormat.bytes_per_page``): a format with fewer
    bytes per page fits more pages in the same memory. Returns ``unique_pages``,
    ``unlimited`` and ``runs`` (as ``sweep``; each run adds ``kv_dtype``, ``pool_bytes``
    and ``bytes_per_page``). A pool too small for one page is a ValueError naming it.
    """
    unlimited = replay(trace, None, page_size, "lru", in_flight, chunk_size, **timing)
    unique = unlimited.cached_pages
    runs = []
    for fmt, per_page in bytes_per_page.items():
        for size in pool_bytes:
            pages = size // per_page
            if pages < 1:
                raise ValueError(f"pool_bytes {size} holds no page of {fmt} ({per_page} bytes per page)")
            for name in policies:
                result = replay(trace, pages, page_size, name, in_flight, chunk_size, host_pages, store_pages,
                                **timing)  # fmt: skip
                runs.append({**run_dict(trace, result), "capacity_fraction": pages / unique if unique else 0.0,
                             "kv_dtype": fmt, "pool_bytes": size, "bytes_per_page": per_page})  # fmt: skip
    return {"unique_pages": unique, "unlimited": run_dict(trace, unlimited), "runs": runs, **_live(trace)}


# -- breakdowns, live comparison, warnings ------------------------------------------------

NO_NAME = "(none)"  # the group of requests without a namespace / session


def breakdown(trace: list[TraceRequest], cached: tuple[int, ...], key: str) -> dict[str, dict]:
    """Per value of ``key`` (``"namespace"`` or ``"session"``; None is ``NO_NAME``), in
    order of first appearance: ``requests``, ``prompt_tokens``, ``cached_tokens`` (the
    replay's), ``hit_rate`` (cached / prompt tokens) and, where the trace has them,
    ``live_cached_tokens`` and ``live_hit_rate`` over the requests that report them."""
    groups: dict[str, dict] = {}
    for req, hit in zip(trace, cached):
        name = getattr(req, key)
        g = groups.setdefault(NO_NAME if name is None else name,
                              {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "live": [0, 0, 0]})  # fmt: skip
        g["requests"] += 1
        g["prompt_tokens"] += len(req.tokens)
        g["cached_tokens"] += hit
        if req.cached_tokens is not None:
            g["live"][0] += 1
            g["live"][1] += len(req.tokens)
            g["live"][2] += req.cached_tokens
    for g in groups.values():
        g["hit_rate"] = g["cached_tokens"] / g["prompt_tokens"]
        reported, prompts, live = g.pop("live")
        if reported:
            g["live_cached_tokens"] = live
            g["live_hit_rate"] = live / prompts
    return groups


def breakdowns(trace: list[TraceRequest], cached: tuple[int, ...]) -> dict:
    """``by_namespace`` when the trace has a namespace, ``by_session`` when it has a
    session (``breakdown``)."""
    out = {}
    for key in ("namespace", "session"):
        if any(getattr(r, key) is not None for r in trace):
            out[f"by_{key}"] = breakdown(trace, cached, key)
    return out


def run_dict(trace: list[TraceRequest], result: SimResult) -> dict:
    """``result.as_dict()`` with the trace's ``prompt_tokens``, the replay's
    ``cached_tokens`` (per request, summed) and the breakdowns."""
    prompt = sum(len(r.tokens) for r in trace)
    cached = sum(result.cached_per_request)
    return {**result.as_dict(), "prompt_tokens": prompt, "cached_tokens": cached,
            **breakdowns(trace, result.cached_per_request)}  # fmt: skip


def _live(trace: list[TraceRequest]) -> dict:
    """``{"live": {requests, prompt_tokens, cached_tokens, hit_rate}}`` over the
    requests that carry the live run's ``cached_tokens``; {} when none does."""
    known = [r for r in trace if r.cached_tokens is not None]
    if not known:
        return {}
    prompt = sum(len(r.tokens) for r in known)
    cached = sum(r.cached_tokens for r in known)
    return {"live": {"requests": len(known), "prompt_tokens": prompt, "cached_tokens": cached,
                     "hit_rate": cached / prompt}}  # fmt: skip


def warnings_for(trace: list[TraceRequest], page_size: int, runs: list[dict] = ()) -> list[str]:
    """Cases where the numbers mean less than they seem: one request, prompts too
    short for a page, and runs in which requests did not fit the pool."""
    out = []
    if len(trace) == 1:
        out.append("the trace has one request: there is nothing earlier to share, so every hit rate is 0")
    short = sum(len(r.tokens) <= page_size for r in trace)
    if short:
        out.append(f"{short} of {len(trace)} prompts are no longer than a page ({page_size} tokens): the tree "
                   f"shares whole pages, so they can hit only what a cached page's leading tokens share with them, "
                   f"all but their last two tokens at most (try a smaller --page-size)")  # fmt: skip
    longest = max(ceil_div(len(r.tokens) + r.num_output, page_size) for r in trace)
    for r in runs:
        if r.get("rejected"):
            where = f"{r['capacity_pages']} pages" + (f" ({r['label']})" if r.get("label") else f", {r['policy']}")
            out.append(f"{r['rejected']} of {r['requests']} requests did not fit a pool of {where}: the longest "
                       f"request needs {longest} pages alone; they were skipped after what they could compute")  # fmt: skip
    return out


def explain_identical(result: dict) -> list[str]:
    """A sentence for each group of policies with equal hits at every capacity, saying
    why (nothing evicted, every request a miss, all at the unlimited rate, or evictions
    that never cost a later hit)."""
    runs = result["runs"]
    by_policy: dict[str, list[dict]] = {}
    for r in runs:
        by_policy.setdefault((r.get("kv_dtype"), r["policy"]), []).append(r)
    groups: dict[tuple, list[str]] = {}
    for (fmt, name), mine in by_policy.items():
        key = (fmt, tuple((r.get("pool_bytes"), r["capacity_pages"], r["hit_tokens"]) for r in mine))
        groups.setdefault(key, []).append(name)
    out = []
    unlimited = result["unlimited"]["hit_tokens"]
    for (fmt, key), names in groups.items():
        if len(names) < 2:
            continue
        mine = [r for r in runs if r.get("kv_dtype") == fmt and r["policy"] == names[0]]
        if all(r["evicted_pages"] == 0 for r in mine):
            why = "nothing was evicted at these capacities, so no policy ever chose a victim"
        elif all(r["hit_tokens"] == 0 for r in mine):
            why = "every request was a miss: no prompt found a whole page of an earlier one still cached"
        elif all(r["hit_tokens"] == unlimited for r in mine):
            why = "each reached the unlimited hit rate: nothing they evicted was asked for again"
        else:
            why = ("pages were evicted, but each policy kept the same pages that later requests needed (their "
                   "eviction orders agree on this trace, e.g. when prefixes are reused in the order they were "
                   "first used)")
        label = " and ".join(names) if len(names) == 2 else ", ".join(names[:-1]) + " and " + names[-1]
        out.append(f"{label} are identical here{f' ({fmt})' if fmt else ''}: {why}.")
    return out


# -- what-if: one trace under several configurations ---------------------------------------


@dataclass(frozen=True)
class WhatIf:
    """One configuration to replay. ``capacity_pages`` None: unlimited. ``pool_bytes``,
    ``kv_dtype`` and ``bytes_per_page`` say where the pages came from (informative)."""

    label: str
    capacity_pages: int | None
    page_size: int = 16
    policy: str = "lru"
    in_flight: int = 1
    chunk_size: int | None = DEFAULT_CHUNK_SIZE
    host_pages: int | None = None
    store_pages: int | None = None
    kv_dtype: str | None = None
    pool_bytes: int | None = None
    bytes_per_page: int | None = None


def what_if(trace: list[TraceRequest], configs: list[WhatIf], prefill_tok_s: float = DEFAULT_PREFILL_TOK_S,
            decode_tok_s: float = DEFAULT_DECODE_TOK_S, arrivals: bool = True) -> dict:  # fmt: skip
    """Replay ``trace`` once per configuration. Returns ``prefill_tok_s`` and
    ``configs``: per configuration its settings and result (``run_dict``) with
    ``prefill_tokens_saved`` (the hit tokens: prompt tokens not computed),
    ``prefill_tokens`` (those computed) and their estimated seconds at
    ``prefill_tok_s`` (``est_prefill_s_saved``, ``est_prefill_s``)."""
    out = []
    for c in configs:
        partial = c.kv_dtype is None or not kv_format(c.kv_dtype).paged  # the engine copies no sealed page's rows
        result = replay(trace, c.capacity_pages, c.page_size, c.policy, c.in_flight, c.chunk_size, c.host_pages,
                        c.store_pages, arrivals, prefill_tok_s, decode_tok_s, partial)  # fmt: skip
        row = {**asdict(c), **run_dict(trace, result), "unlimited": c.capacity_pages is None}
        row["prefill_tokens_saved"] = saved = row["cached_tokens"]
        row["prefill_tokens"] = row["prompt_tokens"] - saved
        row["est_prefill_s_saved"] = saved / prefill_tok_s
        row["est_prefill_s"] = row["prefill_tokens"] / prefill_tok_s
        out.append(row)
    return {"prefill_tok_s": prefill_tok_s, "configs": out, **_live(trace)}


def format_what_if(result: dict) -> str:
    """One row per configuration: pages, hit rate, prefill tokens saved and computed,
    estimated prefill seconds saved (at the result's ``prefill_tok_s``)."""
    rows = [["config", "pages", "hit % of prompt", "prefill tok saved", "prefill tok computed", "est. prefill s saved"]]
    for r in result["configs"]:
        rows.append([r["label"], "unlimited" if r["unlimited"] else str(r["capacity_pages"]), f"{100 * r['cached_tokens'] / max(r['prompt_tokens'], 1):.2f}",
                     f"{r['prefill_tokens_saved']:,}", f"{r['prefill_tokens']:,}", f"{r['est_prefill_s_saved']:,.1f}"])  # fmt: skip
    if "live" in result:
        live = result["live"]
        rows.append([f"live run ({live['requests']} requests)", "", f"{100 * live['hit_rate']:.2f}",
                     f"{live['cached_tokens']:,}", f"{live['prompt_tokens'] - live['cached_tokens']:,}", ""])  # fmt: skip
    return _render(rows, left=1)


def format_breakdown(result: dict, key: str, limit: int = 20) -> str:
    """The ``by_<key>`` breakdown as a table: a row per namespace or session (the
    ``limit`` largest by prompt tokens), columns: requests, prompt tokens, live hit %
    (when known), then the replay's hit % unlimited and per run (each run of the first
    policy, or each what-if configuration). "" when the result has no such breakdown."""
    field = f"by_{key}"
    if "configs" in result:
        cols = [(r["label"], r) for r in result["configs"]]
        base = result["configs"][0]
    else:
        first = result["runs"][0]["policy"] if result["runs"] else None
        mine = [r for r in result["runs"] if r["policy"] == first and r.get("kv_dtype") == result["runs"][0].get("kv_dtype")]
        cols = [("unlimited", result["unlimited"])] + [
            (f"{first} {format_bytes(r['pool_bytes']) if 'pool_bytes' in r else r['capacity_pages']}", r) for r in mine]
        base = result["unlimited"]
    if field not in base:
        return ""
    groups = base[field]
    names = sorted(groups, key=lambda n: -groups[n]["prompt_tokens"])
    live = any("live_hit_rate" in g for g in groups.values())
    rows = [[key, "requests", "prompt tok"] + (["live %"] if live else []) + [f"{c} %" for c, _ in cols]]
    for name in names[:limit]:
        g = groups[name]
        row = [name, str(g["requests"]), f"{g['prompt_tokens']:,}"]
        if live:
            row.append(f"{100 * g['live_hit_rate']:.2f}" if "live_hit_rate" in g else "-")
        rows.append(row + [f"{100 * r[field][name]['hit_rate']:.2f}" for _, r in cols])
    text = _render(rows, left=1)
    if len(names) > limit:
        text += f"\n({len(names) - limit} more {key}s in the JSON)"
    return text


def format_bytes(n: int) -> str:
    """``n`` bytes as the largest binary unit that keeps it >= 1 (``4 GiB``, ``512 MiB``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"


def format_byte_table(result: dict) -> str:
    """Hit rate per (format, policy) (rows) and pool size (columns): percent, with the
    pages that size holds in that format."""
    runs = result["runs"]
    sizes = sorted({r["pool_bytes"] for r in runs})
    head = ["kv", "bytes/page", "policy"] + [format_bytes(b) for b in sizes]
    rows = [head]
    for fmt, name in dict.fromkeys((r["kv_dtype"], r["policy"]) for r in runs):
        by_size = {r["pool_bytes"]: r for r in runs if r["kv_dtype"] == fmt and r["policy"] == name}
        cells = [f"{100 * by_size[b]['hit_rate']:.2f} ({by_size[b]['capacity_pages']} p)" for b in sizes]
        rows.append([fmt, str(by_size[sizes[0]]["bytes_per_page"]), name] + cells)
    rows.append(["unlimited", "", ""] + [f"{100 * result['unlimited']['hit_rate']:.2f}"] * len(sizes))
    return _render(rows)


def _render(rows: list[list[str]], left: int = 0) -> str:
    """Right-aligned columns (the first ``left`` left-aligned), a rule under the first row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """Hit rate per policy (rows) and capacity (columns), in percent."""
    runs = result["runs"]
    caps = sorted({r["capacity_pages"] for r in runs})
    fractions = {r["capacity_pages"]: r["capacity_fraction"] for r in runs}
    head = ["policy"] + [f"{c} ({fractions[c]:.0%})" for c in caps]
    rows = [head]
    for name in dict.fromkeys(r["policy"] for r in runs):
        by_cap = {r["capacity_pages"]: r for r in runs if r["policy"] == name}
        rows.append([name] + [f"{100 * by_cap[c]['hit_rate']:.2f}" for c in caps])
        for tier in ("host", "store"):
            if any(r.get(f"{tier}_hit_tokens") for r in by_cap.values()):
                rows.append([f"  from {tier}"] + [f"{100 * by_cap[c][f'{tier}_hit_tokens'] / max(by_cap[c]['queried_tokens'], 1):.2f}"
                                                  for c in caps])  # fmt: skip
    rows.append(["unlimited"] + [f"{100 * result['unlimited']['hit_rate']:.2f}"] * len(caps))
    text = _render(rows)
    if any("of_belady" in r for r in runs):
        text += "\n\n" + format_gap(result)
    return text


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def format_gap(result: dict) -> str:
    """Per policy (rows) and capacity (columns) where Belady ran: hit rate as a percent
    of Belady's, then the percent of the LRU-to-Belady gap closed ("-": no gap, or no
    LRU run)."""
    runs = [r for r in result["runs"] if "of_belady" in r]
    caps = sorted({r["capacity_pages"] for r in runs})
    fractions = {r["capacity_pages"]: r["capacity_fraction"] for r in runs}
    rows = [["% of belady / gap closed %"] + [f"{c} ({fractions[c]:.0%})" for c in caps]]
    for name in dict.fromkeys(r["policy"] for r in runs):
        by_cap = {r["capacity_pages"]: r for r in runs if r["policy"] == name}
        rows.append([name] + [f"{_percent(by_cap[c]['of_belady'])} / {_percent(by_cap[c]['gap_closed'])}"
                              if c in by_cap else "" for c in caps])  # fmt: skip
    return _render(rows, left=1)


MARKERS = "osD^vP*X"
LINESTYLES = ("-", "--", "-.", ":")


def line_style(i: int) -> dict:
    """Line ``i``'s matplotlib style: every line a distinct marker and line style (and
    a shrinking hollow marker), so curves that coincide stay visible on top of each
    other."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)],
            "markersize": max(4.0, 11.0 - 1.5 * (i % 5)), "markerfacecolor": "none", "markeredgewidth": 1.5,
            "linewidth": 1.6, "zorder": 3 + i}  # fmt: skip


def plot(result: dict, path: str | Path, title: str = "") -> None:
    """Write a PNG of hit rate against capacity, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = result["runs"]
    by_bytes = "kv_dtype" in runs[0] if runs else False  # a byte_sweep: x is the pool size, a line per format
    lines = dict.fromkeys((r.get("kv_dtype"), r["policy"]) for r in runs)
    x, unit = ("pool_bytes", 1 << 30) if by_bytes else ("capacity_fraction", 1)
    for i, (fmt, name) in enumerate(lines):
        mine = [r for r in runs if r.get("kv_dtype") == fmt and r["policy"] == name]
        pts = sorted((r[x] / unit, 100 * r["hit_rate"]) for r in mine)
        ax.plot(*zip(*pts), label=f"{fmt} {name}" if by_bytes else name, **line_style(i))
    ax.axhline(100 * result["unlimited"]["hit_rate"], color="gray", linestyle=":", label="unlimited")
    ax.set_xlabel("KV pool (GiB)" if by_bytes else "cache capacity (fraction of unique pages)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title(title or "hit rate vs capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
