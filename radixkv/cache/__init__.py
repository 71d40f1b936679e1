"""KV page pool and its KV formats, radix-tree prefix cache, the KV cache manager, eviction policies and the
hit-rate simulator."""

from radixkv.cache.formats import FORMATS, KVFormat, KVView, kv_format
from radixkv.cache.manager import KVCacheManager, SeqKV
from radixkv.cache.policy import POLICIES, EvictionPolicy, make_policy
from radixkv.cache.pool import KVPool, PageAllocator, PoolConfig
from radixkv.cache.radix import Inserted, Match, Node, RadixCache, TreeStats

__all__ = [
    "FORMATS",
    "KVFormat",
    "KVView",
    "POLICIES",
    "EvictionPolicy",
    "Inserted",
    "KVCacheManager",
    "KVPool",
    "Match",
    "Node",
    "PageAllocator",
    "PoolConfig",
    "RadixCache",
    "SeqKV",
    "TreeStats",
    "kv_format",
    "make_policy",
]
