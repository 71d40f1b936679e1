"""Trace capture (radixkv.cache.capture): programs and `radixkv serve --record-trace` write
traces that `radixkv sim` replays to the cached-token counts the live run reported.

Exact per request here: requests run one at a time (``num_threads=1``), so the engine's
scheduler and the simulator see the same order, and both drive the same KVCacheManager
calls with the same pool pages, page size, policy and prefill chunk (cache/sim.py). With
concurrent requests the replay is an estimate (two requests admitted in the same step
cannot share what neither has computed yet): benchmarks/bench_trace_replay.py measures
that difference against the 0.5-point target.
"""

from __future__ import annotations

import json

import httpx
import pytest

from radixkv import workloads as W
from radixkv.cache import sim, traces
from radixkv.cache.capture import TraceWriter, opaque_namespace
from radixkv.frontend import EngineBackend, OpenAIBackend, RuntimeEndpoint, assistant, function, gen, set_default_backend, user
from radixkv.server.process import ServerProcess

PAGE = 16
POOL_TOKENS = 4096


@pytest.fixture(scope="module")
def engine():
    backend = EngineBackend(kv_cache_tokens=POOL_TOKENS, page_size=PAGE)
    yield backend.engine
    backend.close()


def _replay(path, pages):
    trace = traces.load_jsonl(path)
    trace = sorted(trace, key=lambda r: r.arrival)  # the order the requests arrived in
    return trace, sim.replay(trace, pages, PAGE, "lru")


@pytest.mark.parametrize("name", ["rag", "agent"])
def test_a_recorded_program_replays_to_the_live_cached_tokens(engine, tmp_path, name):
    engine.flush_cache()
    backend = EngineBackend(engine)
    workload = W.make(name, 0, W.TINY)
    path = tmp_path / "trace.jsonl"
    states = workload.program.run_batch(workload.runs, backend=backend, num_threads=1, record_trace=path)
    calls = [c for s in states for c in s.all_calls()]
    trace, result = _replay(path, engine.pool.num_pages)
    assert [r.cached_tokens for r in trace] == [c.cached_tokens for c in calls]
    assert [list(r.tokens) for r in trace] == [list(c.prompt_ids) for c in calls]
    assert list(result.cached_per_request) == [c.cached_tokens for c in calls]
    assert sum(r.cached_tokens for r in trace) > 0
    sessions = [r.session for r in trace]
    assert len(set(sessions)) == len(workload.runs) and all(s.startswith(f"{name}-") for s in sessions)
    assert all(r.namespace is None for r in trace)


def test_forks_share_the_session_and_a_salt_is_hashed(engine, tmp_path):
    engine.flush_cache()

    @function
    def branches(s):
        s += user("Name two colours and two animals, in a list.")
        forks = s.fork(2)
        for f in forks:
            f += assistant(gen("x", max_tokens=3, temperature=0, ignore_eos=True))
        forks.join()

    path = tmp_path / "fork.jsonl"
    branches.run(backend=EngineBackend(engine, namespace="tenant-secret-42"), record_trace=path)
    text = path.read_text()
    assert "tenant-secret-42" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 3  # the shared prefix, then the two branches
    assert len({line["session"] for line in lines}) == 1
    assert len({line["namespace"] for line in lines}) == 1 and lines[0]["namespace"].startswith("ns-")
    trace, result = _replay(path, engine.pool.num_pages)
    assert list(result.cached_per_request) == [r.cached_tokens for r in trace]


def test_set_default_backend_records_every_run(engine, tmp_path):
    engine.flush_cache()

    @function
    def ask(s, q):
        s += user(q)
        s += assistant(gen("a", max_tokens=2, temperature=0, ignore_eos=True))

    path = tmp_path / "default.jsonl"
    set_default_backend(EngineBackend(engine), record_trace=path)
    try:
        ask.run(q="What is a page?")
        ask.run(q="What is a page table?")
    finally:
        set_default_backend(None)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["session"] != lines[1]["session"]
    assert lines[0]["arrival"] <= lines[1]["arrival"]
    trace, result = _replay(path, engine.pool.num_pages)
    assert list(result.cached_per_request) == [r.cached_tokens for r in trace]


def test_rotation_keeps_one_old_file_and_continues_the_clock(tmp_path):
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, max_bytes=400)
    for i in range(20):
        writer.record(list(range(i, i + 20)), [1, 2], cached_tokens=0)
    writer.close()
    old, new = path.with_name("t.jsonl.1"), path
    assert writer.rotations >= 2 and old.exists() and not path.with_name("t.jsonl.2").exists()
    assert old.stat().st_size <= 400 and new.stat().st_size <= 400
    both = [json.loads(line) for p in (old, new) for line in p.read_text().splitlines()]
    assert [line["tokens"][0] for line in both] == list(range(20 - len(both), 20))  # the newest lines, in order
    arrivals = [line["arrival"] for line in both]
    assert arrivals == sorted(arrivals)
    assert traces.load_jsonl(old) and traces.load_jsonl(new)


def test_a_restart_keeps_the_previous_trace_as_dot_1(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"tokens": [1]}\n')
    TraceWriter(path).close()
    assert path.with_name("t.jsonl.1").read_text() == '{"tokens": [1]}\n' and path.read_text() == ""


def test_the_writer_refuses_a_bad_bound(tmp_path):
    with pytest.raises(ValueError, match="record_trace_max_bytes"):
        TraceWriter(tmp_path / "t.jsonl", max_bytes=0)


def test_opaque_namespace_is_keyed():
    a, b = opaque_namespace(b"k" * 32, "salt"), opaque_namespace(b"j" * 32, "salt")
    assert a != b and a.startswith("ns-") and len(a) == 15 and "salt" not in a


@function
def _ask(s, q):
    s += user(q)
    s += assistant(gen("a", max_tokens=2, temperature=0, ignore_eos=True))


def test_server_records_a_trace_that_replays_and_never_holds_the_salt(tmp_path):
    path = tmp_path / "server.jsonl"
    salt = "very-secret-tenant-salt"
    with ServerProcess("--kv-cache-tokens", str(POOL_TOKENS), "--page-size", str(PAGE), "--record-trace", str(path),
                       "--record-trace-max-bytes", str(1 << 20)) as server:  # fmt: skip
        endpoint = RuntimeEndpoint(server.url)
        workload = W.make("rag", 0, W.TINY)
        states = workload.program.run_batch(workload.runs, backend=endpoint, num_threads=1)
        live = [c.cached_tokens for s in states for c in s.all_calls()]
        endpoint.close()
        headers = {"X-Session-Id": "conversation-7"}
        body = {"model": "smollm2-135m-instruct", "prompt": "Hello there, general", "max_tokens": 3,
                "temperature": 0, "cache_salt": salt}  # fmt: skip
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200
            live.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        # a text-level client: the program's trace has the messages it sent; the server's has the ids
        openai_path = tmp_path / "openai.jsonl"
        openai = OpenAIBackend(server.url + "/v1", extra_body={"cache_salt": salt})
        _ask.run(q="What is a page table?", backend=openai, record_trace=openai_path)
        openai.close()
    (sent,) = [json.loads(line) for line in openai_path.read_text().splitlines()]
    assert salt not in openai_path.read_text() and sent["namespace"].startswith("ns-")
    assert sent["messages"][-1] == {"role": "user", "content": "What is a page table?"}
    assert sent["output_tokens"] == 2 and "tokens" not in sent
    live.append(sent["cached_tokens"])
    text = path.read_text()
    assert salt not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == len(live)
    assert lines[-1]["namespace"].startswith("ns-") and len(lines[-1]["output_tokens"]) == 2
    lines.pop()
    salted = lines[-2:]
    assert [line["session"] for line in salted] == ["conversation-7"] * 2
    assert salted[0]["namespace"] == salted[1]["namespace"] and salted[0]["namespace"] in metrics  # = the label
    assert all("namespace" not in line and line["session"] is None for line in lines[:-2])
    trace, result = _replay(path, POOL_TOKENS // PAGE)
    assert [r.cached_tokens for r in trace] == live
    assert list(result.cached_per_request) == live


def test_radixkv_sim_replays_a_recorded_program_to_the_live_hit_rate(engine, tmp_path, capsys):
    """The CLI as a user runs it on the file: same pool pages, page size and policy."""
    from radixkv.cli import main

    engine.flush_cache()
    workload = W.make("rag", 1, W.TINY)
    path = tmp_path / "rag.jsonl"
    workload.program.run_batch(workload.runs, backend=EngineBackend(engine), num_threads=1, record_trace=path)
    out = tmp_path / "sim.json"
    assert main(["sim", str(path), "--page-size", str(PAGE), "--capacity-pages", str(engine.pool.num_pages),
                 "--policy", "lru", "--no-belady", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert result["live"]["cached_tokens"] > 0
    assert run["cached_tokens"] == result["live"]["cached_tokens"]
    assert "live run:" in capsys.readouterr().out
