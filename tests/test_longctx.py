"""Long-context eviction: policies choose exactly the pages they should, sequences
compress at their points, views share compressed prefixes (exact page ids), and with
the real model a cached view answers exactly as the same compression run alone."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import Engine, SamplingParams
from radixkv.cache import PageAllocator, RadixCache
from radixkv.cache.compress import (
    OBSERVE_TOKENS, POLICIES, SINK_TOKENS, ViewNamespace, keydiff_scores, resolve_policy, select_pages,
)  # fmt: skip
from radixkv.cache.manager import KVCacheManager, SeqKV
from radixkv.errors import FieldError

PS = 2


def spec(name, budget, compress_at=None, page_size=PS, prompt_len=1000):
    return resolve_policy(name, budget, compress_at, page_size, prompt_len)


def ids(a) -> list[int]:
    return [int(x) for x in a]


# ---------------------------------------------------------------- selection


def test_window_keeps_the_last_pages_and_streaming_the_sinks_too():
    s = spec("window", 8, page_size=4)
    assert ids(select_pages(s, 10, 2, None)) == [8, 9]
    s = spec("streaming", 8, page_size=4)
    sinks = -(-SINK_TOKENS // 4)
    assert ids(select_pages(s, 10, 3, None)) == list(range(sinks)) + list(range(10 - (3 - sinks), 10))
    assert ids(select_pages(s, 3, 5, None)) == [0, 1, 2]  # a budget past the table keeps it all


def test_scored_policies_keep_the_observation_window_then_the_top_scores():
    ps = 16
    window = -(-OBSERVE_TOKENS // ps)
    scores = np.zeros(20)
    scores[3], scores[7] = 5.0, 2.0  # planted: page 3 scores highest, then page 7
    for name in ("snapkv", "keydiff"):
        kept = select_pages(spec(name, 0.5, 320, page_size=ps, prompt_len=400), 20, window + 2, scores)
        assert ids(kept) == [3, 7] + list(range(20 - window, 20))
    h2o = spec("h2o", 0.5, 320, page_size=ps, prompt_len=400)  # half the budget is the recent window
    # a recent half (6 pages), then the planted pages, then ties by position
    assert ids(select_pages(h2o, 20, 12, scores)) == [0, 1, 2, 3, 4, 7] + list(range(14, 20))


def test_keydiff_scores_the_key_least_like_the_mean_highest():
    rng = np.random.default_rng(0)
    base = rng.standard_normal(8)
    keys = base + 0.05 * rng.standard_normal((2, 32, 3, 8))  # layers, tokens, heads, dim
    keys[:, 13] = -base  # token 13 (page 3 of pages of 4) points away from the mean
    scores = keydiff_scores(lambda layer: keys[layer], 2, 4)
    assert int(np.argmax(scores)) == 3 and len(scores) == 8


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(kv_policy="lru", kv_budget=10), "kv_policy"),
        (dict(kv_policy="window"), "kv_budget"),
        (dict(kv_policy="window", kv_budget=0), "kv_budget"),
        (dict(kv_policy="window", kv_budget=1.5), "kv_budget"),
        (dict(kv_policy="window", kv_budget="half"), "kv_budget"),
        (dict(kv_policy="window", kv_budget=True), "kv_budget"),
        (dict(kv_budget=100), "kv_budget"),
        (dict(kv_policy="snapkv", kv_budget=100, kv_compress_at=0), "kv_compress_at"),
        (dict(kv_compress_at=5), "kv_compress_at"),
        (dict(kv_rerotate=True), "kv_rerotate"),
        (dict(kv_policy="streaming", kv_budget=64, kv_rerotate="yes"), "kv_rerotate"),
        (dict(kv_policy="streaming", kv_budget=0.5, kv_rerotate=True), "kv_rerotate"),
        (dict(kv_policy="streaming", kv_budget=64, kv_compress_at=128, kv_rerotate=True), "kv_rerotate"),
    ],
)
def test_bad_policies_and_budgets_name_the_field(kw, field):
    with pytest.raises(FieldError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_a_ratio_needs_a_context_of_two_pages():
    with pytest.raises(FieldError, match="kv_budget"):
        resolve_policy("snapkv", 0.5, None, 16, 20)


def test_rerotate_positions_must_fit_the_context():
    # budget 448 + interval 48 (448 // 8, whole pages): positions up to 495
    assert resolve_policy("streaming", 448, None, 16, 10, True, 496).max_position() == 495
    with pytest.raises(FieldError, match="kv_budget") as e:
        resolve_policy("streaming", 480, None, 16, 10, True, 512)  # 480 + 48 - 1 = 527
    assert "512" in str(e.value)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_rerotate_pages_moves_keys_to_their_new_positions(kv_dtype):
    """Keys stored at position p, moved back s positions, equal the same keys rotated
    at p - s (values untouched), into a copy or in place."""
    import torch

    from radixkv.cache.pool import KVPool, PoolConfig
    from radixkv.model.llama import _apply_rope, rerotate_pages

    ps, d = 4, 8
    pool = KVPool(PoolConfig(num_layers=2, num_kv_heads=2, head_dim=d, page_size=ps, kv_dtype=kv_dtype, num_pages=8))
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    raw = torch.randn(3 * ps, 2, d, generator=torch.Generator().manual_seed(0))
    v = torch.randn(3 * ps, 2, d, generator=torch.Generator().manual_seed(1))

    def rope(x, positions):
        f = torch.tensor(positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([f, f], -1)[:, None, :]
        return _apply_rope(x, emb.cos(), emb.sin())

    at = [p for page in (5, 9, 14) for p in range(page * ps, page * ps + ps)]  # pages at positions 20, 36, 56
    src = pool.alloc(3)
    slots = pool.slots(src, 0, 3 * ps)
    for layer in range(2):
        pool.store_kv(layer, rope(raw, at), v, slots)
    shifts = np.array([20, 32, 48])  # to positions 0, 4, 8
    dst = np.array([pool.alloc(1)[0], src[1], src[2]], dtype=np.int32)  # one copy, two in place
    rerotate_pages(pool, inv, src, dst, shifts)
    want = rope(raw, list(range(3 * ps)))
    tol = 1e-5 if kv_dtype == "float32" else 0.05
    for layer in range(2):
        k, got_v = pool.read_kv(layer, pool.slots(dst, 0, 3 * ps))
        assert torch.allclose(k.float(), want, atol=tol), (k.float() - want).abs().max()
        assert torch.allclose(got_v.float(), v, atol=tol)
    k0, _ = pool.read_kv(0, pool.slots(src[:1], 0, ps))  # the copy's source keeps its keys
    assert torch.allclose(k0.float(), rope(raw[:ps], at[:ps]), atol=tol)


# ---------------------------------------------------------------- the manager (exact page ids)


def run(kv: KVCacheManager, seq: SeqKV, tokens, upto: int, chunk: int = 64) -> list[int]:
    """The scheduler's part: chunks that end at points, compress there. Returns the
    points passed."""
    points = []
    while seq.computed < upto:
        count = min(chunk, upto - seq.computed, kv.until_point(seq) or chunk)
        assert kv.reserve(seq, count)
        kv.computed(seq, seq.computed + count)
        if count > 1:
            kv.commit(seq, tokens)
        if kv.at_point(seq):
            points.append(seq.computed)
            kv.compress(seq, tokens)
    return points


def manager(num_pages=32):
    pool = PageAllocator(num_pages)
    return KVCacheManager(pool, RadixCache(pool, PS), PS)


def test_decode_time_compresses_every_interval_and_a_view_serves_the_next_request():
    kv = manager()
    prompt = list(range(100, 111))  # 11 tokens
    a = SeqKV(policy=spec("window", 4, prompt_len=len(prompt)))
    assert a.policy.interval == PS and a.policy.kept_pages() == 2
    assert kv.admit(a, prompt) == 0
    # budget 4 (2 pages) + interval 2: points at 6, 8, 10; each keeps the last 2 pages
    assert run(kv, a, prompt, len(prompt)) == [6, 8, 10]
    assert ids(a.pages) == [3, 4, 5] and (a.dropped, a.kv_len, a.computed) == (6, 5, 11)
    assert a.view is not None and a.view.point == 10 and ids(a.view.pages) == [3, 4]
    kv.check([a])
    # the plain namespace holds only what was computed on the full context: tokens 0-5
    plain = kv.tree.match_prefix(prompt, record_stats=False)
    assert plain.num_tokens == 6 and ids(plain.pages) == [0, 1, 2]
    kv.release(a, prompt + [7])
    kv.check([])
    # the same policy on a longer prompt: the deepest view (point 10; a's page 5 was partial)
    b = SeqKV(policy=spec("window", 4, prompt_len=14))
    longer = prompt + [7, 8, 9]
    assert kv.admit(b, longer) == 10 and b.cached_tokens == 10
    assert ids(b.pages) == [3, 4] and b.dropped == 6 and b.view.point == 10
    at10 = b.view
    assert run(kv, b, longer, 12) == [12]  # tokens 10, 11 on the view: page 5, then the next point
    assert ids(b.pages) == [4, 5] and b.view.point == 12 and not at10.lock_ref
    assert ids(kv.tree.match_prefix(longer[10:12], at10.namespace, record_stats=False).pages) == [5]
    kv.release(b, longer)
    b = SeqKV(policy=spec("window", 4, prompt_len=14))
    assert kv.admit(b, longer) == 12 and ids(b.pages) == [4, 5] and b.view.point == 12
    # a plain request never reads pages computed on a view, nor another policy a view
    c, d = SeqKV(), SeqKV(policy=spec("streaming", 4, prompt_len=14))
    assert kv.admit(c, longer) == 6 and ids(c.pages) == [0, 1, 2]
    assert kv.admit(d, longer) == 4 and ids(d.pages) == [0, 1]  # exact pages, up to a page before its point
    kv.check([b, c, d])
    for s in (b, c, d):
        kv.release(s, longer)
    kv.check([])
    kv.flush()
    assert kv.pool.num_free() == 32 and len(kv.views) == 0


def test_prefill_time_compresses_once_and_the_question_grows_on_the_view():
    kv = manager()
    prompt = list(range(100, 112))  # 12 tokens: a context of 8, then a question
    a = SeqKV(policy=spec("window", 4, compress_at=8, prompt_len=len(prompt)))
    assert run(kv, a, prompt, len(prompt)) == [8]  # once: nothing evicts after the point
    assert ids(a.pages) == [2, 3, 4, 5] and a.dropped == 4 and kv.next_point(a) is None
    kv.release(a, prompt)
    b = SeqKV(policy=spec("window", 4, compress_at=8, prompt_len=13))
    assert kv.admit(b, prompt + [5]) == 12 and ids(b.pages) == [2, 3, 4, 5]  # the view, then its namespace
    c = SeqKV(policy=spec("window", 4, compress_at=10, prompt_len=13))  # another point: another state
    assert kv.admit(c, prompt + [5]) == 8 and ids(c.pages) == [0, 1, 2, 3] and c.view is None
    kv.check([b, c])
    for s in (b, c):
        kv.release(s, prompt + [5])
    kv.check([])


def rerotating(num_pages: int, tree: bool = True):
    """A manager whose rerotate hook records (sources, destinations, shifts)."""
    pool, calls = PageAllocator(num_pages), []
    hook = lambda src, dst, shifts: calls.append((ids(src), ids(dst), ids(shifts)))  # noqa: E731
    return KVCacheManager(pool, RadixCache(pool, PS) if tree else None, PS, rerotate=hook), calls


def test_rerotate_copies_kept_pages_the_tree_shares_and_moves_its_own_in_place():
    prompt = list(range(100, 113))
    policy = resolve_policy("streaming", 6, None, PS, len(prompt), True)  # sinks: 2 pages, then the last 1
    assert (policy.kept_pages(), policy.interval) == (3, 2)
    kv, calls = rerotating(32)
    a = SeqKV(policy=policy)
    kv.admit(a, prompt)
    assert run(kv, a, prompt, 9) == [8]
    # table [0 1 2 3] keeps [0 1 3]; page 3 moves back one page; the tree keeps its original
    (src, dst, shifts), = calls
    assert src == [3] and dst != [3] and shifts == [PS]
    assert ids(a.view.pages) == [0, 1, *dst] and a.position_shift == a.dropped == 2
    assert kv.tree.match_prefix(prompt[:8], record_stats=False).num_tokens == 8  # the exact pages stay cached
    kv.check([a])
    kv.release(a, prompt)
    kv.check([])
    # a pool with no room for a copy: eviction leaves page 3 to the sequence, rotated in place
    kv, calls = rerotating(4)
    b = SeqKV(policy=policy)
    kv.admit(b, prompt)
    assert run(kv, b, prompt, 9) == [8]
    assert calls == [([3], [3], [PS])] and ids(b.view.pages) == [0, 1, 3]
    kv.check([b])
    # without a prefix cache the sequence owns every page: in place too
    kv, calls = rerotating(8, tree=False)
    c = SeqKV(policy=policy)
    kv.admit(c, prompt)
    assert run(kv, c, prompt, 9) == [8]
    assert calls == [([3], [3], [PS])] and ids(c.pages[:3]) == [0, 1, 3]
    kv.check([c])


def test_views_are_evicted_least_recently_used_with_their_namespace():
    kv = manager(num_pages=12)
    for base in (100, 200):
        prompt = list(range(base, base + 9))
        s = SeqKV(policy=spec("window", 4, compress_at=8, prompt_len=9))
        kv.admit(s, prompt)
        run(kv, s, prompt, 9)
        kv.release(s, prompt)
    kv.check([])
    assert len(kv.views) == 2
    held = kv.pool.num_used()
    # take the whole pool: tree leaves go first, then the least recently used view
    hog = SeqKV()
    assert kv.reserve(hog, 12 * PS)
    assert len(kv.views) == 0 and kv.pool.num_free() == 0 and held > 0
    kv.check([hog])
    kv.release(hog, list(range(24)))


def test_h2o_and_snapkv_keep_the_pages_their_scores_pick():
    pool = PageAllocator(64)
    kv = KVCacheManager(pool, RadixCache(pool, 16), 16)
    prompt = list(range(600))
    for name in ("h2o", "snapkv"):
        s = SeqKV(policy=spec(name, 0.25, compress_at=512, page_size=16, prompt_len=600))
        kv.admit(s, prompt)
        assert kv.reserve(s, 512)
        kv.computed(s, 512)
        mass = np.zeros(512)
        mass[165] = 9.0  # page 10 of 32 drew the attention
        kv.observe(s, mass)
        kv.commit(s, prompt)
        assert kv.at_point(s)
        table = ids(s.pages)
        assert kv.compress(s, prompt) == 24
        # 8 pages: the last 4 (observation window; h2o's recent half), page 10, then ties by position
        assert ids(s.pages) == [table[i] for i in (0, 1, 2, 10, 28, 29, 30, 31)]
        assert s.dropped == 512 - 8 * 16 and s.kv_len == 8 * 16
        kv.release(s, prompt)
        kv.check([])
        kv.flush()


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def engine():
    with Engine(kv_cache_tokens=4096, page_size=16) as e:
        yield e


@pytest.fixture(scope="module")
def alone():
    """Standalone runs: no prefix cache, so nothing is shared."""
    with Engine(kv_cache_tokens=4096, page_size=16, enable_prefix_cache=False) as e:
        yield e


DOC = open("/usr/share/common-licenses/GPL-3").read()[:2400]
QUESTIONS = ["\n\nQuestion: What is this licence called?\nAnswer:", "\n\nQuestion: Who may copy it?\nAnswer:"]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_second_question_reuses_the_view_and_answers_as_the_compression_alone(engine, alone, policy):
    doc = engine.encode(DOC)
    prompts = [doc + engine.encode(q, add_special_tokens=False) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=6, temperature=0, kv_policy=policy, kv_budget=0.25,
                            kv_compress_at=len(doc))  # fmt: skip
    engine.flush_cache()
    first = engine.generate([prompts[0]], params)[0]
    second = engine.generate([prompts[1]], params)[0]
    point = len(doc) // 16 * 16
    # the view at the document's end, then the page the questions share in its namespace
    assert point <= second.cached_tokens <= point + 16
    assert engine.stats()["views"]["hits"] >= 1
    for got, prompt in zip((first, second), prompts):
        assert got.token_ids == alone.generate([prompt], params)[0].token_ids
    if policy != "window":
        return
    full = SamplingParams(max_new_tokens=6, temperature=0)  # the plain namespace holds only exact pages
    plain = engine.generate([prompts[1]], full)[0]
    assert plain.cached_tokens <= point and plain.token_ids == alone.generate([prompts[1]], full)[0].token_ids


def test_decode_time_eviction_keeps_the_table_bounded_and_matches_alone(engine, alone):
    prompt = engine.encode(DOC[:400])
    params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True, kv_policy="streaming", kv_budget=48)
    engine.flush_cache()
    got = engine.generate([prompt], params)[0]
    assert got.token_ids == alone.generate([prompt], params)[0].token_ids
    assert len(got.token_ids) == 48
    state = max(engine.loop.kv.views, key=lambda v: v.point)
    assert len(state.pages) == 3 and state.point > len(prompt)  # evicted while decoding, 3 pages kept
    stats = engine.stats()
    assert stats["views"]["created"] >= 3


def test_a_chat_under_streaming_runs_in_bounded_memory_and_hits_every_turn(engine, alone):
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, kv_policy="streaming", kv_budget=64)
    engine.flush_cache()
    ids = engine.encode("A conversation about licences.\n")
    for turn in range(4):
        ids = ids + engine.encode(f"\nUser: {DOC[turn * 150 : turn * 150 + 150]}\nAssistant:", add_special_tokens=False)
        got = engine.generate([ids], params)[0]
        assert got.token_ids == alone.generate([ids], params)[0].token_ids
        if turn:
            # all but the new message, the page before the next point and the partial page
            assert got.cached_tokens >= previous - 2 * 16, (turn, got.cached_tokens, previous)
        ids = ids + list(got.token_ids)
        previous = len(ids)
    state = max(engine.loop.kv.views, key=lambda v: v.point)
    assert len(state.pages) == 64 // 16 and state.point > 150  # 4 pages hold a 200-token chat's state


@pytest.fixture(scope="module")
def short_context():
    """An engine whose context is 512 tokens, so a sequence can run past it quickly."""
    with Engine(kv_cache_tokens=2048, page_size=16, context_length=512) as e:
        yield e


def test_rerotate_runs_past_the_context_and_a_uniform_shift_changes_nothing(short_context):
    e = short_context
    long = e.encode(open("/usr/share/common-licenses/GPL-3").read()[:4000])[:560]
    with pytest.raises(ValueError, match="context is 512"):
        e.generate([long], SamplingParams(max_new_tokens=4, kv_policy="streaming", kv_budget=256))
    with pytest.raises(FieldError, match="kv_budget"):  # its positions would pass the context
        e.generate([long[:100]], SamplingParams(max_new_tokens=4, kv_policy="streaming", kv_budget=480, kv_rerotate=True))
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, kv_policy="streaming", kv_budget=256,
                            kv_rerotate=True)  # fmt: skip
    first = e.generate([long], params)[0]
    assert first.error is None and len(first.token_ids) == 16  # 576 tokens at positions below 288
    again = e.generate([long], params)[0]
    assert again.token_ids == first.token_ids and again.cached_tokens >= 512  # its views serve it
    # window keeps a contiguous run of pages: moving all of them back by the same amount
    # keeps every query-key distance, so the output is the same as at the original positions
    short = long[:320]
    window = dict(max_new_tokens=16, temperature=0, ignore_eos=True, kv_policy="window", kv_budget=96)
    plain = e.generate([short], SamplingParams(**window))[0]
    moved = e.generate([short], SamplingParams(**window, kv_rerotate=True))[0]
    assert moved.token_ids == plain.token_ids
    e.check_integrity()
