"""The benchmark workloads: deterministic generators, traces for `radixkv sim`, and a
small end-to-end run against radixkv (no timing assertions)."""

from __future__ import annotations

import json
import pytest

from radixkv import workloads as W
from radixkv.workloads import bench


@pytest.mark.parametrize("name", list(W.WORKLOADS))
def test_generators_are_deterministic(name):
    a, b, other = W.make(name, 0, W.FULL), W.make(name, 0, W.FULL), W.make(name, 1, W.FULL)
    assert a.runs == b.runs and a.runs != other.runs
    assert a.name == name and len(a.runs) > 0


def test_full_shapes_follow_the_paper():
    few = W.make("few_shot")
    assert len(few.runs) == 64 and len({r["examples"] for r in few.runs}) == 1
    chat = W.make("multi_turn")
    assert len(chat.runs) == 16 and all(len(r["messages"]) == 4 for r in chat.runs)
    rag = W.make("rag")
    assert len(rag.runs) == 100 and all(len(r["documents"]) == 3 for r in rag.runs)
    assert len({d for r in rag.runs for d in r["documents"]}) <= 30
    assert all(r["documents"] == sorted(r["documents"], key=lambda d: int(d.split()[1].rstrip("]")))
               for r in rag.runs)  # fmt: skip
    tree = W.make("branching")
    assert all(r["depth"] == 3 and r["width"] == 3 for r in tree.runs)


@pytest.mark.parametrize("name", ["few_shot", "multi_turn", "rag", "agent", "branching"])
def test_trace_export_replays_in_sim(tmp_path, name):
    from radixkv.cache import sim, traces

    workload = W.make(name, 0, W.TINY)
    n = W.export_trace(workload, tmp_path / "t.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == n > 0 and all(line["tokens"] and line["output_tokens"] for line in lines)
    if name != "branching":  # forks run side by side, so their order in the trace may vary
        W.export_trace(workload, tmp_path / "again.jsonl")
        assert (tmp_path / "again.jsonl").read_text() == (tmp_path / "t.jsonl").read_text()
    result = sim.replay(traces.load_jsonl(tmp_path / "t.jsonl"), None, 16)
    if name in ("few_shot", "multi_turn", "agent", "branching"):
        assert result.hit_rate > 0  # shared prefixes or growing prompts


def test_multi_turn_prompts_grow_by_whole_turns(tmp_path):
    W.export_trace(W.make("multi_turn", 0, W.TINY), tmp_path / "t.jsonl")
    reqs = [json.loads(line)["tokens"] for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    first, second = reqs[0], reqs[1]  # the first conversation's two turns (runs replay in order)
    assert second[: len(first)] == first and len(second) > len(first)


def test_small_end_to_end_run_against_radixkv(tmp_path, capsys):
    """`radixkv bench` (the CLI's command) runs every workload at the tiny scale."""
    from radixkv.cli import main

    assert main(["bench", "--scale", "tiny", "--systems", "radixkv", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "bench_e2e.json").read_text())
    rows = {r["workload"]: r for r in out["rows"]}
    assert set(rows) == set(W.WORKLOADS)
    for name, r in rows.items():
        workload = W.make(name, 0, W.TINY)
        per_run = {"few_shot": W.TINY.few_shot_answer, "multi_turn": W.TINY.turns * W.TINY.chat_answer,
                   "rag": W.TINY.rag_answer, "agent": (W.TINY.agent_steps + 1) * W.TINY.agent_answer,
                   "branching": (3 + 9 + 27) * W.TINY.branch_answer}[name]  # fmt: skip
        assert r["output_tokens"] == per_run * len(workload.runs)  # ignore_eos: every token generated
        assert r["wall_s"] > 0 and r["prompt_tokens"] > 0 and 0 <= r["cached_tokens"] < r["prompt_tokens"]
    assert rows["branching"]["cached_tokens"] > 0 and rows["few_shot"]["cached_tokens"] > 0
    assert (tmp_path / "e2e_throughput.png").stat().st_size > 0 and (tmp_path / "e2e_hit_rate.png").stat().st_size > 0
    assert "== rag" in capsys.readouterr().out


def test_workload_names_are_checked():
    with pytest.raises(ValueError, match="unknown workload"):
        W.make("nope")
    with pytest.raises(SystemExit):
        bench.main(["--systems", "vllm"])
    with pytest.raises(SystemExit):  # the peers exist only where benchmarks/bench_e2e.py adds them
        bench.main(["--systems", "transformers"])


@pytest.mark.parametrize("system, dtype", [("vllm", "float32"), ("vllm-bf16", "bfloat16")])
def test_the_vllm_peers_start_vllm_in_their_dtype(monkeypatch, system, dtype):
    """bench_e2e's two vLLM systems: the precision-matched float32 one and vLLM's CPU
    default, bf16. vLLM itself is not installed in CI, so the launch is caught."""
    from benchmarks import bench_e2e
    from benchmarks.peers import vllm_backend
    from radixkv.server import process

    launched = []

    def launch(cmd, *args, **kwargs):
        launched.append(cmd)
        raise RuntimeError("not started")

    monkeypatch.setattr(vllm_backend, "unavailable", lambda: None)
    monkeypatch.setattr(process, "launch", launch)
    with pytest.raises(RuntimeError, match="not started"):
        bench_e2e.PEERS[system]()
    (cmd,) = launched
    assert cmd[cmd.index("--dtype") + 1] == dtype and "--enable-prefix-caching" in cmd
    assert bench.GOALS[system] == 1.5


def test_the_program_workloads_replay_in_radixkv_sim(tmp_path, capsys):
    """rag and agent, the bench's programs, traced with the model's tokenizer: no checkout needed."""
    from radixkv.cli import main

    assert main(["sim", "--workload", "agent", "--capacity", "0.5", "--no-belady", "--policy", "lru",
                 "--export-trace", str(tmp_path / "agent.jsonl")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "agent program (seed 0)" in out and (tmp_path / "agent.jsonl").stat().st_size > 0
    lines = (tmp_path / "agent.jsonl").read_text().splitlines()
    assert len(lines) == len(W.make("agent").runs) * (W.FULL.agent_steps + 1)  # one request per gen call


def test_rounds_give_each_ratio_within_its_round_and_their_median(capsys):
    """With --rounds, radixkv is compared with a peer run in the same round only, and the
    summary is the median of those ratios."""

    def run(system, rnd, tok_s):
        return bench.Result("rag", system, 10.0, 5, int(tok_s * 10), 100, 40, 0.1, 0.2, [], rnd)

    results = [run("radixkv", 0, 20.0), run("vllm", 0, 10.0), run("vllm", 1, 16.0), run("radixkv", 1, 24.0),
               run("radixkv", 2, 15.0), run("vllm", 2, 12.5)]  # fmt: skip
    summary, by_round = bench.print_tables(results)
    assert by_round["rag"]["vllm"] == pytest.approx([2.0, 1.5, 1.2])
    assert summary["rag"]["vllm"] == pytest.approx(1.5)
    out = capsys.readouterr().out
    assert "radixkv #3" in out and "1.50x vllm (median of 2.00, 1.50, 1.20)" in out


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0", "--systems", "radixkv"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
