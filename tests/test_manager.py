"""KVCacheManager: the sequence-level KV lifecycle (exact page ids), and the simulator
replaying exactly what the engine does (an Engine on a stub model, same trace)."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.cache import PageAllocator, RadixCache, sim
from radixkv.cache.manager import KVCacheManager, SeqKV
from radixkv.cache.traces import TraceRequest
from radixkv.errors import IntegrityError
from radixkv.kernels.pages import NumpyPages

PS = 2


def manager(num_pages=16, tree=True, loops=None):
    pool = PageAllocator(num_pages, loops)
    return KVCacheManager(pool, RadixCache(pool, PS) if tree else None, PS)


def run(kv: KVCacheManager, seq: SeqKV, tokens, upto: int, chunk: int) -> None:
    """What the scheduler does for a prefill: reserve, compute, publish, per chunk."""
    while seq.computed < upto:
        count = min(chunk, upto - seq.computed)
        assert kv.reserve(seq, count)
        kv.computed(seq, seq.computed + count)
        if count > 1:
            kv.commit(seq, tokens)


def ids(a) -> list[int]:
    return [int(x) for x in a]


def test_lifecycle_with_exact_pages():
    kv = manager()
    a = SeqKV()
    prompt = [1, 2, 3, 4, 5]
    assert kv.admit(a, prompt) == 0 and a.cached_tokens == 0 and a.node is None
    run(kv, a, prompt, 5, chunk=4)  # chunk 1: tokens 0-3 (pages 0, 1, published); chunk 2: token 4
    assert ids(a.pages) == [0, 1, 2] and (a.computed, a.published) == (5, 4)
    assert kv.tree.cached_pages == 2 and a.node is not None and a.node.lock_ref == 1
    kv.check([a])
    b = SeqKV()
    assert kv.admit(b, [1, 2, 3, 4, 9, 9]) == 4  # tokens[:-1] = 1 2 3 4 9: two whole pages cached
    assert ids(b.pages) == [0, 1] and b.cached_tokens == 4
    # one owner per page: the tree's pages 0, 1 (a and b read them under their locks), a's partial page
    assert kv.pool.refcount([0, 1, 2]).tolist() == [1, 1, 1] and b.node is a.node and a.node.lock_ref == 2
    kv.release(a, prompt + [7])  # computed 5: pages 0, 1 published already, page 2 partial: freed
    assert kv.pool.refcount([0, 1, 2]).tolist() == [1, 1, 0] and len(a.pages) == 0 and a.computed == 0
    assert b.node.lock_ref == 1 and kv.tree.evictable_pages == 0
    kv.check([b])
    kv.release(b, [1, 2, 3, 4, 9, 9])
    kv.check([])
    assert kv.flush() == 2 and kv.pool.num_free() == 16


def test_reserve_evicts_then_asks_for_room_then_refuses_unchanged():
    kv = manager(num_pages=4)
    a = SeqKV()
    run(kv, a, [1, 2, 3, 4], 4, chunk=4)
    kv.release(a, [1, 2, 3, 4])  # 2 cached pages, unlocked
    b = SeqKV()
    kv.admit(b, [5, 6, 7, 8, 9, 10])
    assert kv.reserve(b, 6)  # needs 3: 2 free + evicts 1
    assert kv.tree.cached_pages == 1 and len(b.pages) == 3
    c = SeqKV()
    kv.admit(c, [11, 12, 13])
    calls = []
    assert not kv.reserve(c, 4, lambda: calls.append(1) or False)  # 2 pages: 0 free after evicting 1
    assert calls == [1] and len(c.pages) == 0 and kv.pool.num_free() == 1  # the eviction stays done

    def room():
        kv.release(b, [5, 6, 7, 8, 9, 10])  # preempt b: its 3 computed pages... none computed: all free
        return True

    assert kv.reserve(c, 4, room) and len(c.pages) == 2
    kv.check([c])


def test_recompute_from_takes_only_the_pages_before_it_and_leaves_the_rest_evictable():
    kv = manager(num_pages=8)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = SeqKV()
    run(kv, a, prompt, 7, chunk=8)
    kv.release(a, prompt)  # 3 whole pages cached
    b = SeqKV()
    assert kv.admit(b, prompt, recompute_from=3) == 2  # only the page before position 3 (after a -1 shift)
    assert ids(b.pages) == [0] and kv.tree.evictable_pages == 2
    c = SeqKV()
    assert kv.admit(c, prompt, recompute_from=0) == 0 and c.node is None and len(c.pages) == 0
    kv.release(c, prompt)
    # b recomputes tokens 2..6 into pages 3 (a's freed partial page, reused first), 4, 5;
    # publishing takes the tree's pages 1, 2 for tokens 2..5 and frees its copies 3, 4
    run(kv, b, prompt, 7, chunk=8)
    assert ids(b.pages) == [0, 1, 2, 5] and kv.pool.refcount([3, 4]).tolist() == [0, 0]
    kv.check([b])
    kv.release(b, prompt)
    kv.check([])


def test_check_proves_shared_pages_are_those_of_the_locked_path():
    kv = manager()
    a = SeqKV()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    run(kv, a, prompt, 8, chunk=8)
    kv.release(a, prompt)  # pages 0, 1, 2, 3 cached
    b = SeqKV()
    assert kv.admit(b, prompt) == 6 and ids(b.pages) == [0, 1, 2]
    kv.check([b])
    b.pages = np.array([0, 2, 1], dtype=np.int32)  # the same pages under the wrong tokens
    with pytest.raises(IntegrityError, match="not the pages of its locked path"):
        kv.check([b])
    b.pages = np.array([0, 1, 2], dtype=np.int32)
    kv.tree.unlock(b.node)
    with pytest.raises(IntegrityError, match="evicted or unlocked"):
        kv.check([b])


def test_without_a_tree_nothing_is_shared():
    kv = manager(tree=False)
    a, b = SeqKV(), SeqKV()
    run(kv, a, [1, 2, 3], 3, chunk=8)
    assert kv.admit(b, [1, 2, 3]) == 0 and kv.cached_len([1, 2, 3]) == 0
    kv.check([a, b])
    kv.release(a, [1, 2, 3])
    assert kv.pool.num_free() == 16
    kv.reserve(a, 3)
    with pytest.raises(ValueError, match="empty sequence"):
        kv.admit(a, [1, 2, 3])  # still holds its page


def test_computed_cannot_pass_the_page_table():
    kv = manager()
    a = SeqKV()
    kv.admit(a, [1, 2, 3])
    kv.reserve(a, 3)
    with pytest.raises(ValueError, match="computed must grow within the page table"):
        kv.computed(a, 5)


# -- random lifecycles: every page a sequence reads holds its own tokens ----------------------


class ManagerMachine(RuleBasedStateMachine):
    """Sequences admitted, grown chunk by chunk, published, preempted and released at
    random over a small pool. Each computed token "writes" its id into its slot of a
    shadow pool, so a page table that ever points at a page holding other tokens (a
    cached page under the wrong identity, a page freed and reused while still read) is
    caught; ``check`` proves the one-owner accounting after every step."""

    loops = None  # the compiled page loops where a C compiler is here

    def __init__(self):
        super().__init__()
        self.kv = manager(12, loops=self.loops)
        self.shadow: dict[int, list] = {}  # page -> the token ids written into its slots
        self.kv.pool.copy_rows = self._copy_rows  # admit's partial pages copy the shadow's rows
        self.running: list[tuple[SeqKV, list[int]]] = []
        self.seen = [[1, 2, 3, 4, 5, 6]]

    def _copy_rows(self, src: int, dst: int, count: int) -> None:
        assert self.kv.pool.refcount([dst])[0] == 1 and src != dst  # into a page the sequence alone owns
        self.shadow.setdefault(dst, [None] * PS)[:count] = self.shadow[src][:count]

    def _written(self, seq: SeqKV, tokens, start: int, end: int) -> None:
        for pos in range(start, end):
            self.shadow.setdefault(int(seq.pages[pos // PS]), [None] * PS)[pos % PS] = tokens[pos]

    @precondition(lambda self: len(self.running) < 3)
    @rule(data=st.data(), recompute=st.booleans())
    def admit(self, data, recompute):
        base = data.draw(st.sampled_from(self.seen))
        tokens = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(1, 3), min_size=2, max_size=7))
        self.seen.append(tokens)
        seq = SeqKV(namespace=data.draw(st.sampled_from([None, "t"])))
        self.kv.admit(seq, tokens, recompute_from=data.draw(st.integers(0, len(tokens))) if recompute else None)
        self.running.append((seq, tokens))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), commit=st.booleans())
    def compute(self, data, commit):
        seq, tokens = data.draw(st.sampled_from(self.running))
        count = data.draw(st.integers(0, len(tokens) - seq.computed))
        if not count or not self.kv.reserve(seq, count):
            return
        start = seq.computed
        self.kv.computed(seq, start + count)
        self._written(seq, tokens, start, start + count)
        if commit:
            self.kv.commit(seq, tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        i = data.draw(st.integers(0, len(self.running) - 1))
        seq, tokens = self.running[i]
        self.kv.release(seq, tokens)
        if preempt:
            self.kv.admit(seq, tokens)  # back in the queue: takes what its release published
        else:
            del self.running[i]

    @rule()
    def flush(self):
        self.kv.flush()

    @invariant()
    def pages_hold_their_tokens(self):
        self.kv.check([s for s, _ in self.running])
        for seq, tokens in self.running:
            for pos in range(seq.computed):
                assert self.shadow[int(seq.pages[pos // PS])][pos % PS] == tokens[pos], (seq, pos)
        for node in self.kv.tree.nodes():  # and the tree serves each page under its own tokens
            tokens = array("i", node.path_key()).tolist()
            for i, page in enumerate(node.path_pages().tolist()):
                assert self.shadow[page] == tokens[i * PS : (i + 1) * PS], (node, i)

    def teardown(self):
        for seq, tokens in self.running:
            self.kv.release(seq, tokens)
        self.kv.check([])
        self.kv.flush()
        assert self.kv.pool.num_free() == self.kv.pool.num_pages


class ManagerMachineNumpy(ManagerMachine):
    loops = NumpyPages  # the fallback's contract, under the same rules


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
TestManagerMachineNumpy = ManagerMachineNumpy.TestCase
TestManagerMachineNumpy.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


# -- the simulator replays what the engine does ---------------------------------------------


class StubModel:
    """The engine's model interface without a model: the next token of a sequence is a
    fixed function of its last token; nothing is written to the pool."""

    class config:  # noqa: N801 - stands in for a ModelConfig
        num_layers, num_kv_heads, head_dim, vocab_size = 1, 1, 4, 49152
        max_position_embeddings, sliding_window = 4096, None

    dtype = torch.float32

    @staticmethod
    def next_token(t: int) -> int:
        return 1000 + (t * 7919) % 20000

    def weights_summary(self) -> dict:
        return {"mode": "stub", "bytes": 0, "tensors": {}}

    def forward(self, batch, pool, backend=None, all_logits=False):
        ends = batch.qo_indptr[1:].long() - 1
        last = batch.input_ids[ends]
        logits = torch.zeros(len(last), self.config.vocab_size)
        logits[torch.arange(len(last)), torch.tensor([self.next_token(int(t)) for t in last])] = 1.0
        return logits


def test_sim_replays_exactly_what_the_engine_caches(monkeypatch):
    import radixkv.engine.engine as engine_module
    import radixkv.engine.loop as loop_module
    from radixkv.engine.sampling import SamplingParams

    monkeypatch.setattr(loop_module, "load_model", lambda *a, **k: StubModel())
    rng = np.random.default_rng(3)
    system = rng.integers(100, 900, 37).tolist()
    page_size, pool_pages, chunk = 4, 96, 24  # small: evictions and several chunks per prompt
    prompts, outputs, got, history = [], [], [], {}
    with engine_module.Engine(page_size=page_size, kv_cache_tokens=pool_pages * page_size,
                              chunked_prefill_size=chunk, attention_backend="torch") as engine:  # fmt: skip
        for turn in range(5):  # three conversations over one system prompt, turns interleaved
            for conv in range(3):
                prompt = history.get(conv, system) + rng.integers(100, 900, rng.integers(3, 40)).tolist()
                out = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
                prompts.append(prompt)
                outputs.append(out.token_ids)
                got.append(out.cached_tokens)
                history[conv] = prompt + out.token_ids  # the next turn extends the answer: a later hit
        engine.check_integrity()
    trace = [TraceRequest(array("i", p), output_tokens=array("i", o)) for p, o in zip(prompts, outputs)]
    replayed = sim.replay(trace, pool_pages, page_size, chunk_size=chunk)
    assert list(replayed.cached_per_request) == got
    assert sum(got) > 0 and replayed.evicted_pages > 0 and replayed.rejected == 0


def test_the_simulators_default_chunk_is_the_engines():
    from radixkv.engine.engine import EngineConfig

    assert sim.DEFAULT_CHUNK_SIZE == EngineConfig.chunked_prefill_size


P4 = 4  # tokens a page here: room for a match three tokens into one


class CopyingAllocator(PageAllocator):
    """A page allocator whose pages hold token ids (one list per page), so that a test
    sees what ``copy_rows`` moved."""

    def __init__(self, num_pages):
        super().__init__(num_pages)
        self.rows: dict[int, list] = {}
        self.copies: list[tuple[int, int, int]] = []

    def copy_rows(self, src, dst, count):
        self.copies.append((src, dst, count))
        self.rows.setdefault(dst, [None] * P4)[:count] = self.rows[src][:count]


def test_admit_copies_the_leading_rows_of_a_cached_page_where_the_match_ends_inside_it():
    pool = CopyingAllocator(16)
    kv = KVCacheManager(pool, RadixCache(pool, P4), P4)
    first = list(range(1, 3 * P4 + 3))  # three whole pages and two tokens
    a = SeqKV()
    kv.admit(a, first)
    run(kv, a, first, len(first), 64)
    for i, page in enumerate(a.pages.tolist()):
        pool.rows[page] = first[i * P4 : (i + 1) * P4]
    kv.release(a, first)
    donor = int(kv.tree.match_prefix(first[: 2 * P4], record_stats=False).pages[1])  # the page holding tokens 4..7
    second = first[: P4 + 3] + [99, 98]  # the second page's first three tokens, then others
    b = SeqKV()
    assert kv.admit(b, second) == P4 + 3 and b.cached_tokens == P4 + 3 and b.published == P4
    (own,) = b.pages[1:].tolist()
    assert pool.copies == [(donor, own, 3)] and pool.rows[own][:3] == first[P4 : P4 + 3]
    assert pool.refcount([own])[0] == 1 and own != donor  # the copy is the sequence's own page
    kv.check([b])
    assert kv.pages_needed(b, 1) == 0 and kv.pages_needed(b, 2) == 1  # token P4 + 3 fills that page
    run(kv, b, second, len(second), 64)
    kv.release(b, second)
    kv.check([])
    # a prompt that is a cached page's prefix computes its last two tokens (the last one alone would be a decode row)
    c = SeqKV()
    assert kv.admit(c, first[: P4 + 3]) == P4 + 1
    kv.release(c, first[: P4 + 3])
    # all but its last token are cached whole pages: the match stops a page earlier and that
    # page's rows are copied, so two tokens are computed, not a lone one (a decode row)
    copies = len(pool.copies)
    g = SeqKV()
    assert kv.admit(g, first[: 2 * P4 + 1]) == 2 * P4 - 1 and g.cached_tokens == 2 * P4 - 1
    assert pool.copies[copies:] == [(donor, int(g.pages[1]), P4 - 1)]
    kv.release(g, first[: 2 * P4 + 1])
    # switched off, and for prompt logprobs (recomputed positions), admission stops at whole pages
    third = first[: P4 + 2] + [77, 77, 77]
    off = KVCacheManager(pool, kv.tree, P4, partial_pages=False)
    d = SeqKV()
    assert off.admit(d, third) == P4
    off.release(d, third)
    assert off.admit(d, first[: 2 * P4 + 1]) == 2 * P4  # no copy: the lone last token stays
    off.release(d, first[: 2 * P4 + 1])
    e = SeqKV()
    assert kv.admit(e, third, recompute_from=len(third)) == P4
    kv.release(e, third)
    assert kv.admit(e, third) == P4 + 2
    kv.release(e, third)
    kv.check([])
    assert kv.pool.num_free() + kv.tree.cached_pages == 16
