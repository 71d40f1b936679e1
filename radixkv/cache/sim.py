"""Hit-rate simulator: replay a trace against the radix tree at a given capacity.

Each request does what the engine does with a prompt, minus the model:

    match prefix -> lock -> make room (evict; else finish the oldest request in
    flight) -> allocate pages for the uncached suffix and the output -> (in flight)
    -> insert prompt + output -> unlock -> release the request's pages

Two references bound what a policy can reach: the hit rate with unlimited capacity,
and Belady's offline policy, which evicts the cached page whose next use lies
farthest in the future (it reads the whole trace ahead).
"""

from __future__ import annotations

import bisect
import json
import math
from array import array
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from radixkv.cache.policy import EvictionPolicy, make_policy
from radixkv.cache.pool import PageAllocator
from radixkv.cache.radix import Node, RadixCache
from radixkv.cache.traces import VOCAB, TraceRequest

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

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


def _outputs(trace: list[TraceRequest]) -> list[array]:
    """Output ids per request: given lists as they are; counts become ids outside the
    synthetic vocabulary that no prompt can repeat."""
    next_id = max(VOCAB, 1 + max(max(r.tokens) for r in trace))
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
    return sum(-(-(len(r.tokens) + r.num_output) // page_size) for r in trace)


def replay(
    trace: list[TraceRequest],
    capacity_pages: int | None,
    page_size: int = 1,
    policy: str | EvictionPolicy = "lru",
    in_flight: int = 1,
) -> SimResult:
    """Replay ``trace`` with ``capacity_pages`` pages (None: unlimited).

    ``policy`` is a registered name or ``"belady"``. With ``in_flight`` > 1 a request
    stays locked until ``in_flight`` newer ones have arrived, so it neither shares its
    own pages with them nor lets them be evicted.
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    if capacity_pages is None:
        capacity_pages = total_pages(trace, page_size) + 1
    if policy == "belady":
        policy = Belady(trace, page_size)
    policy = make_policy(policy)
    allocator = PageAllocator(capacity_pages)
    tree = RadixCache(allocator, page_size, policy)
    outputs = _outputs(trace)
    running: deque = deque()
    rejected = 0

    def finish():
        full, table, node, req = running.popleft()
        tree.insert(full, table, req.namespace, req.priority)
        tree.unlock(node)
        allocator.decref(table)

    for i, req in enumerate(trace):
        if isinstance(policy, Belady):
            policy.now = i
        match = tree.match_prefix(req.tokens, req.namespace)
        tree.lock(match.node)
        full = req.tokens + outputs[i]
        need = -(-len(full) // page_size) - len(match.pages)
        while allocator.num_free() < need:
            tree.evict(need - allocator.num_free())
            if allocator.num_free() >= need or not running:
                break
            finish()
        if allocator.num_free() < need:
            tree.unlock(match.node)
            rejected += 1
            continue
        allocator.incref(match.pages)
        table = np.concatenate([match.pages, allocator.alloc(need)])
        running.append((full, table, match.node, req))
        if len(running) >= in_flight:
            finish()
    while running:
        finish()
    tree.check_integrity(external_refs={})
    return SimResult(
        policy.name, capacity_pages, page_size, in_flight, len(trace), rejected,
        tree.queried_tokens, tree.hit_tokens, tree.evicted_pages, tree.cached_pages,
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
    than the runner-up leaf's tail.
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
        self._cache: dict[tuple, float] = {}

    def _next_use(self, namespace, prefix: bytes) -> float:
        """Next use of the page that ends ``prefix``. A cached answer stays right until
        ``now`` reaches it."""
        hit = self._cache.get((namespace, prefix))
        if hit is not None and hit > self.now:
            return hit
        value = self.index[namespace].first_after(prefix, self.now)
        self._cache[(namespace, prefix)] = value
        return value

    def choose(self, leaves: list[Node], need: int) -> tuple[Node, int]:
        width = 4 * self.page_size
        ranked = []
        for leaf in leaves:
            path = leaf.path_key()
            ranked.append((self._next_use(leaf.namespace, path), len(path), id(leaf), leaf, path))
        ranked.sort(reverse=True)
        _, _, _, victim, path = ranked[0]
        runner_up = ranked[1][0] if len(ranked) > 1 else -NEVER
        # Largest k such that the k tail pages are all needed no sooner than runner_up.
        lo, hi = 1, min(need, len(victim.pages))
        while lo < hi:
            k = (lo + hi + 1) // 2
            if self._next_use(victim.namespace, path[: len(path) - (k - 1) * width]) >= runner_up:
                lo = k
            else:
                hi = k - 1
        return victim, lo


def sweep(
    trace: list[TraceRequest],
    page_size: int = 1,
    policies: tuple[str, ...] = ("lru",),
    fractions: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8),
    capacity_pages: tuple[int, ...] | None = None,
    in_flight: int = 1,
    belady: bool = True,
) -> dict:
    """Replay every policy (and Belady) at every capacity, plus the unlimited bound.

    Capacities are ``capacity_pages`` when given, else ``fractions`` of the trace's
    unique pages (what unlimited capacity ends up caching). Returns a JSON-ready dict:
    ``unique_pages``, ``unlimited`` (its result) and ``runs`` (one result per policy
    and capacity, with the ``capacity_fraction`` of the unique pages).
    """
    unlimited = replay(trace, None, page_size, "lru", in_flight)
    unique = unlimited.cached_pages
    if capacity_pages is None:
        capacity_pages = tuple(sorted({max(1, round(f * unique)) for f in fractions}))
    runs = []
    for name in (*policies, *(("belady",) if belady else ())):
        for cap in capacity_pages:
            result = replay(trace, cap, page_size, name, in_flight)
            runs.append({**result.as_dict(), "capacity_fraction": cap / unique if unique else 0.0})
    return {"unique_pages": unique, "unlimited": unlimited.as_dict(), "runs": runs}


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
    rows.append(["unlimited"] + [f"{100 * result['unlimited']['hit_rate']:.2f}"] * len(caps))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(result: dict, path: str | Path, title: str = "") -> None:
    """Write a PNG of hit rate against capacity, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = result["runs"]
    for name in dict.fromkeys(r["policy"] for r in runs):
        pts = sorted((r["capacity_fraction"], 100 * r["hit_rate"]) for r in runs if r["policy"] == name)
        style = "--" if name == "belady" else "-"
        ax.plot(*zip(*pts), style, marker="o", label=name)
    ax.axhline(100 * result["unlimited"]["hit_rate"], color="gray", linestyle=":", label="unlimited")
    ax.set_xlabel("cache capacity (fraction of unique pages)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title(title or "hit rate vs capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
