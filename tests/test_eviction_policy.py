"""The cost-aware eviction policy: the order it evicts in on constructed trees, what it
learns from hits and evictions, and that the tree stays whole under it."""

import numpy as np
import pytest

from radixkv.cache import KVCacheManager, PageAllocator, RadixCache, SeqKV, make_policy
from radixkv.cache.policy import CostAware


def tree(num_pages=64, policy="cost"):
    a = PageAllocator(num_pages)
    return a, RadixCache(a, 1, policy)


def put(t, tokens, namespace=None, generated_from=None):
    """Insert like a finishing request (own pages for the uncached part, then release)."""
    a = t.allocator
    m = t.match_prefix(tokens, namespace, record_stats=False)
    table = np.concatenate([m.pages, a.alloc(len(tokens) - len(m.pages))])
    ins = t.insert(tokens, table, namespace, generated_from=generated_from, adopt=True)
    return ins.node


def survivors(t):
    return sorted((n.tokens()[0], len(n.pages)) for n in t.nodes() if not n.children)


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_deep_prefix_outlives_a_shallow_one_of_equal_recency(policy):
    a, t = tree(num_pages=4000, policy=policy)
    put(t, list(range(1000, 4000)))  # deep: 3000 tokens, older
    put(t, [1, 2, 3, 4])  # shallow, two ticks newer
    put(t, [7])  # later requests age both: 6 and 4 ticks, one log2 age bin
    t.match_prefix([7])
    t.match_prefix([7])
    assert t.evict(2) == 2
    left = dict(survivors(t))
    if policy == "cost":  # recomputing the deep run costs more: the shallow one goes
        assert left[1000] == 3000 and left[1] == 2
    else:  # LRU takes the older deep run's tail
        assert left[1000] == 2998 and left[1] == 4
    t.check_integrity(external_refs={})


def test_generated_text_enters_first_in_line():
    a, t = tree()
    put(t, [50, 51, 52, 53], generated_from=0)  # a finished request's output pages, older
    put(t, [60, 61, 62, 63])  # a prompt
    put(t, [70, 71, 72, 73], generated_from=0)  # output, newest of all
    assert t.evict(6) == 6
    # the generated leaves lose pages before the prompt, the newest one included
    assert survivors(t) == [(60, 4), (70, 2)]
    t.check_integrity(external_refs={})


def test_it_learns_that_generated_pages_come_back():
    """Once generated pages are seen to be hit and prompt pages to be evicted unused,
    a generated leaf outlives a prompt leaf of the same age (the prior said otherwise)."""
    policy = CostAware(period=8, min_pages=1, decay=1.0)
    a, t = tree(num_pages=256, policy=policy)
    base = 1000
    for i in range(12):
        g = [base + 10 * i + j for j in range(4)]
        put(t, g, generated_from=0)
        put(t, [5000 + 10 * i + j for j in range(4)])  # a prompt nobody asks for again
        t.match_prefix(g)  # the next turn repeats the answer
        t.match_prefix([9999])
    t.evict(t.cached_pages)  # everything goes: prompt pages evicted unhit, after the hits above
    gen = put(t, [7000, 7001, 7002], generated_from=0)
    put(t, [8000, 8001, 8002])
    t.match_prefix([9999])
    assert t.evict(3) == 3
    assert survivors(t) == [(7000, 3)]
    assert gen.alive
    t.check_integrity(external_refs={})


def test_cost_policy_keeps_the_manager_consistent_under_pressure():
    """The simulator-style lifecycle (admit, reserve with eviction, release) under the
    cost policy: outputs marked generated, integrity after every request."""
    a = PageAllocator(40)
    t = RadixCache(a, 4, "cost")
    kv = KVCacheManager(a, t, 4)
    rng = np.random.default_rng(0)
    shared = list(range(1, 17))
    marked = 0
    for i in range(60):
        prompt = shared + rng.integers(100, 200, size=int(rng.integers(2, 30))).tolist()
        out = [300 + i] * 13  # 12 computed: most of a leaf whose prompt part is short
        seq = SeqKV()
        kv.admit(seq, prompt)
        tokens = prompt + out
        assert kv.reserve(seq, len(tokens) - 1 - seq.computed)
        kv.computed(seq, len(tokens) - 1)
        kv.release(seq, tokens)
        kv.check([])
        generated = [n for n in t.nodes() if n.generated]
        assert all(n.depth >= len(shared) for n in generated)
        marked += len(generated)
    assert t.evicted_pages > 0
    assert marked > 0  # the manager marked published output as generated


def test_node_depth_follows_splits_and_merges():
    a, t = tree(policy="cost")
    put(t, [1, 2, 3, 4, 5, 6])
    put(t, [1, 2, 3, 9, 9])  # splits the first edge after 3 tokens
    depths = {tuple(n.tokens()): n.depth for n in t.nodes()}
    assert depths == {(1, 2, 3): 0, (4, 5, 6): 3, (9, 9): 3}
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    t.lock(m.node)
    assert t.evict(2) == 2  # the (9, 9) leaf goes; (1, 2, 3) is left with one child
    t.unlock(m.node)  # unlocking merges it into that child
    assert {tuple(n.tokens()): n.depth for n in t.nodes()} == {(1, 2, 3, 4, 5, 6): 0}
    t.check_integrity(external_refs={})


def test_cost_policy_settings_are_checked():
    assert make_policy("cost").name == "cost"
    with pytest.raises(ValueError, match="depth_scale"):
        CostAware(depth_scale=0)
    with pytest.raises(ValueError, match="decay"):
        CostAware(decay=1.5)
