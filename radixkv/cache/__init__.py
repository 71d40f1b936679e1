"""KV page pool, radix-tree prefix cache, eviction policies and the hit-rate simulator."""

from radixkv.cache.policy import POLICIES, EvictionPolicy, make_policy
from radixkv.cache.pool import KVPool, PageAllocator, PoolConfig
from radixkv.cache.radix import Match, Node, RadixCache, TreeStats

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "KVPool",
    "Match",
    "Node",
    "PageAllocator",
    "PoolConfig",
    "RadixCache",
    "TreeStats",
    "make_policy",
]
