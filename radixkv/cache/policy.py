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

if TYPE_CHECKING:
    from radixkv.cache.radix import Node


class EvictionPolicy:
    """Base class. Subclasses set ``name`` and implement ``key`` (or ``choose``)."""

    name: str = ""
    lazy: bool = True

    def key(self, node: Node) -> Any:
        raise NotImplementedError

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


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, FIFO, Priority)}


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
