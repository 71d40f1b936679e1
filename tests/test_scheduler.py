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
    cold, hot = request("cold", [7] * 9), request("hot", [5] * 12 + [6, 6])
    s.add(cold)
    s.add(hot)
    # hot finds 12 of its tokens cached and goes first (2 new tokens); cold gets the
    # remaining budget of 10 tokens: all 9 of its own.
    assert step(s) == [("hot", 12, 2), ("cold", 0, 9)]
    assert hot.kv.cached_tokens == 12 and pages(hot) == [0, 1, 2, 3] and pages(cold) == [4, 5, 6]


def test_in_batch_dedup_waits_for_a_whole_shared_page_but_not_for_less():
    s = scheduler()
    shared = list(range(100, 120))  # 20 tokens: 5 whole pages
    a, b = request("a", shared + [1, 1]), request("b", shared + [2, 2])
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 16)]  # b would recompute a's pages: it waits
    assert step(s) == [("a", 16, 6)]  # and still waits: a's chunk computes b's fifth page
    assert step(s) == [("a", 22, 1), ("b", 20, 2)]  # b takes all 5 shared pages, computes its own tokens
    assert pages(b)[:5] == pages(a)[:5]
    s.kv.check(s.owners())
    # identical short prompts (no whole page to share) and n samples are admitted together
    t = scheduler()
    twins = [request(f"t{i}", [1, 2, 3]) for i in range(4)]
    for r in twins:
        t.add(r)
    assert step(t) == [(f"t{i}", 0, 3) for i in range(4)]


def test_a_prefix_prefilled_in_chunks_is_computed_once_for_every_request_that_shares_it():
    # few-shot: one long shared prefix, questions arriving together; the prefix takes 3
    # chunks, and nobody computes a page of it that another request is computing
    s = scheduler(num_pages=64, max_batch_tokens=40, chunk=16)
    prefix = list(range(100, 140))  # 40 tokens: 10 whole pages, 3 chunks
    qs = [request(f"q{i}", prefix + [i, i + 50, i + 60]) for i in range(3)]
    for q in qs:
        s.add(q)
    assert step(s) == [("q0", 0, 16)]
    assert step(s) == [("q0", 16, 16)]
    assert step(s) == [("q0", 32, 11)]
    # the prefix's 10 pages are published: the others take them and compute only their own 3 tokens
    assert step(s) == [("q0", 43, 1), ("q1", 40, 3), ("q2", 40, 3)]
    assert [q.kv.cached_tokens for q in qs] == [0, 40, 40]
    assert pages(qs[1])[:10] == pages(qs[2])[:10] == pages(qs[0])[:10]
    assert s.kv.tree.cached_pages == 10
    s.kv.check(s.owners())
    # a request that shares less than a whole page with the one prefilling does not wait
    t = scheduler(num_pages=64, max_batch_tokens=40, chunk=16)
    long, other = request("long", list(range(100, 140))), request("other", [100, 101, 102] + list(range(7, 27)))
    t.add(long)
    t.add(other)
    assert step(t) == [("long", 0, 16), ("other", 0, 16)]
    # prompt logprobs from position 0: nothing cached is taken, so nothing to wait for
    u = scheduler(num_pages=64, max_batch_tokens=40, chunk=16)
    a, b = request("a", prefix + [1]), request("b", prefix + [2], prompt_logprobs_from=0)
    u.add(a)
    step(u)
    u.add(b)
    assert step(u) == [("a", 16, 16), ("b", 0, 16)]


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
