import json
from array import array

import pytest

from radixkv.cache import sim, traces
from radixkv.cache.traces import TraceRequest
from radixkv.cli import main


def req(tokens, **kw):
    return TraceRequest(array("i", tokens), **kw)


SHARED = list(range(100, 110))  # 10 tokens

# As in the engine, a request looks up its prompt but the last token (whose logits
# give the first output token, so it is always computed), and the last output token is
# sampled but never computed, so it is never cached.


def test_second_request_hits_the_shared_prefix():
    trace = [req(SHARED + [1, 2]), req(SHARED + [3, 4, 5])]
    r = sim.replay(trace, None, page_size=1)
    assert (r.queried_tokens, r.hit_tokens, r.evicted_pages, r.rejected) == (11 + 12, 10, 0, 0)
    assert r.cached_pages == 15  # 10 shared + 2 + 3
    r4 = sim.replay(trace, None, page_size=4)
    assert r4.hit_tokens == 8  # only the two whole shared pages
    again = sim.replay([req(SHARED), req(SHARED)], None, 1)
    assert again.hit_tokens == 9  # the same prompt twice: all but its last token


def test_capacity_forces_evictions_and_policy_matters():
    a, b = [1] * 8, [2] * 8
    # Room for two of a, b, c (8 pages each) and one spare page. The second a hits 7
    # and computes its last token in the spare page. c then needs 7 more pages: LRU
    # takes them from b (used least recently), FIFO from a (inserted first).
    trace = [req(a), req(b), req(a), req([3] * 8), req(b), req(a)]
    lru = sim.replay(trace, 17, 1, "lru")
    fifo = sim.replay(trace, 17, 1, "fifo")
    assert lru.hit_tokens == 7 + 1 + 1  # the second a; then b and a find only their first page left
    assert fifo.hit_tokens == 7 + 7  # the second a and the second b
    assert lru.evicted_pages > 0 and fifo.evicted_pages > 0


def test_in_flight_requests_see_published_prompts_but_not_outputs():
    """A prompt's chunks are published as they are computed (the engine does so), a
    request's outputs only when it finishes."""
    first = req(SHARED, output_tokens=array("i", [7, 7, 7]))
    trace = [first, req(SHARED + [7, 7, 9])]
    assert sim.replay(trace, None, 1, in_flight=1).hit_tokens == 12  # SHARED + 7, 7
    assert sim.replay(trace, None, 1, in_flight=2).hit_tokens == 10  # SHARED only


def test_listed_outputs_are_cached_for_the_next_turn_and_counts_are_not():
    turn1 = req(SHARED, output_tokens=array("i", [7, 7, 7]))
    turn2 = req(SHARED + [7, 7, 7, 9])
    assert sim.replay([turn1, turn2], None, 1).hit_tokens == 12  # the third 7 was never computed
    counted = req(SHARED, output_tokens=3)  # fresh ids that no prompt repeats
    assert sim.replay([counted, turn2], None, 1).hit_tokens == 10


def test_request_larger_than_the_pool_is_rejected_cleanly():
    trace = [req(list(range(30))), req([1, 2])]
    r = sim.replay(trace, 8, 1)
    assert r.rejected == 1 and r.requests == 2  # replay also checks pool integrity at the end


def test_namespaces_do_not_share_in_the_simulator():
    trace = [req(SHARED, namespace="a"), req(SHARED, namespace="b"), req(SHARED, namespace="a")]
    assert sim.replay(trace, None, 1).hit_tokens == 9


@pytest.mark.parametrize("name", ["multi_turn", "branching"])
def test_belady_bounds_the_online_policies(name):
    trace = traces.synthetic(name)[:300]
    unlimited = sim.replay(trace, None, 16)
    cap = int(0.3 * unlimited.cached_pages)
    belady = sim.replay(trace, cap, 16, "belady")
    for policy in ("lru", "lfu", "fifo"):
        assert sim.replay(trace, cap, 16, policy).hit_tokens <= belady.hit_tokens
    assert belady.hit_tokens <= unlimited.hit_tokens


def test_belady_keeps_what_is_needed_next():
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    # After a, b: room for 8 pages. c needs 4: LRU drops a (oldest), Belady drops b
    # (a is needed next, b never again).
    trace = [req(a), req(b), req(c), req(a)]
    assert sim.replay(trace, 8, 1, "lru").hit_tokens == 0
    assert sim.replay(trace, 8, 1, "belady").hit_tokens == 3  # a again, all but its last token


def test_sweep_reports_every_policy_and_capacity():
    trace = traces.synthetic("branching")
    result = sim.sweep(trace, 16, ("lru", "lfu"), fractions=(0.2, 0.5))
    assert result["unique_pages"] == sim.replay(trace, None, 16).cached_pages
    assert [(r["policy"], round(r["capacity_fraction"], 1)) for r in result["runs"]] == [
        ("lru", 0.2), ("lru", 0.5), ("lfu", 0.2), ("lfu", 0.5), ("belady", 0.2), ("belady", 0.5),
    ]  # fmt: skip
    table = sim.format_table(result)
    assert "belady" in table and "unlimited" in table


def test_synthetic_workloads_are_seeded_and_shaped_as_specified():
    mt = traces.synthetic("multi_turn")
    assert len(mt) == 100 * 18
    assert [r.tokens for r in mt[:50]] == [r.tokens for r in traces.synthetic("multi_turn")[:50]]
    assert mt[0].tokens != traces.synthetic("multi_turn", seed=1)[0].tokens
    assert 50 <= len(mt[0].tokens) <= 200  # a first turn
    fs = traces.synthetic("few_shot")
    assert len(fs) == 200 and all(len(r.tokens) == 1050 and r.tokens[:1000] == fs[0].tokens[:1000] for r in fs)
    br = traces.synthetic("branching")
    assert len(br) == 3 + 9 + 27 + 81 and len(br[-1].tokens) == 500
    assert len(traces.synthetic("mixed")) == 2000
    with pytest.raises(ValueError, match="workload must be one of"):
        traces.synthetic("nope")


def test_jsonl_round_trip(tmp_path):
    trace = [req([1, 2, 3], namespace="x", output_tokens=4, priority=2), req([5], output_tokens=array("i", [6]))]
    path = tmp_path / "t.jsonl"
    traces.dump_jsonl(trace, path)
    assert traces.load_jsonl(path) == trace


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"bad.jsonl:2: not valid JSON"),
        ('{"text": "hello"}', r"bad.jsonl:2: 'text' needs a tokenizer"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "'messages' needs a tokenizer"),
        ('{"tokens": [1], "text": "hi"}', "exactly one of 'tokens', 'text', 'messages' is required"),
        ('{"namespace": "a"}', r"exactly one of .* \(got none\)"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"tokens": [1], "arrival": -1}', "'arrival' must be a number of seconds >= 0"),
        ('{"tokens": [1], "arrival": "soon"}', "'arrival' must be a number"),
        ('{"tokens": [1], "session": 5}', "'session' must be a string or null"),
        ('{"tokens": [1], "cached_tokens": -2}', "'cached_tokens' must be an int >= 0"),
        ('{"tokens": [1], "cached_tokens": 1.5}', "'cached_tokens' must be an int >= 0"),
        ('{"tokens": []}', "'tokens' must not be empty"),
        ('{"tokens": [1, "a"]}', "'tokens' must be a list of integer"),
        ('{"tokens": [1], "output_tokens": -1}', "'output_tokens' must be"),
        ('{"tokens": [1], "namespace": 3}', "'namespace' must be a string"),
        ('{"tokens": [1], "colour": 3}', r"bad.jsonl:2: unknown field\(s\) \['colour'\]"),
        ('{"tokens": [99999999999]}', "outside int32"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_trace_lines_name_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": [1, 2]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        traces.load_jsonl(path)


def test_recorder_fields_are_read_and_round_trip(tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_text(
        '{"tokens": [1, 2, 3], "arrival": 0.5, "session": "s1", "cached_tokens": 0, "output_tokens": 4}\n'
        '{"tokens": [1, 2, 4], "arrival": 0, "session": null, "cached_tokens": 2, "output_tokens": [9, 8],'
        ' "namespace": "ns-1f3a", "priority": 1}\n'
    )  # fmt: skip
    a, b = traces.load_jsonl(path)
    assert (a.arrival, a.session, a.cached_tokens, a.output_tokens) == (0.5, "s1", 0, 4)
    assert (b.arrival, b.session, b.cached_tokens, list(b.output_tokens), b.namespace) == (0.0, None, 2, [9, 8], "ns-1f3a")
    traces.dump_jsonl([a, b], tmp_path / "again.jsonl")
    assert traces.load_jsonl(tmp_path / "again.jsonl") == [a, b]


def test_arrival_on_some_lines_only_is_an_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"tokens": [1], "arrival": 0}\n{"tokens": [2]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: no 'arrival', but other lines have one"):
        traces.load_jsonl(path)


class FakeEncoder:
    def encode_text(self, text):
        return [ord(c) for c in text]

    def encode_messages(self, messages):
        return [ord(c) for m in messages for c in m["role"][0] + m["content"]]


def test_text_and_messages_lines_go_through_the_encoder(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "abc"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    a, b = traces.load_jsonl(path, FakeEncoder())
    assert list(a.tokens) == [97, 98, 99] and list(b.tokens) == [ord("u"), ord("h"), ord("i")]


def test_text_and_messages_are_tokenized_as_the_server_does(tmp_path):
    """The embedded model's tokenizer and chat template, as Engine.prompt_ids (a
    /v1/completions prompt) and Engine.chat_prompt_ids (a chat request) encode them."""
    from radixkv.model import resolve_model
    from radixkv.model.chat_template import ChatTemplate
    from radixkv.model.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model())
    template = ChatTemplate.from_tokenizer(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is <|im_end|> here?"}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": "The radix tree shares prefixes."}) + "\n"
                    + json.dumps({"messages": messages}) + "\n"
                    + json.dumps({"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                                                 {"type": "text", "text": "brief."}]},
                                               {"role": "user", "content": "What is <|im_end|> here?"}]}) + "\n")  # fmt: skip
    from radixkv.workloads.prompt_encoder import ModelPromptEncoder

    a, b, c = traces.load_jsonl(path, ModelPromptEncoder())
    assert list(a.tokens) == tok.encode("The radix tree shares prefixes.", True)
    expected = template.encode(tok, messages, add_generation_prompt=True)
    assert list(b.tokens) == expected == list(c.tokens)  # developer is system, text parts joined
    (im_end,) = tok.encode("<|im_end|>", False)
    assert expected.count(im_end) == 2  # the template's two; the one in the content stays plain text
    rendered = tok.decode(expected)
    assert rendered.endswith("<|im_start|>assistant\n") and "Be brief." in rendered
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'messages' cannot be encoded: messages\[0\].role"):
        traces.load_jsonl(bad, ModelPromptEncoder())


def test_cli_sim_on_a_trace_file_writes_table_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    traces.dump_jsonl(traces.synthetic("branching"), trace)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["sim", str(trace), "--page-size", "16", "--capacity", "0.25,0.5", "--policy", "lru,fifo",
               "--json", str(out_json), "--plot", str(out_png)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "120 requests" in text and "lru" in text and "fifo" in text and "belady" in text
    result = json.loads(out_json.read_text())
    assert len(result["runs"]) == 3 * 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sim_builtin_workload_and_export(tmp_path, capsys):
    export = tmp_path / "few.jsonl"
    assert main(["sim", "--workload", "few_shot", "--capacity-pages", "100", "--no-belady",
                 "--policy", "lru", "--export-trace", str(export)]) == 0  # fmt: skip
    assert len(traces.load_jsonl(export)) == 200
    assert "belady" not in capsys.readouterr().out


def test_cli_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1], "colour": "red"}\n')
    assert main(["sim", str(bad)]) == 2
    assert "bad.jsonl:1: unknown field(s) ['colour']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--workload", "few_shot", "--policy", "mru"])
    assert "unknown policy 'mru'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--workload", "few_shot", "--capacity", "0,1"])
    assert "capacities must be > 0" in capsys.readouterr().err
    assert main(["sim", str(tmp_path / "missing.jsonl")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_cli_demo_runs(tmp_path, capsys):
    assert main(["demo", "--no-model", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "multi_turn" in out and "few_shot" in out and "branching" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"demo_{n}.{ext}" for n in ("branching", "few_shot", "multi_turn") for ext in ("json", "png")
    ]


def test_byte_sweep_turns_bytes_into_pages_per_format():
    trace = traces.synthetic("few_shot")
    per_page = {"fp32": 1000, "int8": 266}
    result = sim.byte_sweep(trace, 16, (20_000, 80_000), per_page, ("lru",), chunk_size=None)
    runs = {(r["kv_dtype"], r["pool_bytes"]): r for r in result["runs"]}
    assert {k: r["capacity_pages"] for k, r in runs.items()} == {
        ("fp32", 20_000): 20, ("fp32", 80_000): 80, ("int8", 20_000): 75, ("int8", 80_000): 300}
    for (fmt, size), r in runs.items():  # each equals the page-count replay of the same capacity
        assert r["hit_tokens"] == sim.replay(trace, r["capacity_pages"], 16, "lru", chunk_size=None).hit_tokens
    assert runs[("int8", 20_000)]["hit_rate"] > runs[("fp32", 20_000)]["hit_rate"]
    with pytest.raises(ValueError, match="pool_bytes 500 holds no page of fp32"):
        sim.byte_sweep(trace, 16, (500,), per_page)


def test_cli_sim_at_fixed_memory_per_kv_format(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["sim", "--workload", "few_shot", "--pool-bytes", "8MiB,32MiB", "--kv-dtype", "fp32,int8",
                 "--policy", "lru", "--json", str(out_json), "--plot", str(out_png)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "8 MiB" in text and "32 MiB" in text and "int8" in text
    runs = json.loads(out_json.read_text())["runs"]
    # the embedded model's page of 16 tokens: 30 layers, 3 KV heads of 64, K and V
    fp32 = 2 * 30 * 16 * 3 * 64 * 4
    int8 = 2 * 30 * 16 * 3 * (64 + 1)
    assert {(r["kv_dtype"], r["capacity_pages"]) for r in runs} == {
        ("fp32", (8 << 20) // fp32), ("fp32", (32 << 20) // fp32), ("int8", (8 << 20) // int8), ("int8", (32 << 20) // int8)}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(["sim", "--workload", "few_shot", "--pool-bytes", "1GiB", "--kv-dtype", "int3"])
    assert "--kv-dtype must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--workload", "few_shot", "--pool-bytes", "lots"])
    assert "expected sizes like 1GiB" in capsys.readouterr().err
    assert main(["sim", "--workload", "few_shot", "--pool-bytes", "1KiB"]) == 2
    assert "pool_bytes 1024 holds no page of fp32" in capsys.readouterr().err


def test_pool_sizes_parse_binary_and_decimal_units():
    from radixkv.cli import _sizes

    assert _sizes("1GiB,512MiB,4KiB,2G,3MB,100,2e3,1.5kib") == (1 << 30, 512 << 20, 4 << 10, 2 * 10**9, 3 * 10**6, 100, 2000, 1536)
