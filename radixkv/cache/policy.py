"""Eviction policies for the radix tree, chosen by name.

A policy orders the tree's evictable leaves: ``key(node)`` returns a value, and the
leaf with the smallest key loses pages first. Every node carries the statistics the
policies read (``last_access``, ``hits``, ``created``, ``priority``); the tree keeps
them up to date and folds a removed leaf's statistics into its parent, so a parent
that turns into a leaf is ranked as if every access below it had touched it.

The tree keeps candidates in a lazy heap, which is exact only when a node's key never
decreases while the node is alive; every policy here has that property. A policy
that cannot promise it (the simulator's offline Belady reference) sets ``lazy = False``
and implements ``choose`` instead, which sees all candidates at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from radixkv.cache.radix import Node


class EvictionPolicy:
    """Base class. Subclasses set ``name`` and implement ``key`` (or ``choose``).

    A policy with ``classes`` > 1 sorts leaves into that many classes (``klass``), each
    ordered by ``key`` in its own lazy heap; the victim is the head of the class whose
    head ``rank`` is smallest. A policy with ``observes`` is told of every hit
    (``hit``) and eviction (``evicted``), with the leaf's age in tree ticks.
    """

    name: str = ""
    lazy: bool = True
    classes: int = 1
    observes: bool = False

    def key(self, node: Node) -> Any:
        raise NotImplementedError

    def klass(self, node: Node) -> int:
        return 0

    def rank(self, klass: int, node: Node, now: int) -> Any:
        """Multi-class policies: the value of keeping ``node``, the head of ``klass``'s
        heap, at tick ``now``; the smallest loses pages first."""
        raise NotImplementedError

    def hit(self, node: Node, age: int) -> None:
        """A match ended at ``node``, ``age`` ticks after its last access."""

    def evicted(self, node: Node, age: int, pages: int) -> None:
        """``pages`` tail pages of leaf ``node`` go, ``age`` ticks after its last access."""

    def choose(self, leaves: list[Node], need: int) -> tuple[Node, int]:
        """Non-lazy policies: pick a leaf and how many of its tail pages to drop."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used leaf first."""

    name = "lru"

    def key(self, node: Node) -> int:
        return node.last_access


class LFU(EvictionPolicy):
    """Fewest hits first; ties go to the least recently used."""

    name = "lfu"

    def key(self, node: Node) -> tuple[int, int]:
        return (node.hits, node.last_access)


class FIFO(EvictionPolicy):
    """Oldest insertion first, however often it was used since."""

    name = "fifo"

    def key(self, node: Node) -> int:
        return node.created


class Priority(EvictionPolicy):
    """Lowest request priority first (a node keeps the highest priority that inserted
    it); ties go to the least recently used."""

    name = "priority"

    def key(self, node: Node) -> tuple[int, int]:
        return (node.priority, node.last_access)


class CostAware(EvictionPolicy):
    """Evict the pages with the least expected saved cost per byte; LRU breaks ties.

    Expected reuse is learned online, in the manner of least-hit-density eviction
    (Beckmann et al., NSDI'18): leaves fall into classes by how often they were hit
    (0, 1, 2+), by what they hold (prompt, or mostly generated text) and by depth
    (shallow, or ending past ``depth_scale / 2`` tokens), and each
    class keeps a histogram, over log2 age bins (ticks since last access), of the pages
    that were hit and those that were evicted at that age. From it, for a leaf of age
    ``a`` in class ``c``:

        density(c, a) = pages hit at ages >= a / page-ticks spent at ages >= a

    the hits a page of that class and age can still expect per tick it stays. A hit
    saves recomputing the page, which costs more the deeper it lies (attention over
    the prefix): ``cost = 1 + depth / depth_scale`` (``depth_scale``: the context
    length at which a token's attention costs as much as the rest of its forward pass;
    about 3k tokens for the embedded model). The leaf whose tail has the least
    ``density * cost`` goes first. Histograms decay by ``decay`` at each refresh (every
    ``period`` hits and evictions), so the statistics follow the workload; a class with
    fewer than ``min_pages`` pages of events borrows the pooled curve of its kind.

    Admission: before it has learned anything, generated text counts ``generated_prior``
    times a prompt page of the same age, so pages that are rarely reused (a single-turn
    request's output) enter first in line; once hits on generated pages are seen (a chat
    whose next turn repeats the answer), their own class takes over.

    Within a class leaves are ordered by last access (a lazy heap per class); at each
    victim the policy compares the classes' oldest leaves, so an eviction costs a few
    heap operations and at most ``classes`` rank evaluations.
    """

    name = "cost"
    classes = 12  # (prompt, generated) x hits (0, 1, 2+) x (shallow, deep)
    KIND = 6  # classes per kind: generated text's classes are prompt's plus KIND
    observes = True
    BINS = 48  # log2 age bins: bin b holds ages in [2**(b-1), 2**b)

    def __init__(self, depth_scale: float = 3072.0, period: int = 1024, decay: float = 0.8, min_pages: int = 64,
                 generated_prior: float = 0.25):  # fmt: skip
        if not depth_scale > 0:
            raise ValueError(f"depth_scale must be > 0, got {depth_scale!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.depth_scale = float(depth_scale)
        self.period = int(period)
        self.decay = float(decay)
        self.min_pages = min_pages
        self.generated_prior = float(generated_prior)
        n = self.BINS
        self._hits = np.zeros((self.classes, n))  # pages hit, by class and age bin
        self._gone = np.zeros((self.classes, n))  # pages evicted, by class and age bin
        self._events = 0
        self._lo = np.array([0] + [1 << (b - 1) for b in range(1, n)], dtype=np.float64)  # smallest age in a bin
        self._mid = np.array([0.0] + [1.5 * (1 << (b - 1)) for b in range(1, n)])  # a bin's typical age
        prior = 1.0 / (1.0 + self._lo)  # nothing learned yet: LRU
        scale = np.where(np.arange(self.classes) >= self.KIND, self.generated_prior, 1.0)[:, None]
        self._density: list[list[float]] = (scale * prior).tolist()

    def key(self, node: Node) -> int:
        return node.last_access

    def klass(self, node: Node) -> int:
        hits = node.hits
        deep = 2 * _end(node) >= self.depth_scale
        return (self.KIND if node.generated else 0) + 2 * (hits if hits < 2 else 2) + deep

    def rank(self, klass: int, node: Node, now: int) -> tuple[float, int]:
        density = self._density[klass][(now - node.last_access).bit_length()]
        return (density * (1.0 + _end(node) / self.depth_scale), node.last_access)

    def hit(self, node: Node, age: int) -> None:
        self._count(self._hits, node, age, len(node.pages))

    def evicted(self, node: Node, age: int, pages: int) -> None:
        self._count(self._gone, node, age, pages)

    def _count(self, histogram: np.ndarray, node: Node, age: int, pages: int) -> None:
        histogram[self.klass(node), age.bit_length()] += pages
        self._events += 1
        if self._events >= self.period:
            self._refresh()

    def _refresh(self) -> None:
        """Recompute the density curves from the histograms (``_curves``), then decay
        the histograms."""
        self._events = 0
        hits, gone = self._hits, self._gone
        curves = self._curves(hits, gone)
        by_kind = (2, self.KIND, self.BINS)  # prompt / generated, then the kind's classes
        pooled = self._curves(hits.reshape(by_kind).sum(1), gone.reshape(by_kind).sum(1))
        seen = (hits + gone).sum(1)
        pooled_seen = seen.reshape(2, self.KIND).sum(1)
        for c in range(self.classes):
            if seen[c] >= self.min_pages:
                self._density[c] = curves[c].tolist()
            elif pooled_seen[c // self.KIND] >= self.min_pages:
                self._density[c] = pooled[c // self.KIND].tolist()
        hits *= self.decay
        gone *= self.decay

    def _curves(self, hits: np.ndarray, gone: np.ndarray) -> np.ndarray:
        """Per row, density[b] = pages hit at ages >= lo[b] / page-ticks lived past
        lo[b] (each event at least one tick), from suffix sums over the bins."""
        def suffix(a):
            return np.cumsum(a[:, ::-1], axis=1)[:, ::-1]

        events = hits + gone
        future_hits = suffix(hits)
        count = suffix(events)
        life = np.maximum(suffix(events * self._mid) - self._lo * count, count)
        return np.divide(future_hits, life, out=np.zeros_like(future_hits), where=life > 0)


def _end(node: Node) -> int:
    """Tokens from the root to the end of ``node``'s edge."""
    return node.depth + len(node.key) // 4


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, FIFO, Priority, CostAware)}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """Return a policy instance for a registered name, or ``policy`` itself if it is one.

    Raises ValueError naming the known policies for an unknown name.
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return POLICIES[policy]()
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}") from None
