"""Trace sources of the simulator: Mooncake-format files and the timed synthetic workloads."""

import json
from array import array
import statistics
from pathlib import Path

import numpy as np
import pytest

from radixkv.cache import sim, traces
from radixkv.cli import main

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def mooncake(ts, length, out, ids):
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}


# -- Mooncake traces ----------------------------------------------------------------


def test_mooncake_ids_become_runs_of_tokens_cut_to_the_input_length(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 10, 3, [0, 1, 2]), "", mooncake(1500, 8, 0, [0, 5])])
    a, b = traces.load_mooncake(path, block_tokens=4)
    assert a.tokens.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # blocks 0, 1 and half of 2
    assert b.tokens.tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert (a.output_tokens, a.arrival, b.output_tokens, b.arrival) == (3, 0.0, 0, 1.5)
    assert a.namespace is None and a.session is None and a.cached_tokens is None
    quiet = traces.load_mooncake(path, block_tokens=4, outputs=False)
    assert [r.output_tokens for r in quiet] == [0, 0] and quiet[0].tokens == a.tokens
    assert traces.load_mooncake(path, block_tokens=4, limit=1) == [a]
    # the default block is Mooncake's 512 tokens
    (big,) = traces.load_mooncake(write_lines(tmp_path / "b.jsonl", [mooncake(0, 513, 1, [3, 7])]))
    assert big.tokens[:2].tolist() == [1536, 1537] and big.tokens[511:].tolist() == [2047, 3584]


def test_mooncake_requests_share_their_common_blocks_in_the_simulator(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 12, 0, [0, 1, 2]), mooncake(5, 10, 0, [0, 1, 3])])
    trace = traces.load_mooncake(path, block_tokens=4)
    r = sim.replay(trace, None, page_size=4)
    assert r.cached_per_request == (0, 8)  # blocks 0 and 1, whole pages


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"bad.jsonl:2: not valid JSON"),
        ("[1]", r"bad.jsonl:2: expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 0}', r"bad.jsonl:2: missing field\(s\) \['hash_ids'\]"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": [1], "x": 1}',
         r"bad.jsonl:2: unknown field\(s\) \['x'\]"),
        ('{"timestamp": -1, "input_length": 4, "output_length": 0, "hash_ids": [1]}', "'timestamp' must be a number"),
        ('{"timestamp": "0", "input_length": 4, "output_length": 0, "hash_ids": [1]}', "'timestamp' must be a number"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": [1]}', "'input_length' must be an int >= 1"),
        ('{"timestamp": 0, "input_length": 2.5, "output_length": 0, "hash_ids": [1]}', "'input_length' must be an int"),
        ('{"timestamp": 0, "input_length": 4, "output_length": -1, "hash_ids": [1]}', "'output_length' must be an int"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": []}', "'hash_ids' must be a non-empty"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": [1, -2]}', "'hash_ids' must be"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": [true]}', "'hash_ids' must be"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 0, "hash_ids": [1, 2]}',
         r"bad.jsonl:2: 'input_length' 9 exceeds its 2 hash_ids of 4 tokens \(8\)"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": [536870912]}',
         r"bad.jsonl:2: block id 536870912 times 4 tokens per block overflows the int32 token ids"),
    ],
)  # fmt: skip
def test_bad_mooncake_lines_name_file_line_and_field(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake(0, 4, 0, [0]), line])
    with pytest.raises(ValueError, match=message):
        traces.load_mooncake(path, block_tokens=4)


def test_mooncake_loader_rejects_empty_files_and_bad_arguments(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="the trace has no requests"):
        traces.load_mooncake(empty)
    ok = write_lines(tmp_path / "ok.jsonl", [mooncake(0, 4, 0, [0])])
    with pytest.raises(ValueError, match="block_tokens must be an int >= 1"):
        traces.load_mooncake(ok, block_tokens=0)
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        traces.load_mooncake(ok, limit=0)
    # the largest block id that still fits int32 token ids loads
    (top,) = traces.load_mooncake(write_lines(tmp_path / "top.jsonl", [mooncake(0, 4, 0, [2**29 - 1])]), 4)
    assert top.tokens[-1] == 2**31 - 1


def test_trace_format_is_detected_from_the_first_line(tmp_path):
    moon = write_lines(tmp_path / "m.jsonl", ["", mooncake(0, 4, 0, [0])])
    ours = tmp_path / "r.jsonl"
    traces.dump_jsonl([traces.TraceRequest(array("i", [1, 2]))], ours)
    assert traces.trace_format(moon) == "mooncake" and traces.trace_format(ours) == "radixkv"
    assert traces.trace_format(write_lines(tmp_path / "junk.jsonl", ["{not json"])) == "radixkv"
    assert traces.load_trace(moon, block_tokens=4)[0].tokens.tolist() == [0, 1, 2, 3]
    assert traces.load_trace(ours)[0].tokens.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"m.jsonl:2: unknown field\(s\) \['hash_ids', 'input_length'"):
        traces.load_trace(moon, "radixkv")
    with pytest.raises(ValueError, match="trace format must be one of auto, radixkv, mooncake"):
        traces.load_trace(ours, "csv")


def test_cli_sim_reads_a_mooncake_trace(tmp_path, capsys):
    rows = [mooncake(1000 * i, 1100 + 7 * i, 20, [0, 1] + [10 + i, 100 + i]) for i in range(6)]
    path = write_lines(tmp_path / "moon.jsonl", rows)
    out = tmp_path / "r.json"
    assert main(["sim", str(path), "--page-size", "512", "--capacity", "0.5", "--policy", "lru",
                 "--ignore-arrival", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "moon.jsonl: 6 requests in file order" in text and "% of belady / gap closed %" in text
    result = json.loads(out.read_text())
    assert result["unlimited"]["cached_tokens"] == 5 * 1024  # every later request finds blocks 0 and 1
    assert main(["sim", str(path), "--trace-format", "radixkv"]) == 2
    assert "moon.jsonl:1: unknown field(s)" in capsys.readouterr().err


@pytest.mark.skipif(not REAL.exists(), reason="needs ../shared/traces beside the repository")
def test_the_released_mooncake_trace_loads():
    trace = traces.load_mooncake(REAL, limit=50)
    assert len(trace) == 50
    first = trace[0]  # {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, ..., 13]}
    assert len(first.tokens) == 6758 and first.tokens.tolist() == list(range(6758))
    assert (first.output_tokens, first.arrival) == (500, 0.0)
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)
    assert sim.replay(trace, None, 512, arrivals=False).hit_tokens > 0  # they share the system prompt's block 0


# -- timed synthetic workloads ----------------------------------------------------------


def _conversations(trace):
    """Turns per conversation: each turn's prompt extends the previous one."""
    chats: list[list] = []
    for r in sorted(trace, key=lambda r: len(r.tokens)):
        for chat in chats:
            if r.tokens[: len(chat[-1].tokens)] == chat[-1].tokens:
                chat.append(r)
                break
        else:
            chats.append([r])
    return chats


def test_timed_multi_turn_has_the_untimed_prompts_and_a_chat_service_clock():
    timed, plain = traces.synthetic("multi_turn_timed"), traces.synthetic("multi_turn")
    assert sorted(r.tokens.tobytes() for r in timed) == sorted(r.tokens.tobytes() for r in plain)
    assert all(r.arrival is None for r in plain) and sim.timed(timed)
    arrivals = [r.arrival for r in timed]
    assert arrivals == sorted(arrivals)  # file order is arrival order
    chats = _conversations(timed)
    assert len(chats) == 100 and all(len(c) == 18 for c in chats)
    thinks = [b.arrival - a.arrival for c in chats for a, b in zip(c, c[1:])]
    assert min(thinks) > 0 and 24 < statistics.median(thinks) < 37  # lognormal, median 30 s
    starts = sorted(c[0].arrival for c in chats)
    assert 7 < np.mean(np.diff([0.0, *starts])) < 13  # Poisson, 0.1 conversations a second
    assert traces.synthetic("multi_turn_timed") == timed
    assert [r.arrival for r in traces.synthetic("multi_turn_timed", seed=1)] != arrivals


def test_timed_few_shot_and_mixed():
    questions = traces.few_shot(arrivals=True)
    assert [r.tokens for r in questions] == [r.tokens for r in traces.few_shot()]
    gaps = np.diff([0.0] + [r.arrival for r in questions])
    assert gaps.min() > 0 and 4 < gaps.mean() < 6.5  # Poisson, 0.2 a second
    mixed = traces.synthetic("mixed_timed")
    assert len(mixed) == 2000 and [r.arrival for r in mixed] == sorted(r.arrival for r in mixed)
    few = traces.few_shot(seed=2, arrivals=True)  # mixed's questions: its seed + 2
    assert [r for r in mixed if r.tokens[:1000] == few[0].tokens[:1000]] == few
    assert sorted(r.tokens.tobytes() for r in mixed) == sorted(r.tokens.tobytes() for r in traces.synthetic("mixed"))
    with pytest.raises(ValueError, match="rate must be > 0"):
        traces.few_shot(arrivals=True, rate=0)
    with pytest.raises(ValueError, match="think_median must be > 0"):
        traces.multi_turn(arrivals=True, think_median=0)


def test_cli_sim_timed_workload_runs_in_arrival_order(capsys):
    assert main(["sim", "--workload", "multi_turn_timed", "--capacity", "0.2", "--policy", "lru", "--no-belady"]) == 0
    assert "multi_turn_timed (seed 0): 1800 requests in arrival order, up to 64 in flight" in capsys.readouterr().out
