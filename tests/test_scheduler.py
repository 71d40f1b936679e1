"""The scheduler without a model: admission order, chunking, in-batch dedup, eviction
before preemption, preemption order; exact step plans and exact page ids.

A step here is what the engine does around the model: ``schedule``, then ``advance``,
then append a sampled token to every sequence that reached its end (``ScheduledSeq.samples``).
"""

from __future__ import annotations

from radixkv.cache import KVCacheManager, PageAllocator, RadixCache, SeqKV
from radixkv.engine.request import Request
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler

PS = 4
NEXT = 999  # the token every step samples


def scheduler(num_pages=32, max_batch_tokens=64, max_running=8, chunk=16, tree=True) -> Scheduler:
    pool = PageAllocator(num_pages)
    kv = KVCacheManager(pool, RadixCache(pool, PS) if tree else None, PS)
    return Scheduler(kv, max_batch_tokens, max_running, chunk)


def request(name: str, prompt: list[int], max_new: int = 4, **params) -> Request:
    return Request(rid=name, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, **params),
                   sampler=None, detok=None, kv=SeqKV())  # fmt: skip


def step(s: Scheduler) -> list[tuple[str, int, int]]:
    """One engine step without the model; the plan as (rid, start, count)."""
    plan = s.schedule()
    s.advance(plan)
    for p in plan:
        if p.samples:
            p.req.tokens.append(NEXT)
    return [(p.req.rid, p.start, p.count) for p in plan]


def finish(s: Scheduler, req: Request) -> None:
    s.remove(req)
    s.kv.check(s.owners())


def pages(req: Request) -> list[int]:
    return [int(p) for p in req.kv.pages]


def test_chunked_prefill_then_decode_with_exact_pages():
    s = scheduler(chunk=8)
    a = request("a", list(range(1, 21)))  # 20 tokens: chunks of 8, 8, 4
    s.add(a)
    assert step(s) == [("a", 0, 8)] and pages(a) == [0, 1]
    assert step(s) == [("a", 8, 8)] and pages(a) == [0, 1, 2, 3]
    assert s.kv.tree.cached_pages == 4  # both chunks published
    assert step(s) == [("a", 16, 4)] and pages(a) == [0, 1, 2, 3, 4]
    assert a.tokens[-1] == NEXT  # the last chunk sampled
    assert step(s) == [("a", 20, 1)] and pages(a) == [0, 1, 2, 3, 4, 5]  # token 21 opens page 5
    s.kv.check(s.owners())
    finish(s, a)
    assert s.kv.tree.cached_pages == 5 and s.kv.pool.num_free() == 32 - 5  # the partial page went free


def test_longest_cached_prefix_is_admitted_first_and_the_budget_splits_the_rest():
    s = scheduler(max_batch_tokens=12, chunk=None)
    warm = request("warm", [5] * 12)
    s.add(warm)
    step(s)
    finish(s, warm)  # [5]*12 cached: 3 pages
    cold, hot = request("cold", [7] * 9), request("hot", [5] * 12 + [6])
    s.add(cold)
    s.add(hot)
    # hot finds 12 of its tokens cached and goes first (1 new token); cold gets the
    # remaining budget of 11 tokens: all 9 of its own.
    assert step(s) == [("hot", 12, 1), ("cold", 0, 9)]
    assert hot.kv.cached_tokens == 12 and pages(hot) == [0, 1, 2, 3] and pages(cold) == [4, 5, 6]


def test_in_batch_dedup_waits_for_a_whole_shared_page_but_not_for_less():
    s = scheduler()
    shared = list(range(100, 120))  # 20 tokens: 5 whole pages
    a, b = request("a", shared + [1]), request("b", shared + [2])
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 16)]  # b would recompute a's pages: it waits a step
    assert step(s) == [("a", 16, 5), ("b", 16, 5)]  # b takes a's 4 published pages
    assert pages(b)[:4] == pages(a)[:4]
    s.kv.check(s.owners())
    # identical short prompts (no whole page to share) and n samples are admitted together
    t = scheduler()
    twins = [request(f"t{i}", [1, 2, 3]) for i in range(4)]
    for r in twins:
        t.add(r)
    assert step(t) == [(f"t{i}", 0, 3) for i in range(4)]


def test_eviction_comes_before_preemption_and_preemption_takes_the_newest():
    s = scheduler(num_pages=8, chunk=None)
    old = request("old", [9] * 8)
    s.add(old)
    assert step(s) == [("old", 0, 8)] and pages(old) == [0, 1]
    finish(s, old)  # pages 0, 1 stay cached, unlocked
    a, b = request("a", [1] * 11, max_new=16), request("b", [2] * 11, max_new=16)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 11), ("b", 0, 11)]
    assert (pages(a), pages(b), s.kv.pool.num_free()) == ([2, 3, 4], [5, 6, 7], 0)
    assert step(s) == [("a", 11, 1), ("b", 11, 1)]  # position 11: still the third page
    # position 12 opens a fourth page each: the pool is full, so the tree's unlocked
    # pages (old's, tail first) are evicted; nobody is preempted
    assert step(s) == [("a", 12, 1), ("b", 12, 1)]
    assert (pages(a), pages(b), s.preemptions) == ([2, 3, 4, 1], [5, 6, 7, 0], 0)
    for position in (13, 14, 15):
        assert step(s) == [("a", position, 1), ("b", position, 1)]
    # position 16 opens a fifth page: nothing unlocked is left, so a (admitted first)
    # preempts b (the newest): b's 16 computed tokens go into the tree, unlocked, b waits
    # at the front with nothing computed, and the eviction that follows takes b's tail
    assert step(s) == [("a", 16, 1)]
    assert s.preemptions == 1 and list(s.waiting) == [b] and b.kv.computed == 0 and len(b.kv.pages) == 0
    assert pages(a) == [2, 3, 4, 1, 0]
    s.kv.check(s.owners())
    finish(s, a)
    # b comes back and finds its first 3 pages (positions 0-11) still cached
    assert step(s)[0] == ("b", 12, 5) and b.kv.cached_tokens == 0 and pages(b)[:3] == [5, 6, 7]
    s.kv.check(s.owners())
