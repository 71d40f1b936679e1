"""KVCacheManager: the sequence-level KV lifecycle (exact page ids), and the simulator
replaying exactly what the engine does (an Engine on a stub model, same trace)."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from radixkv.cache import PageAllocator, RadixCache, sim
from radixkv.cache.manager import KVCacheManager, SeqKV
from radixkv.cache.traces import TraceRequest

PS = 2


def manager(num_pages=16, tree=True):
    pool = PageAllocator(num_pages)
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
    assert kv.pool.refcount([0, 1, 2]).tolist() == [3, 3, 1]  # tree + a + b; a's partial page
    kv.release(a, prompt + [7])  # computed 5: pages 0, 1 published already, page 2 partial: freed
    assert kv.pool.refcount([0, 1, 2]).tolist() == [2, 2, 0] and len(a.pages) == 0 and a.computed == 0
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

    def forward(self, batch, pool, backend=None, all_logits=False):
        ends = batch.qo_indptr[1:].long() - 1
        last = batch.input_ids[ends]
        logits = torch.zeros(len(last), self.config.vocab_size)
        logits[torch.arange(len(last)), torch.tensor([self.next_token(int(t)) for t in last])] = 1.0
        return logits


def test_sim_replays_exactly_what_the_engine_caches(monkeypatch):
    import radixkv.engine.engine as engine_module
    from radixkv.engine.sampling import SamplingParams

    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: StubModel())
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
