"""The Engine on the real SmolLM2 model: exact tokens, cache behaviour, lifecycle."""

import asyncio
import os
import re

import pytest
import torch

from radixkv.engine.engine import Engine
from radixkv.engine.sampling import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
SYSTEM = "You are a concise assistant. Answer in one short sentence, without any preamble or lists."
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 7 times 8?", "Who wrote Hamlet?",
    "What is the boiling point of water?", "Name a planet.", "What language is spoken in Brazil?",
    "What is the largest ocean?", "What do bees make?",
]  # fmt: skip


def chats(engine):
    return [engine.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]  # fmt: skip


def make(**settings):
    """An engine with the default attention backend (on a CPU: the C decode kernel), in
    the exact mode (fp32 weights: its greedy tokens are transformers')."""
    return Engine(**{"kv_cache_tokens": 16384, "weights": "fp32", **settings})


@pytest.fixture(scope="module")
def engine():
    with make() as e:
        yield e
        e.check_integrity()


@pytest.fixture(scope="module")
def reference(engine):
    """Each prompt alone, prefix cache off, the torch reference backend: the tokens
    everything else must reproduce."""
    with make(enable_prefix_cache=False, attention_backend="torch") as cold:
        return [cold.generate(p, GREEDY).token_ids for p in chats(cold)]


def test_greedy_matches_transformers(engine):
    transformers = pytest.importorskip("transformers")
    from radixkv.model import resolve_model

    src = resolve_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src.path.parent, gguf_file=src.path.name, dtype=torch.float32)
    for prompt in chats(engine)[:3]:
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=2)
        theirs = out[0, len(ids) :].tolist()
        mine = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=20)).token_ids
        assert mine == theirs


def test_batched_and_cached_outputs_equal_each_alone(engine, reference):
    outs = engine.generate(chats(engine), GREEDY)  # all nine in one continuous batch, cache on
    assert [o.token_ids for o in outs] == reference
    again = engine.generate(chats(engine), GREEDY)  # now served mostly from the cache
    assert [o.token_ids for o in again] == reference
    assert all(o.cached_tokens >= 32 for o in again)
    engine.check_integrity()


@pytest.mark.parametrize("chunk", [16, 64, None])
def test_chunked_prefill_gives_the_same_tokens(reference, chunk):
    with make(chunked_prefill_size=chunk, max_batch_tokens=128 if chunk else 4096) as e:
        assert [o.token_ids for o in e.generate(chats(e), GREEDY)] == reference
        e.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_preemption_under_a_tiny_pool_gives_the_same_tokens(reference, policy):
    with make(kv_cache_tokens=288, page_size=16, debug=True, policy=policy) as e:
        outs = e.generate(chats(e), GREEDY)
        assert [o.token_ids for o in outs] == reference
        assert e.stats()["preemptions"] > 0
        e.check_integrity()


def test_second_turn_reuses_the_whole_first_turn(engine):
    first = engine.generate(chats(engine)[0] + " ", SamplingParams(temperature=0, max_new_tokens=12))
    p1 = engine.tokenizer.encode(chats(engine)[0] + " ")
    follow = engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")
    second = engine.generate(p1 + first.token_ids + follow, SamplingParams(temperature=0, max_new_tokens=4))
    computed = len(p1) + len(first.token_ids) - 1  # the last sampled token never had KV
    assert second.cached_tokens == computed // 16 * 16
    assert second.prompt_tokens == len(p1) + len(first.token_ids) + len(follow)


def test_a_cached_prefix_that_ends_inside_a_page_is_taken_from_that_page(engine):
    """The cached pages' tokens a prompt shares need not end at a page: those of the page
    where they end are copied into the request's own page (``partial_pages``), and the
    tokens are those of the prompt computed with nothing cached."""
    base = engine.tokenizer.encode(chats(engine)[3])
    engine.generate(base, GREEDY)  # its whole pages enter the tree
    cut = (len(base) // 16 - 1) * 16 + 9  # nine tokens into its last whole page
    other = base[:cut] + engine.tokenizer.encode(" Reply in French, please.<|im_end|>\n<|im_start|>assistant\n")
    assert other[cut] != base[cut]
    warm = engine.generate(other, GREEDY)
    assert warm.cached_tokens == cut
    engine.check_integrity()
    assert engine.flush_cache() is True
    cold = engine.generate(other, GREEDY)
    assert cold.cached_tokens == 0 and warm.token_ids == cold.token_ids
    with make(partial_pages="off") as off:  # whole pages only
        off.generate(base, GREEDY)
        again = off.generate(other, GREEDY)
        assert again.cached_tokens == cut // 16 * 16 and again.token_ids == cold.token_ids


def test_a_prompt_one_token_past_cached_pages_gives_the_cold_bits(engine):
    """All but the last token of the prompt are cached whole pages: one token computed
    alone would be a decode row (the decode kernels, another order of float steps), so
    the match stops a page earlier and that page's rows are copied: two tokens are
    computed, and the logprobs are the cold prompt's to the bit."""
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True)
    base = engine.tokenizer.encode(chats(engine)[5])
    pages = len(base) // 16
    prompt = base[: pages * 16] + engine.tokenizer.encode(" Why?")[:1]  # whole pages, then one token
    assert engine.flush_cache() is True
    engine.generate(base, GREEDY)  # the prompt's whole pages enter the tree
    warm = engine.generate(prompt, params)
    assert warm.cached_tokens == len(prompt) - 2
    engine.check_integrity()
    assert engine.flush_cache() is True
    cold = engine.generate(prompt, params)
    assert cold.cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs  # floats compared exactly
    with make(partial_pages="off") as off:  # whole pages only: the lone token stays (a page again would cost more)
        off.generate(base, GREEDY)
        assert off.generate(prompt, params).cached_tokens == len(prompt) - 1


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=16, ignore_eos=True)
    alone = engine.generate(chats(engine)[1], params).token_ids
    others = [SamplingParams(temperature=1.0, max_new_tokens=16)] * 4
    mixed = engine.generate(chats(engine)[:5], others[:1] + [params] + others[1:])
    assert mixed[1].token_ids == alone
    other_seed = engine.generate(chats(engine)[1], SamplingParams(temperature=0.9, seed=99, max_new_tokens=16,
                                                                  ignore_eos=True))  # fmt: skip
    assert other_seed.token_ids != alone


def test_parallel_samples_share_the_prompt(engine):
    out = engine.generate("Tell me a fun fact about cats.", SamplingParams(n=3, temperature=1.0, seed=7,
                                                                           max_new_tokens=8, ignore_eos=True))  # fmt: skip
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.completion_tokens == 24


def test_stop_strings_cut_exactly_even_across_tokens(engine, reference):
    full = engine.tokenizer.decode(reference[0], skip_special_tokens=True)
    stop = full[5:9]  # a few characters from the middle, likely spanning tokens
    out = engine.generate(chats(engine)[0], SamplingParams(temperature=0, max_new_tokens=20, stop=[stop]))
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"

    async def streamed():
        parts = []
        async for chunk in engine.stream(chats(engine)[0], SamplingParams(temperature=0, max_new_tokens=20,
                                                                          stop=[stop])):  # fmt: skip
            parts.append(chunk.text)
        return parts

    parts = asyncio.run(streamed())
    assert "".join(parts) == out.text and len(parts) > 1


def test_stream_deltas_add_up_to_the_text(engine):
    async def run():
        params = SamplingParams(temperature=0, max_new_tokens=24)
        chunks = [c async for c in engine.stream(chats(engine)[3], params)]
        final = await engine.generate_async(chats(engine)[3], params)
        return chunks, final

    chunks, final = asyncio.run(run())
    assert "".join(c.text for c in chunks) == final.text
    assert sum((c.token_ids for c in chunks), []) == final.token_ids
    assert chunks[-1].finish_reason == final.finish_reason


def test_abort_mid_generation_frees_its_pages(engine):
    async def run():
        params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
        seen = 0
        async for chunk in engine.stream("Count from one to a thousand:", params):
            seen += len(chunk.token_ids)
            if seen >= 5:
                break  # leaving the stream aborts the request
        return seen

    assert asyncio.run(run()) >= 5
    stats = engine.stats()  # served after the abort: commands run in order on the engine thread
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pool"]["free"] == stats["pool"]["pages"] - stats["cache"]["cached_pages"]
    engine.check_integrity()


def test_logprobs_and_prompt_logprobs(engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    out = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=4, logprobs=True, top_logprobs=3,
                                                 prompt_logprobs_from=1))  # fmt: skip
    first = out.outputs[0]
    assert len(first.logprobs) == 4 and all(lp <= 0 for lp in first.logprobs)
    assert [t[0][0] for t in first.top_logprobs] == first.token_ids  # greedy picks the top token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():  # reference: the model's full-prompt logits
        from radixkv.cache import KVPool, PoolConfig
        from radixkv.model.batch import ForwardBatch, SeqInput

        m = engine.model
        c = m.config
        pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=8))
        logits = m.forward(ForwardBatch.build([SeqInput(prompt, 0, pool.alloc(1))], 16), pool, all_logits=True)
        ref = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], ref.tolist())) < 1e-4


def test_bad_requests_get_clear_errors(engine):
    with pytest.raises(ValueError, match="must not be empty"):
        engine.generate("", GREEDY)
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.generate([1, 2, 10**6], GREEDY)
    with pytest.raises(ValueError, match="the model's context is 8192"):
        engine.generate([1] * 9000, GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate("hi", {"temperature": 0})
    with pytest.raises(ValueError, match="max_running"):
        Engine(max_running=0)
    with pytest.raises(ValueError, match="kv_dtype must be one of fp32, bf16, fp16"):
        Engine(kv_dtype="int3")
    engine.check_integrity()


def test_kv_dtype_is_apart_from_the_weights_dtype():
    """``kv_dtype="bf16"`` with float32 weights: a bf16 pool, twice the pages for the same
    bytes, and generation running over it (the model test checks the logits)."""
    with make(kv_cache_tokens=None, memory_bytes=1 << 24, kv_dtype="bf16") as half, \
            make(kv_cache_tokens=None, memory_bytes=1 << 24) as full:  # fmt: skip
        assert half.pool.k[0].dtype == torch.bfloat16 and full.pool.k[0].dtype == torch.float32
        assert 2 * half.pool.config.bytes_per_page == full.pool.config.bytes_per_page
        assert half.pool.num_pages == (1 << 24) // half.pool.config.bytes_per_page >= 2 * full.pool.num_pages
        out = half.generate("The capital of France is", GREEDY)
        assert out.outputs[0].token_ids and half.model.dtype == torch.float32
        half.check_integrity()


def test_without_a_size_the_pool_takes_a_share_of_available_memory_committed_as_it_fills():
    """No kv_cache_tokens / memory_bytes: the pool is kv_memory_share (default 0.25) of
    the memory available once the weights are loaded, said in the startup summary; its
    memory is committed page by page as the cache writes it, not at start (kv_commit
    auto; a pool of a given size is committed at start, and the summary says which)."""
    from radixkv.cache.pool import available_memory
    from radixkv.engine.config import DEFAULT_KV_MEMORY_SHARE
    from radixkv.server.ops import Plan, summary

    def pool_line(engine) -> str:  # the startup summary's
        plan = Plan("m", 30, 8192, engine.pool.num_pages, 16, engine.pool.config.bytes_per_page, ())
        return next(x for x in summary(engine, plan, "m", "127.0.0.1", 1, 0.0) if x.startswith("KV pool:"))

    for share in (None, 0.4):
        with make(kv_cache_tokens=None, kv_memory_share=share) as e:
            free = e.loop.available_memory
            assert abs(free - available_memory()) < 0.2 * free  # measured with the weights loaded
            budget = int((share or DEFAULT_KV_MEMORY_SHARE) * free)
            pool_bytes = e.pool.num_pages * e.pool.config.bytes_per_page
            assert budget - e.pool.config.bytes_per_page < pool_bytes <= budget
            assert e.pool.resident_bytes() < 1 << 20  # gigabytes reserved, not resident
            assert e.generate("The capital of France is", GREEDY).outputs[0].token_ids
            parts = 2 * e.model.config.num_layers  # K and V of each layer
            assert 0 < e.pool.resident_bytes() <= parts * (4 << 20)  # what it wrote, in 2 MiB huge pages
            e.check_integrity()
            line = pool_line(e)
            assert line.endswith(f"; {100 * (share or DEFAULT_KV_MEMORY_SHARE):g}% of {line.rsplit(' of ', 1)[1]}")
            assert "GiB available; committed as it fills" in line or "MiB available; committed as it fills" in line
    with make(kv_cache_tokens=None, memory_bytes=1 << 24) as sized:  # a size given: no share; committed at start
        assert sized.pool.num_pages == (1 << 24) // sized.pool.config.bytes_per_page
        assert re.search(r"\(\d+\.\d KiB a page\); committed at start-up in \d+\.\d\d s$", pool_line(sized))
        assert sized.pool.resident_bytes() >= sized.pool.num_pages * sized.pool.config.bytes_per_page
    with pytest.raises(ValueError, match="kv_commit must be one of auto, upfront, lazy, got 'eager'"):
        Engine(kv_commit="eager")
    with pytest.raises(ValueError, match=r"kv_memory_share must be in \(0, 0.95\], got 1.0"):
        Engine(kv_memory_share=1.0)
    with pytest.raises(ValueError, match="at most one of kv_cache_tokens, memory_bytes and kv_memory_share"):
        Engine(kv_memory_share=0.5, memory_bytes=1 << 30)


def test_regex_constrains_the_output(engine):
    import re

    prompt = engine.render_chat([{"role": "user", "content": "Pick a date in 2024 (YYYY-MM-DD)."}])
    pattern = r"2024-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    out = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=16, regex=pattern))
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"
    sampled = engine.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_new_tokens=16, regex=pattern)
                                            for s in range(3)])  # fmt: skip
    assert all(re.fullmatch(pattern, o.text) for o in sampled)
    forks = engine.generate(prompt, SamplingParams(temperature=1.0, seed=1, n=3, max_new_tokens=16, regex=pattern))
    assert all(re.fullmatch(pattern, o.text) for o in forks.outputs)  # each sample has its own matcher
    # the mask itself: after "2024-1" only 0-2 (and longer tokens that fit) may follow
    c = engine.grammar.compile(pattern)
    for t in engine.tokenizer.encode("2024-1", add_special_tokens=False):
        c.advance(t)
    ok = c.allowed()
    allowed = {engine.tokenizer.decode([i]) for i in ok.nonzero().flatten().tolist()}
    assert allowed and all(re.fullmatch(pattern, "2024-1" + t) or re.match(r"[0-2](-[0-9]*)?$", t) for t in allowed)
    assert not ok[sorted(engine.tokenizer.eos_token_ids)].any()  # "2024-1" is not a full match yet
    with pytest.raises(ValueError, match="regex"):
        SamplingParams(regex="([")  # refused by the grammar engine, not only by a check of its own
    too_big = "(" + "|".join(f"[a-{c}]{{3999}}" for c in "bcdefghijklmnopqrstuvwxyz") + ")"  # past the lexer's limits
    with pytest.raises(ValueError, match="regex .* cannot be used: .*too many"):
        engine.compile_constraint(SamplingParams(regex=too_big))
    with pytest.raises(ValueError, match="regex repeats at most 4000 times"):
        SamplingParams(regex="a{100000000}")
    with pytest.raises(ValueError, match="needs its compiled constraint"):
        engine._submit("hi", SamplingParams(regex="a+"), None)
    engine.check_integrity()


def test_flush_cache_empties_the_tree_when_idle(engine):
    engine.generate("Hello there", GREEDY)
    assert engine.stats()["cache"]["cached_pages"] > 0
    assert engine.flush_cache() is True
    stats = engine.stats()
    assert stats["cache"]["cached_pages"] == 0 and stats["pool"]["free"] == stats["pool"]["pages"]


def test_demo_chat_serves_later_turns_and_branches_from_the_cache(capsys):
    import re

    from radixkv.cli import DEMO_STYLES, demo_chat

    demo_chat()
    out = capsys.readouterr().out
    rows = [re.match(r"(turn \d|branch: .+?)\s{2,}(\d+)\s+(\d+)", line) for line in out.splitlines()]
    cached = {m[1]: int(m[3]) for m in rows if m}
    assert cached["turn 1"] == 0 and cached["turn 2"] > 0
    for style in DEMO_STYLES:
        assert cached[f"branch: {style}"] >= cached["turn 2"]


def test_the_loop_runs_on_typed_messages_alone(engine, reference):
    """The loop without an Engine: commands in, outputs out, every message plain data
    that pickles (what a loop in another process needs); its tokens are the Engine's."""
    import pickle
    import queue
    import threading
    import time

    from radixkv.engine.loop import EngineLoop
    from radixkv.engine.messages import AddRequests, Close, Finished, NewRequest, Query, QueryDone, Stopped
    from radixkv.engine.request import StreamChunk

    sent = []
    loop = EngineLoop(engine.config, sent.append)
    ids = tuple(engine.encode(chats(engine)[0]))
    inbox = queue.Queue()
    commands = [
        AddRequests((NewRequest("a", 0, ids, GREEDY, None, None, True, 0.0),
                     NewRequest("b", 0, ids, GREEDY, "tenant", None, False, 0.0))),  # fmt: skip
        Query("stats", 7),
    ]
    for command in commands:
        inbox.put(pickle.loads(pickle.dumps(command)))
    thread = threading.Thread(target=loop.run, args=(inbox,))
    thread.start()
    deadline = time.monotonic() + 120
    while sum(isinstance(m, Finished) for m in sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    inbox.put(Close())
    thread.join()
    for msg in sent:
        assert pickle.loads(pickle.dumps(msg)) == msg
    assert isinstance(sent[-1], Stopped)
    assert [m.qid for m in sent if isinstance(m, QueryDone)] == [7]
    done = {m.rid: m for m in sent if isinstance(m, Finished)}
    assert done["a"].completion.token_ids == done["b"].completion.token_ids == reference[0]
    assert done["a"].completion.finish_reason == done["b"].completion.finish_reason == "length"
    chunks = [m for m in sent if isinstance(m, StreamChunk)]
    assert {c.rid for c in chunks} == {"a"}  # only the streamed request sends chunks
    assert [t for c in chunks for t in c.token_ids] == reference[0]
    assert "".join(c.text for c in chunks) == done["a"].completion.text
    loop.kv.check([])


def test_a_stopped_loop_fails_waiting_requests_instead_of_hanging(monkeypatch):
    from radixkv.engine.loop import EngineLoop

    with make(kv_cache_tokens=1024) as e:
        def broken(self, command):
            raise RuntimeError("simulated loop failure")

        monkeypatch.setattr(EngineLoop, "_run_command", broken)
        out = e.generate("hello", GREEDY)
        assert out.error == "the engine loop has stopped" and out.finish_reason == "error"
        with pytest.raises(RuntimeError, match="engine thread has stopped"):
            e.stats()
        assert not e.is_alive()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenMP starts workers only with two cores or more")
def test_the_loading_thread_gives_back_its_openmp_workers():
    """Engine releases the OpenMP workers of the thread that loaded the model, so that the
    engine thread's are the only ones libgomp manages (more threads than cores and it stops
    spinning between parallel regions: every region of a step then waits for a wake-up)."""
    import threading

    from radixkv.engine.engine import release_openmp_workers

    counts = []

    def work():
        torch.set_num_threads(2)
        x = torch.randn(4_000_000)
        before = len(os.listdir("/proc/self/task"))
        torch.exp(x)  # large enough for a parallel region: this thread's pool starts a worker
        started = len(os.listdir("/proc/self/task"))
        release_openmp_workers()
        counts.extend([before, started, len(os.listdir("/proc/self/task"))])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    before, started, released = counts
    assert started > before  # the region started a worker
    assert released == before  # and it is gone


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_warm_up_runs_a_chunk_and_leaves_nothing_behind(kv_dtype):
    """Engine.warm_up (what `radixkv serve` runs before it answers /health): a prefill chunk
    into pages it gives back; nothing cached or counted, and the next request's tokens are
    those of an engine that never warmed up (its pages' old contents never read)."""
    prompt = "Write one sentence about the sea."
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    with Engine(kv_cache_tokens=2048, kv_dtype=kv_dtype) as cold:
        expected = cold.generate(prompt, params).token_ids
    with Engine(kv_cache_tokens=2048, kv_dtype=kv_dtype) as warm:
        before = warm.stats()
        assert warm.warm_up() == 512  # chunked_prefill_size, whole pages
        assert warm.stats() == before
        assert warm.generate(prompt, params).token_ids == expected
        warm.check_integrity()
    # at most what the pool has (3 pages of 16) and what the context holds (2 pages)
    limits, expected_tokens = ({"context_length": 32}, 32) if kv_dtype == "auto" else ({}, 48)
    with Engine(kv_cache_tokens=40, kv_dtype=kv_dtype, **limits) as tiny:
        assert tiny.warm_up() == expected_tokens
        stats = tiny.stats()
        assert stats["pool"]["free"] == stats["pool"]["pages"] == 3
        tiny.check_integrity()


def test_partial_pages_setting_is_checked_and_resolved():
    from radixkv.engine.engine import EngineConfig

    assert EngineConfig().copies_partial_pages and EngineConfig(kv_dtype="int8").copies_partial_pages
    assert not EngineConfig(kv_dtype="int4").copies_partial_pages  # its pages are sealed whole
    assert not EngineConfig(enable_prefix_cache=False).copies_partial_pages
    assert not EngineConfig(partial_pages="off").copies_partial_pages
    with pytest.raises(ValueError, match="partial_pages must be one of auto, on, off, got 'yes'"):
        EngineConfig(partial_pages="yes")
    with pytest.raises(ValueError, match="partial_pages on .* kv_dtype int4"):
        EngineConfig(partial_pages="on", kv_dtype="int4")
