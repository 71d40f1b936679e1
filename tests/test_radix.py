from array import array

import numpy as np
import pytest
import torch

from radixkv.cache import PageAllocator, RadixCache, make_policy
from radixkv.errors import IntegrityError


def make(num_pages=64, page_size=1, policy="lru"):
    a = PageAllocator(num_pages)
    return a, RadixCache(a, page_size, policy)


def put(tree, tokens, namespace=None, priority=0):
    """Insert like a finishing request: own pages for everything not cached, then release."""
    a = tree.allocator
    m = tree.match_prefix(tokens, namespace)
    n = -(-len(tokens) // tree.page_size)
    a.incref(m.pages)
    table = np.concatenate([m.pages, a.alloc(n - len(m.pages))])
    cached = tree.insert(tokens, table, namespace, priority).num_cached
    a.decref(table)
    return table, cached


def test_insert_then_match_returns_exact_pages():
    a, t = make()
    table, cached = put(t, [1, 2, 3, 4])
    assert cached == 0 and table.tolist() == [0, 1, 2, 3]
    m = t.match_prefix([1, 2, 3, 4, 5])
    assert m.pages.tolist() == [0, 1, 2, 3] and m.num_tokens == 4
    assert m.node.tokens() == [1, 2, 3, 4]
    assert t.match_prefix([9]).num_tokens == 0
    assert a.refcount([0, 1, 2, 3]).tolist() == [1, 1, 1, 1]  # the tree's reference only
    t.check_integrity(external_refs={})


def test_match_splits_an_edge_at_the_mismatch():
    a, t = make()
    put(t, [1, 2, 3, 4, 5, 6])
    assert t.stats().num_nodes == 1
    m = t.match_prefix([1, 2, 3, 9])
    assert m.pages.tolist() == [0, 1, 2] and m.node.tokens() == [1, 2, 3]
    assert t.stats().num_nodes == 2
    (child,) = m.node.children.values()
    assert child.tokens() == [4, 5, 6] and child.pages.tolist() == [3, 4, 5]
    table, cached = put(t, [1, 2, 3, 9, 9])
    assert cached == 3 and table.tolist() == [0, 1, 2, 6, 7]
    assert sorted(n.tokens() for n in m.node.children.values()) == [[4, 5, 6], [9, 9]]
    assert t.match_prefix([1, 2, 3, 4, 5, 6]).pages.tolist() == [0, 1, 2, 3, 4, 5]
    t.check_integrity(external_refs={})


def test_only_whole_pages_enter_and_match():
    a, t = make(page_size=4)
    table, cached = put(t, list(range(10)))  # 2 whole pages + a partial one
    assert table.tolist() == [0, 1, 2] and cached == 0
    assert a.num_free() == 64 - 2  # the partial page went back
    assert t.match_prefix(list(range(7))).pages.tolist() == [0]
    assert t.match_prefix(list(range(8))).pages.tolist() == [0, 1]
    assert t.match_prefix(list(range(12))).num_tokens == 8
    assert t.match_prefix([0, 1, 2, 9, 4, 5, 6, 7]).num_tokens == 0  # mismatch inside page 1
    m = t.match_prefix([0, 1, 2, 3, 4, 5, 9, 9])  # mismatch inside page 2: split after page 1
    assert m.pages.tolist() == [0] and m.node.tokens() == [0, 1, 2, 3]
    assert t.insert([1, 2, 3], [5]).num_cached == 0  # shorter than a page: nothing to cache
    t.check_integrity(external_refs={})


def test_insert_keeps_the_trees_pages_and_caller_drops_duplicates():
    a, t = make()
    put(t, [7, 8, 9])
    mine = a.alloc(4)  # computed the same prefix again, concurrently
    assert t.insert([7, 8, 9, 10], mine).num_cached == 3
    assert t.match_prefix([7, 8, 9, 10]).pages.tolist() == [0, 1, 2, 6]
    assert a.refcount(mine).tolist() == [1, 1, 1, 2]
    assert a.decref(mine) == 3  # the three duplicates are freed, page 6 stays in the tree
    assert a.num_free() == 64 - 4
    t.check_integrity(external_refs={})


def test_namespaces_never_share_pages():
    a, t = make()
    pa, _ = put(t, [1, 2, 3], namespace="a")
    assert t.match_prefix([1, 2, 3], "b").num_tokens == 0
    assert t.match_prefix([1, 2, 3]).num_tokens == 0
    pb, cached = put(t, [1, 2, 3], namespace="b")
    assert cached == 0 and set(pa.tolist()).isdisjoint(pb.tolist())
    assert t.match_prefix([1, 2, 3], "a").pages.tolist() == pa.tolist()
    assert t.match_prefix([1, 2, 3], "b").pages.tolist() == pb.tolist()
    t.check_integrity(external_refs={})


def test_locked_path_survives_eviction_until_unlocked():
    a, t = make()
    put(t, [1, 2, 3, 4])
    put(t, [1, 2, 5, 6])
    m = t.match_prefix([1, 2, 3, 4])
    t.lock(m.node)
    assert t.protected_pages == 4 and t.evictable_pages == 2
    assert t.evict(10) == 2  # only [5, 6] could go
    assert t.match_prefix([1, 2, 3, 4]).num_tokens == 4
    assert t.match_prefix([1, 2, 5, 6]).num_tokens == 2
    t.unlock(m.node)
    assert t.protected_pages == 0
    assert t.evict(10) == 4
    assert t.cached_pages == 0 and a.num_free() == 64
    t.check_integrity(external_refs={})


def test_lock_counts_nest():
    a, t = make()
    put(t, [1, 2])
    m = t.match_prefix([1, 2])
    t.lock(m.node)
    t.lock(m.node)
    t.unlock(m.node)
    assert t.evict(2) == 0
    t.unlock(m.node)
    with pytest.raises(ValueError, match="not locked"):
        t.unlock(m.node)
    assert t.evict(2) == 2
    with pytest.raises(ValueError, match="evicted"):
        t.lock(m.node)
    t.lock(t.root())  # locking a root is a no-op
    t.check_integrity(external_refs={})


def test_evict_takes_only_the_tail_pages_it_needs():
    a, t = make()
    put(t, [1, 2, 3, 4, 5])
    assert t.evict(2) == 2
    m = t.match_prefix([1, 2, 3, 4, 5])
    assert m.pages.tolist() == [0, 1, 2] and m.num_tokens == 3
    assert a.num_free() == 64 - 3
    assert t.evicted_pages == 2
    t.check_integrity(external_refs={})


def test_parent_becomes_a_candidate_once_its_children_are_gone():
    a, t = make()
    put(t, [1, 2])
    put(t, [1, 2, 3])  # child of [1, 2]
    put(t, [1, 2, 4])
    assert t.evict(3) == 3  # both children (1 page each) and then the parent's 2 pages... one of them
    assert t.cached_pages == 1
    assert t.match_prefix([1, 2]).pages.tolist() == [0]
    t.check_integrity(external_refs={})


def _order_of_eviction(tree, prompts):
    """Evict two pages at a time; return the prompts in the order they lost their pages.
    Reads the tree without matching, so the policy's statistics stay untouched."""
    gone = []
    for _ in prompts:
        tree.evict(2)
        present = {array("i", n.path_key()).tolist().__repr__() for n in tree.nodes()}
        gone += [p for p in prompts if p not in gone and repr(p) not in present]
    return gone


A, B, C = [1, 1], [2, 2], [3, 3]


def test_lru_evicts_least_recently_used():
    a, t = make()
    for p in (A, B, C):
        put(t, p)
    t.match_prefix(A)  # A is now the most recent
    assert _order_of_eviction(t, [A, B, C]) == [B, C, A]


def test_lfu_evicts_least_frequently_used():
    a, t = make(policy="lfu")
    for p in (A, B, C):
        put(t, p)
    for p in (A, A, A, C, C, B):  # hits: A 4, C 3, B 2 (put matched once each)
        t.match_prefix(p)
    assert _order_of_eviction(t, [A, B, C]) == [B, C, A]


def test_fifo_evicts_oldest_insert_even_if_used():
    a, t = make(policy="fifo")
    for p in (A, B, C):
        put(t, p)
    t.match_prefix(A)
    assert _order_of_eviction(t, [A, B, C]) == [A, B, C]


def test_priority_evicts_lowest_priority_first():
    a, t = make(policy="priority")
    put(t, A, priority=5)
    put(t, B, priority=1)
    put(t, C, priority=5)
    t.match_prefix(C)
    t.match_prefix(A)  # same priority as C and more recent
    assert _order_of_eviction(t, [A, B, C]) == [B, C, A]


def test_parent_inherits_recency_of_its_evicted_children():
    a, t = make()
    put(t, [5, 5])  # old, unrelated
    put(t, [1, 1])
    put(t, [1, 1, 2])
    t.match_prefix([1, 1, 2])  # touches [1,1] too
    assert t.evict(1) == 1  # [5,5] loses a page: it is older than the [1,1,2] path
    assert t.match_prefix([1, 1, 2]).num_tokens == 3
    t.check_integrity(external_refs={})


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="lru"):
        make_policy("mru")


@pytest.mark.parametrize("tokens", [[], np.array([], dtype=np.int64)])
def test_empty_tokens_are_rejected(tokens):
    a, t = make()
    with pytest.raises(ValueError, match="empty"):
        t.match_prefix(tokens)
    with pytest.raises(ValueError, match="empty"):
        t.insert(tokens, [])


@pytest.mark.parametrize("tokens", ["abc", [1.5, 2], [2**40], np.zeros((2, 2), dtype=np.int32), [None]])
def test_invalid_tokens_are_rejected(tokens):
    a, t = make()
    with pytest.raises(ValueError, match="tokens"):
        t.match_prefix(tokens)


def test_insert_validates_pages_and_changes_nothing():
    a, t = make()
    with pytest.raises(ValueError, match="whole pages"):
        t.insert([1, 2, 3], a.alloc(2))
    with pytest.raises(ValueError, match="owned"):
        t.insert([1, 2, 3], [10, 11, 12])  # free pages: nobody may share them
    assert t.cached_pages == 0 and t.match_prefix([1, 2, 3]).num_tokens == 0
    with pytest.raises(ValueError, match="num_pages"):
        t.evict(-1)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(a, 0)
    t.check_integrity(external_refs={0: 1, 1: 1})


@pytest.mark.parametrize(
    "as_input",
    [list, tuple, lambda x: array("i", x), np.array, lambda x: np.array(x, dtype=np.int32), torch.tensor],
)
def test_token_inputs_of_every_kind_match_alike(as_input):
    a, t = make()
    put(t, [3, 1, 4, 1, 5])
    assert t.match_prefix(as_input([3, 1, 4, 1, 9])).pages.tolist() == [0, 1, 2, 3]


def test_counters():
    a, t = make()
    put(t, [1, 2, 3])  # queries 3, hits 0
    put(t, [1, 2, 4])  # queries 3, hits 2
    t.match_prefix([1, 2, 3, 4])  # queries 4, hits 3
    t.evict(1)
    s = t.stats()
    assert (s.queried_tokens, s.hit_tokens, s.inserted_pages, s.evicted_pages) == (10, 5, 4, 1)
    assert s.cached_pages == 3 and s.hit_rate == 0.5
    t.check_integrity(external_refs={})


def test_check_integrity_cross_checks_owners():
    a, t = make()
    table, _ = put(t, [1, 2, 3])
    a.incref(table)  # a "request" still holds its pages
    t.check_integrity(external_refs={int(p): 1 for p in table})
    with pytest.raises(IntegrityError, match="refcount"):
        t.check_integrity(external_refs={})
    a.decref(table)
    a.decref(table[:1])  # the tree's own reference, dropped behind its back
    with pytest.raises(IntegrityError):
        t.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_heap_stays_bounded_under_repeated_touches(policy):
    a, t = make(num_pages=256, policy=policy)
    for i in range(50):
        put(t, [i, i, i])
    for _ in range(20):
        for i in range(50):
            m = t.match_prefix([i, i, i])
            t.lock(m.node)
            t.unlock(m.node)
    assert sum(map(len, t._heaps)) <= 2 * t.stats().num_nodes + 64
    assert t.evict(150) == 150
    t.check_integrity(external_refs={})


def test_unlock_merges_a_growing_conversation_into_one_edge():
    a, t = make()
    prompt = [1, 2, 3]
    owned = []
    for turn in range(4):
        m = t.match_prefix(prompt)
        t.lock(m.node)
        a.incref(m.pages)
        table = np.concatenate([m.pages, a.alloc(len(prompt) - len(m.pages))])
        assert t.insert(prompt, table).num_cached == len(m.pages)
        t.unlock(m.node)  # the matched node is now folded into the new leaf
        a.decref(table)
        owned = table.tolist()
        prompt = prompt + [10 + turn, 20 + turn]
    assert t.stats().num_nodes == 1
    (leaf,) = t.nodes()
    assert leaf.pages.tolist() == owned == list(range(9))
    assert t.match_prefix([1, 2, 3, 10, 20, 11, 21, 12, 22]).pages.tolist() == owned
    t.check_integrity(external_refs={})


def test_merge_waits_while_the_parent_is_locked_and_keeps_deeper_handles():
    a, t = make()
    put(t, [1, 2])
    outer = t.match_prefix([1, 2]).node
    t.lock(outer)
    put(t, [1, 2, 3, 4])  # child of the locked node
    inner = t.match_prefix([1, 2, 3, 4]).node
    t.lock(inner)
    t.unlock(outer)  # still pinned through inner: no merge yet
    assert t.stats().num_nodes == 2
    t.unlock(inner)  # now [1,2] folds into inner, which survives
    assert t.stats().num_nodes == 1 and inner.alive and not outer.alive
    assert inner.tokens() == [1, 2, 3, 4] and inner.pages.tolist() == [0, 1, 2, 3]
    t.lock(inner)
    assert t.evict(4) == 0
    t.unlock(inner)
    assert t.evict(4) == 4
    t.check_integrity(external_refs={})


def test_merged_edge_keeps_the_latest_access_of_its_parts():
    a, t = make()
    put(t, [1, 2])
    put(t, [9, 9])
    m = t.match_prefix([1, 2])
    t.lock(m.node)
    t.match_prefix([9, 9])  # touched after [1, 2] was matched, before the insert below
    a.incref(m.pages)
    table = np.concatenate([m.pages, a.alloc(2)])
    t.insert([1, 2, 3, 4], table)  # the newest access
    t.unlock(m.node)
    a.decref(table)
    assert t.stats().num_nodes == 2
    assert t.evict(2) == 2
    assert t.match_prefix([1, 2, 3, 4]).num_tokens == 4 and t.match_prefix([9, 9]).num_tokens == 0


def test_bookkeeping_matches_leave_the_counters_alone():
    a, t = make()
    put(t, [1, 2, 3])
    before = t.stats()
    m = t.match_prefix([1, 2, 3, 4], record_stats=False)
    assert m.num_tokens == 3
    assert t.stats() == before


def _snapshot(tree):
    """Everything a failed call must leave as it was: counters, structure, refcounts."""
    shape = sorted((n.namespace or "", n.path_key(), n.pages.tolist(), n.lock_ref) for n in tree.nodes())
    return tree.stats(), shape, tree.allocator.refcounts().copy(), tree.allocator.num_free()


def _assert_unchanged(tree, before):
    stats, shape, refs, free = _snapshot(tree)
    assert (stats, shape, free) == before[:2] + before[3:]
    assert (refs == before[2]).all()


def test_insert_rejects_a_page_listed_twice_and_changes_nothing():
    a, t = make()
    put(t, [1, 2])
    mine = a.alloc(3)
    before = _snapshot(t)
    with pytest.raises(ValueError, match=r"pages .*twice.*\[2\]"):
        t.insert([5, 6, 7], [mine[0], 2, 2])
    with pytest.raises(ValueError, match=r"pages .*twice.*\[3\]"):
        t.insert([1, 2, 3, 4], [0, 1, 3, 3])  # the duplicate is in the part the tree would take
    _assert_unchanged(t, before)
    t.check_integrity(external_refs={int(p): 1 for p in mine})
    assert t.insert([1, 2, 3, 4], [7, 7, 3, 4]).num_cached == 2  # duplicates the tree does not take are the caller's
    a.decref(mine)
    t.check_integrity(external_refs={})


def test_insert_adopt_takes_over_the_callers_reference_and_validates_the_same():
    a, t = make()
    put(t, [1, 2])  # pages 0, 1
    mine = a.alloc(3)  # 2, 3, 4
    before = _snapshot(t)
    with pytest.raises(ValueError, match=r"pages .*twice.*\[3\]"):
        t.insert([1, 2, 3, 4, 5], [0, 1, 3, 3, 4], adopt=True)
    with pytest.raises(ValueError, match=r"not owned by anybody cannot be adopted"):
        t.insert([7, 8], [2, 9], adopt=True)  # page 9 is free
    with pytest.raises(ValueError, match=r"pages .*held by the tree.*\[1\]"):
        t.insert([7, 8], [2, 1], adopt=True)
    _assert_unchanged(t, before)
    ins = t.insert([1, 2, 3, 4], [5, 5, 2, 3], adopt=True)  # 1, 2 cached: the caller's "copies" are not read
    assert ins.num_cached == 2 and ins.node.path_pages().tolist() == [0, 1, 2, 3]
    assert a.refcount([2, 3, 4]).tolist() == [1, 1, 1]  # the tree owns 2, 3 now; 4 is still the caller's
    t.check_integrity(external_refs={4: 1})
    a.free([4])
    assert t.evict(4) == 4 and a.num_free() == 64
    t.check_integrity(external_refs={})


def test_insert_rejects_pages_the_tree_already_holds_in_any_namespace():
    a, t = make()
    held, _ = put(t, [1, 2, 3, 4])  # pages 0..3, one edge
    before = _snapshot(t)
    with pytest.raises(ValueError, match=r"pages .*held by the tree.*\[0, 1\]"):
        t.insert([8, 9], held[:2])
    with pytest.raises(ValueError, match=r"pages .*held by the tree.*\[2\]"):
        t.insert([1, 2, 9], [0, 1, 2])  # would split [1,2,3,4] and take page 2 again: no split either
    with pytest.raises(ValueError, match=r"pages .*held by the tree.*\[0, 1, 2, 3\]"):
        t.insert([1, 2, 3, 4], held, namespace="b")
    for outside in ([4, 64], np.array([4, -1], dtype=np.int32)):  # checked before the map is read
        with pytest.raises(ValueError, match=r"pages must lie in \[0, 64\)"):
            t.insert([8, 9], outside)
    _assert_unchanged(t, before)
    t.check_integrity(external_refs={})
    mine = a.alloc(1)
    assert t.insert([1, 2, 3, 4, 5], np.concatenate([held, mine])).num_cached == 4  # a cached prefix is not "taken again"
    a.decref(mine)
    assert t.match_prefix([1, 2, 3, 4, 5]).pages.tolist() == [0, 1, 2, 3, 4]
    t.check_integrity(external_refs={})


def test_pages_freed_by_eviction_can_be_inserted_again():
    a, t = make(num_pages=4)
    put(t, [1, 2, 3, 4])
    assert t.evict(4) == 4
    table, cached = put(t, [5, 6, 7, 8])  # the same ids, now free and reallocated
    assert cached == 0 and table.tolist() == [0, 1, 2, 3]
    t.check_integrity(external_refs={})


def test_emptied_namespaces_leave_no_per_namespace_state():
    a, t = make(num_pages=256)
    for i in range(100):
        put(t, [i, i + 1], namespace=f"tenant-{i}")
    put(t, [7, 7, 7])
    assert len(t._roots) == 101
    assert t.evict(3) == 3  # the oldest namespaces lose their only leaf
    assert len(t._roots) == 100  # tenant-0 emptied, tenant-1 kept a page
    t.evict(t.cached_pages)  # what /flush_cache does
    assert t._roots == {} and t.stats().num_nodes == 0 and a.num_free() == 256
    for i in range(100):  # lookups, and inserts shorter than a page, store nothing
        assert t.match_prefix([i], f"other-{i}").num_tokens == 0
    _, t2 = make(page_size=4)
    assert t2.insert([1, 2], [0]).num_cached == 0 and t2._roots == {}
    t.check_integrity(external_refs={})
    root = t.root("tenant-3")  # a dropped namespace still has a root, recreated on demand
    assert root.parent is None and not root.children
    t.lock(root)
    t.unlock(root)
    table, cached = put(t, [3, 4, 5], namespace="tenant-3")
    assert cached == 0 and t.match_prefix([3, 4, 5], "tenant-3").pages.tolist() == table.tolist()
    assert list(t._roots) == ["tenant-3"]
    t.check_integrity(external_refs={})


def test_a_request_holding_a_dropped_root_finishes_normally():
    a, t = make()
    put(t, [1, 2], namespace="x")
    m = t.match_prefix([9, 9], "x")  # nothing matched: the handle is x's root
    t.lock(m.node)
    a.incref(m.pages)
    table = a.alloc(2)
    assert t.evict(2) == 2 and t._roots == {}  # x's root is dropped under the request
    assert t.insert([9, 9], table, "x").num_cached == 0  # a new root
    t.unlock(m.node)
    a.decref(table)
    assert t.match_prefix([9, 9], "x").pages.tolist() == table.tolist()
    t.check_integrity(external_refs={})


def test_partial_page_finds_the_edge_sharing_the_most_tokens_inside_a_page():
    a, t = make(page_size=4)
    put(t, [1, 2, 3, 4, 5, 6, 7, 8])  # pages 0, 1
    put(t, [1, 2, 3, 4, 5, 6, 9, 9])  # splits after page 0: page 2 holds 5 6 9 9
    put(t, [1, 2, 3, 4, 5, 0, 0, 0])  # page 3 holds 5 0 0 0
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 9, 1, 1])
    assert m.num_tokens == 4
    before = t.stats().hit_tokens
    p = t.partial_page(m.node, [1, 2, 3, 4, 5, 6, 9, 1, 1])
    assert (p.page, p.count) == (2, 3) and p.node.tokens() == [5, 6, 9, 9]
    assert t.stats().hit_tokens == before + 3
    assert t.partial_page(m.node, [1, 2, 3, 4, 5, 6, 9, 1, 1], limit=2).count == 2  # at most limit
    other = t.partial_page(m.node, [1, 2, 3, 4, 5, 0], record_stats=False)
    assert (other.page, other.count) == (3, 2) and other.node.tokens() == [5, 0, 0, 0]
    assert t.partial_page(m.node, [1, 2, 3, 4, 7, 6]) is None  # no edge begins with 7
    assert t.partial_page(m.node, [1, 2, 3, 4]) is None  # nothing follows the match
    # a whole page would have matched: at most page_size - 1 tokens, even when a page's worth agrees
    assert t.partial_page(m.node, [1, 2, 3, 4, 5, 6, 9, 9, 1]).count == 3
    assert t.partial_page(t.root(), [7, 7]) is None and t.partial_page(t.root("other"), [1]) is None
    assert t.partial_page(t.root(), [1, 2, 3, 9]).count == 3 and t.partial_page(t.root(), [1, 2, 3, 9]).page == 0
    t.check_integrity(external_refs={})
