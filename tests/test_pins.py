"""Pins, TTLs, hints and sessions (radixkv.cache.pins): exact pages under the manager and
the scheduler without a model, then the Engine API on the embedded model. Every test
ends with the owners of every lock and page accounted for (``check``)."""

from __future__ import annotations

import time

import pytest

from radixkv.cache import KVCacheManager, PageAllocator, RadixCache, SeqKV
from radixkv.engine.request import Request
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.errors import FieldError, IntegrityError

PS = 2


def manager(num_pages=8, share=0.5) -> KVCacheManager:
    pool = PageAllocator(num_pages)
    return KVCacheManager(pool, RadixCache(pool, PS), PS, max_pinned_share=share)


def cache(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute ``tokens`` as a finished request would: its whole pages end in the tree."""
    seq = SeqKV()
    kv.admit(seq, tokens)
    assert kv.reserve(seq, len(tokens) - seq.computed)
    kv.computed(seq, len(tokens))
    kv.release(seq, tokens)


def ids(a) -> list[int]:
    return [int(x) for x in a]


def cached_pages(kv: KVCacheManager, tokens) -> list[int]:
    return ids(kv.tree.match_prefix(tokens, record_stats=False).pages)


# -- pins ----------------------------------------------------------------------------------------


def test_pinned_pages_are_never_evicted():
    kv = manager()
    a = [1, 2, 3, 4, 5, 6, 7]
    cache(kv, a)  # pages 0, 1, 2 hold tokens 1-6; token 7's partial page went free
    info = kv.pin(a, now=0.0)
    assert (info.kind, info.tokens, info.pages, info.expires_at) == ("pin", 6, 3, None)
    assert kv.tree.protected_pages == 3 and kv.tree.evictable_pages == 0 and kv.pinned.pinned_pages == 3
    b = SeqKV()
    kv.admit(b, [9] * 17)
    assert not kv.reserve(b, 16)  # 8 pages: the 5 free ones, and no unlocked page to evict
    assert kv.reserve(b, 10) and ids(b.pages) == [3, 4, 5, 6, 7]
    assert kv.flush() == 0 and cached_pages(kv, a) == [0, 1, 2]  # flush leaves pins alone
    kv.computed(b, 10)
    kv.check([b])
    kv.release(b, [9] * 17)  # b's 5 whole pages enter the tree, unlocked
    assert kv.tree.evict(8) == 5 and cached_pages(kv, a) == [0, 1, 2]
    assert kv.unpin(info.id) and not kv.unpin(info.id)
    assert kv.tree.evictable_pages == 3 and kv.pins() == []
    kv.check([])


def test_repinning_refreshes_one_entry_and_nested_pins_count_pages_once():
    kv = manager()
    cache(kv, [1, 2, 3, 4, 5, 6])
    first = kv.pin([1, 2, 3, 4, 5, 6], ttl=10.0, now=0.0)
    again = kv.pin([1, 2, 3, 4, 5, 6, 99], ttl=20.0, now=5.0)  # the same whole pages: the same entry
    assert again.id == first.id and (again.kind, again.expires_at) == ("ttl", 25.0)
    assert kv.pin([1, 2, 3, 4, 5, 6], ttl=1.0, now=6.0).expires_at == 25.0  # never shortened
    forever = kv.pin([1, 2, 3, 4, 5, 6], now=7.0)
    assert (forever.id, forever.kind, forever.expires_at) == (first.id, "pin", None)
    inner = kv.pin([1, 2, 3, 4], now=8.0)  # a prefix of it: its own entry, no new page
    assert inner.id != first.id and inner.pages == 2 and kv.pinned.pinned_pages == 3
    assert [p.id for p in kv.pins()] == [first.id, inner.id]
    kv.check([])
    with pytest.raises(FieldError, match="nothing to pin") as e:
        kv.pin([7, 7, 7])
    assert e.value.field == "pin"


def test_an_expired_ttl_page_becomes_evictable():
    kv = manager()
    cache(kv, [1, 2, 3, 4, 5, 6])
    info = kv.pin([1, 2, 3, 4, 5, 6], ttl=10.0, now=100.0)
    assert (info.kind, info.expires_at, info.expires_in(104.0)) == ("ttl", 110.0, 6.0)
    assert kv.expire(109.9) == 0 and kv.tree.evictable_pages == 0
    kv.pin([1, 2, 3, 4], ttl=30.0, now=101.0)  # a nested TTL that lives longer
    assert kv.expire(110.0) == 1 and [p.tokens for p in kv.pins()] == [4]
    assert kv.tree.evictable_pages == 1  # page 2 (tokens 5-6) only: pages 0, 1 stay under the longer TTL
    kv.check([])
    assert kv.tree.evict(3) == 1 and cached_pages(kv, [1, 2, 3, 4, 5, 6]) == [0, 1]
    assert kv.expire(131.0) == 1 and kv.tree.evictable_pages == 2 and kv.pinned.pinned_pages == 0
    kv.check([])


def test_pins_beyond_the_cap_are_refused_naming_field_and_limit():
    kv = manager(num_pages=8, share=0.5)  # cap: 4 pages
    cache(kv, [1, 2, 3, 4, 5, 6])
    cache(kv, [7, 8, 9, 10])
    kv.pin([1, 2, 3, 4, 5, 6])
    locks = [n.lock_ref for n in kv.tree.nodes()]
    with pytest.raises(FieldError) as e:
        kv.pin([7, 8, 9, 10])  # 3 + 2 > 4
    assert e.value.field == "pin"
    assert "would put 5 of the pool's 8 pages under pins" in str(e.value)
    assert "the cap is 4 pages (max_pinned_share 0.5)" in str(e.value)
    assert [n.lock_ref for n in kv.tree.nodes()] == locks and kv.pinned.pinned_pages == 3 and len(kv.pins()) == 1
    assert kv.pin([1, 2, 3, 4]).pages == 2  # inside the pinned prefix: nothing new
    # a request's claim counts until it pins: one more page fits, a second does not
    claim = kv.claim_pin([7, 8, 9], field="cache_control")
    assert kv.claim_pin([7, 8, 9]) == claim  # one prefix's claims count once
    with pytest.raises(FieldError, match="1 claimed by requests in flight") as e:
        kv.claim_pin([11, 12, 13], field="cache_control")
    assert e.value.field == "cache_control"
    assert kv.claim_pin([5]) is None  # shorter than a page: nothing to claim
    kv.release_claim(claim)
    kv.pin([7, 8, 9], claim=claim)  # the second claim's pin: 4 pages, at the cap
    assert kv.pinned.pinned_pages == 4 and kv.pinned.pending == {}
    kv.check([])


def test_check_finds_a_lock_without_an_owner():
    kv = manager()
    cache(kv, [1, 2, 3, 4])
    info = kv.pin([1, 2, 3, 4])
    kv.check([])
    kv.tree.lock(kv.pinned.entries[info.id].node)  # nobody owns this second lock
    with pytest.raises(IntegrityError, match="2 locks but its owners"):
        kv.check([])


# -- hints and sessions -----------------------------------------------------------------------


def test_hints_are_used_up_by_admissions_that_continue_them():
    kv = manager(num_pages=16)
    cache(kv, [1, 2, 3, 4, 5, 6])
    hint = kv.hint([1, 2, 3, 4, 5, 6], ttl=30.0, now=0.0, uses=2)
    assert (hint.kind, hint.uses, hint.pages, hint.expires_at) == ("hint", 2, 3, 30.0)
    assert kv.hint([1, 2, 3, 4, 5, 6], ttl=30.0, now=1.0).uses == 3  # the same prefix: more uses, one entry
    other = SeqKV()
    kv.admit(other, [1, 2, 3, 4, 8, 8])  # reaches 2 of its 3 pages: no use
    branches = [SeqKV() for _ in range(3)]
    for i, b in enumerate(branches):
        kv.admit(b, [1, 2, 3, 4, 5, 6, 10 + i, 0])
        kv.use_hints(b)
    assert kv.pins() == [] and kv.pinned.pinned_pages == 0
    kv.check([other, *branches])
    for s in (other, *branches):
        kv.release(s, [])
    assert kv.hint([50, 51, 52]) is None  # nothing cached: no entry
    kv.check([])


def test_a_session_entry_is_replaced_by_the_sessions_next_request_and_ended():
    kv = manager(num_pages=16)
    cache(kv, [1, 2, 3, 4, 5, 6, 7])
    s1 = kv.hint([1, 2, 3, 4, 5, 6, 7], ttl=300.0, now=0.0, session="chat", kind="session")
    assert (s1.kind, s1.tokens, s1.session, s1.uses) == ("session", 6, "chat", None)
    turn = SeqKV()
    kv.admit(turn, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.use_hints(turn, "chat")  # the session's next request: its own lock protects the prefix now
    assert kv.pins() == []
    assert kv.reserve(turn, 3)
    kv.computed(turn, 9)
    kv.release(turn, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    s2 = kv.hint([1, 2, 3, 4], ttl=300.0, now=1.0, session="chat", kind="session")
    s2 = kv.hint([1, 2, 3, 4, 5, 6, 7, 8, 9], ttl=300.0, now=1.0, session="chat", kind="session")  # replaces it
    assert [p.id for p in kv.pins()] == [s2.id] and kv.pinned.session("chat").id == s2.id
    kv.check([])
    kv.hint([1, 2], ttl=300.0, now=1.0, session="chat")  # a hint the session owns
    kv.hint([1, 2, 3, 4], ttl=300.0, now=1.0, session="other")
    assert s2.tokens == 8 and s2.id != s1.id
    assert kv.end_session("chat") == 2 and [p.session for p in kv.pins()] == ["other"]
    assert kv.flush() == 4 and kv.pins() == []  # flush gives hints up, then empties the tree
    kv.check([])


def test_drop_hint_gives_up_the_youngest_programs_advice_first():
    kv = manager(num_pages=16)
    for t in ([1, 2], [3, 4], [5, 6], [7, 8]):
        cache(kv, t + [0])
    a = kv.hint([1, 2], now=0.0, session="a", kind="session")  # program a: first seen
    b_hint = kv.hint([3, 4], now=1.0, session="b/0")  # program b: a fork's hint, then its session
    b = kv.hint([5, 6], now=2.0, session="b", kind="session")
    loose = kv.hint([7, 8], now=3.0)  # no session: ranks as the youngest
    assert kv.pinned.birth("a") < kv.pinned.birth("b/1") == kv.pinned.birth("b")
    order = []
    while kv.drop_hint(younger_than=kv.pinned.birth("a")):  # what program a's requests may take
        (gone,) = {p.id for p in (a, b_hint, b, loose)} - {p.id for p in kv.pins()} - set(order)
        order.append(gone)
    assert order == [loose.id, b.id, b_hint.id] and [p.id for p in kv.pins()] == [a.id]
    assert kv.drop_hint() and not kv.drop_hint()
    kv.check([])


# -- the scheduler: hints against admissions, growth, and an idle engine --------------------------

SPS = 4
NEXT = 999


def scheduler(num_pages: int, hint_hold: float = 0.0) -> Scheduler:
    pool = PageAllocator(num_pages)
    return Scheduler(KVCacheManager(pool, RadixCache(pool, SPS), SPS), 64, 8, None, hint_hold)


def request(name: str, prompt: list[int], max_new: int = 4) -> Request:
    return Request(rid=name, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new), sampler=None,
                   detok=None, kv=SeqKV())  # fmt: skip


def step(s: Scheduler) -> list[str]:
    plan = s.schedule()
    s.advance(plan)
    for p in plan:
        if p.samples:
            p.req.tokens.append(NEXT)
    s.kv.check(s.owners())
    return [p.req.rid for p in plan]


FORK = list(range(100, 112))  # 3 pages: the fork point every branch continues


def fork_under_pressure(hinted: bool) -> tuple[Scheduler, Request, Request]:
    """A prefix request computes FORK; a long request runs on; a big newcomer arrives
    before the branches, wanting the fork's pages."""
    s = scheduler(num_pages=12)
    prefix = request("prefix", FORK, max_new=1)
    runner = request("runner", [1, 2], max_new=20)  # decodes within its first page throughout
    s.add(prefix)
    s.add(runner)
    assert step(s) == ["prefix", "runner"]
    s.remove(prefix)  # finished: FORK's 3 pages are cached, unlocked
    if hinted:
        assert s.kv.hint(FORK, uses=2).pages == 3
    big = request("big", list(range(200, 243)))  # 43 tokens: 11 pages, 8 of them free
    s.add(big)
    branches = [request(f"b{k}", FORK + [k, k]) for k in range(2)]
    step(s)  # runner decodes; big is admitted if the fork's pages can go
    for b in branches:
        s.add(b)
    step(s)
    return s, big, branches


def test_hints_protect_a_forks_prefix_under_a_pool_that_would_otherwise_evict_it():
    s, big, branches = fork_under_pressure(hinted=False)
    assert big in s.running and s.kv.tree.evicted_pages == 3  # LRU: the fork's pages went to the newcomer
    assert all(b in s.waiting for b in branches) and branches[0].kv.cached_tokens == 0  # no room, nothing cached
    s, big, branches = fork_under_pressure(hinted=True)
    assert big in s.waiting and s.kv.tree.evicted_pages == 0  # the newcomer waits while the runner runs
    assert [b.kv.cached_tokens for b in branches] == [12, 12]  # both branches find the fork point cached
    assert [ids(b.kv.pages)[:3] for b in branches] == [[0, 1, 2], [0, 1, 2]]
    assert s.kv.pins() == []  # two uses: the hint is used up


def test_hints_give_way_to_growth_before_preemption_and_to_admissions_when_idle():
    s = scheduler(num_pages=6)
    a = request("a", [1, 2, 3, 4, 5, 6, 7], max_new=1)
    s.add(a)
    step(s)
    s.remove(a)  # 1 page cached ([1..4]); the partial one went free
    s.kv.hint([1, 2, 3, 4, 5, 6, 7], uses=1)
    runner = request("runner", [9] * 15, max_new=8)  # 4 pages, then a 5th and a 6th as it decodes
    s.add(runner)
    assert step(s) == ["runner"]
    while runner.kv.computed < 20:
        step(s)
    assert len(s.kv.pins()) == 1 and s.kv.pool.num_free() == 0
    step(s)  # token 21 needs a 6th page: only the hint's is left
    assert s.preemptions == 0 and s.kv.pins() == []  # the hint went before anyone was preempted
    s.remove(runner)
    s.kv.check(s.owners())
    # nothing runs: a hint that would keep a waiting request out gives way
    s.kv.hint([9] * 12, uses=1)
    late = request("late", [8] * 22)  # 6 pages: every page of the pool
    s.add(late)
    assert step(s) == ["late"] and s.kv.pins() == []


def test_an_idle_engine_holds_a_request_only_advice_keeps_out_for_hint_hold():
    s = scheduler(num_pages=6, hint_hold=0.3)
    a = request("a", list(range(1, 14)), max_new=1)
    s.add(a)
    step(s)
    s.remove(a)
    s.kv.hint(list(range(1, 14)), session="program", kind="session")  # 3 pages: the program comes back soon
    late = request("late", [8] * 22)  # 6 pages: the whole pool
    s.add(late)
    assert step(s) == [] and s.holding and late in s.waiting and len(s.kv.pins()) == 1
    time.sleep(0.35)
    assert step(s) == ["late"] and not s.holding and s.kv.pins() == []


def test_growth_takes_only_what_younger_programs_hold_unless_it_ranks_first():
    s = scheduler(num_pages=16)
    paused = request("paused", [1, 2, 3, 4, 5], max_new=1)
    paused.session_id = "old/0"  # a branch of program "old", paused (a tool call)
    s.add(paused)
    step(s)
    s.remove(paused)
    entry = s.kv.hint([1, 2, 3, 4, 5, NEXT], session="old/0", kind="session")
    old, young = request("old", [6] * 6, max_new=9), request("young", [7] * 6, max_new=9)
    old.session_id, young.session_id = "old/1", "young"
    s.add(old)
    s.add(young)
    plan = []
    assert step(s) == ["old", "young"] and old.rank < young.rank
    assert not s._make_room(young, plan)  # only the older program's advice and request: young waits
    assert [p.id for p in s.kv.pins()] == [entry.id] and young in s.running
    assert s._make_room(old, plan) and young in s.waiting and s.preemptions == 1  # old takes from younger ones
    assert [p.id for p in s.kv.pins()] == [entry.id]
    assert s._make_room(old, plan) and s.kv.pins() == []  # alone, it ranks first: any advice gives way
    assert not s._make_room(old, plan)
    s.kv.check(s.owners())


# -- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from radixkv import Engine

    with Engine(attention_backend="torch", kv_cache_tokens=1024, max_pinned_share=0.25, session_ttl=60.0) as e:
        yield e


def words(n: int, seed: int = 0) -> str:
    vocab = ["radix", "tree", "page", "cache", "token", "prefix", "engine", "pool", "leaf", "node"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))


def test_engine_pin_unpin_and_the_cap(engine):
    from radixkv.engine.request import CacheControl

    ids_a = engine.encode(words(100))[:100]
    info = engine.pin(ids_a)
    assert (info.kind, info.tokens, info.pages) == ("pin", 96, 6)
    stats = engine.stats()["pins"]
    assert (stats["pinned_pages"], stats["max_pinned_pages"]) == (6, 16)
    assert engine.pins() == [{"id": info.id, "kind": "pin", "tokens": 96, "pages": 6, "expires_in": None}]
    with pytest.raises(FieldError) as e:
        engine.pin(engine.encode(words(200, seed=3))[:180])  # 11 more pages: 17 > 16
    assert e.value.field == "pin" and "the cap is 16 pages (max_pinned_share 0.25)" in str(e.value)
    assert engine.stats()["pins"]["pinned_pages"] == 6
    out = engine.generate(ids_a + [5, 6], SamplingParams(max_new_tokens=2, temperature=0.0),
                          cache_control=CacheControl(ttl=60.0, upto=40))  # fmt: skip
    assert out.cached_tokens == 96 and (out.pin.kind, out.pin.tokens) == ("ttl", 32)
    assert engine.unpin(info.id) and not engine.unpin(info.id) and engine.unpin(out.pin.id)
    with pytest.raises(FieldError) as e:
        engine.pin([1, 2, 3])
    assert e.value.field == "prompt"
    assert engine.pins() == []


def test_engine_ttl_expires_and_sessions_replace_their_entry(engine):
    from radixkv.engine.request import CacheControl

    ids_a = engine.encode(words(50, seed=1))[:50]
    engine.generate(ids_a, SamplingParams(max_new_tokens=1), cache_control=CacheControl(ttl=0.2))
    assert [p["kind"] for p in engine.pins()] == ["ttl"]
    deadline = time.monotonic() + 5
    while engine.pins() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.pins() == []
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    first = engine.generate(ids_a, params, session_id="s")
    (entry,) = engine.pins()
    assert (entry["kind"], entry["session"], entry["tokens"]) == ("session", "s", 48)  # 50 + 3 computed: 3 pages
    follow = ids_a + first.token_ids + [11, 12]
    second = engine.generate(follow, params, session_id="s")
    assert second.cached_tokens == 48
    (entry2,) = engine.pins()
    assert entry2["id"] != entry["id"] and entry2["tokens"] == 48  # 58 + 3 computed: 3 whole pages
    hint = engine.hint(follow, uses=1, session_id="s")
    assert (hint.kind, hint.tokens, hint.uses) == ("hint", 48, 1)
    assert engine.end_session("s") == 2 and engine.pins() == []
    with pytest.raises(FieldError) as e:
        engine.generate(ids_a, params, session_id="")
    assert e.value.field == "session_id"
