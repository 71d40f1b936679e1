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
    assert r4.hit_tokens == 10  # two whole pages, then the third page's two shared tokens (copied)
    assert sim.replay(trace, None, page_size=4, partial_pages=False).hit_tokens == 8  # whole pages only
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


# -- arrival times ----------------------------------------------------------------------------------

RATES = {"prefill_tok_s": 10.0, "decode_tok_s": 1.0}


def timed_pair(second_arrival):
    # A: 10 uncached prompt tokens at 10 tok/s (1 s) + 3 outputs at 1 tok/s (3 s): in flight 0..4 s
    a = req(SHARED, output_tokens=array("i", [7, 7, 7]), arrival=0.0)
    b = req(SHARED + [7, 7, 9], arrival=second_arrival)
    return [a, b]


def test_arrival_times_decide_what_is_finished_and_published():
    # B after A's modelled finish: A's outputs are published (SHARED + 7, 7: 12 tokens)
    assert sim.replay(timed_pair(5.0), None, 1, in_flight=2, **RATES).cached_per_request == (0, 12)
    # B while A runs, with a free slot: only A's published prompt (SHARED)
    assert sim.replay(timed_pair(2.0), None, 1, in_flight=2, **RATES).cached_per_request == (0, 10)
    # B while A runs but no free slot: B waits for A's finish, then sees its outputs
    assert sim.replay(timed_pair(2.0), None, 1, in_flight=1, **RATES).cached_per_request == (0, 12)
    # slower decode: A runs until 0 + 1 + 3 * 2 = 7 s, so at 5 s it still holds its outputs back
    assert sim.replay(timed_pair(5.0), None, 1, in_flight=2, prefill_tok_s=10.0,
                      decode_tok_s=0.5).cached_per_request == (0, 10)  # fmt: skip


def test_requests_replay_in_arrival_order_and_report_in_file_order():
    a, b = timed_pair(1.0)
    trace = [b, a]  # the file lists B first; A arrives first
    assert sim.replay(trace, None, 1, in_flight=1, **RATES).cached_per_request == (12, 0)
    # arrivals ignored: file order, B first; A then finds SHARED but its last token
    assert sim.replay(trace, None, 1, in_flight=1, arrivals=False, **RATES).cached_per_request == (0, 9)
    with pytest.raises(ValueError, match="must be > 0"):
        sim.replay(trace, None, 1, prefill_tok_s=0)


# -- breakdowns, live comparison, warnings, explanations ------------------------------------------


def test_breakdown_per_namespace_and_session_with_live_numbers():
    trace = [req(SHARED, namespace="a", session="x", cached_tokens=0),
             req(SHARED, namespace="b", session="y", cached_tokens=0),
             req(SHARED + [1], namespace="a", session="x", cached_tokens=8)]  # fmt: skip
    result = sim.sweep(trace, 1, ("lru",), capacity_pages=(100,), belady=False)
    run = result["runs"][0]
    assert run["by_namespace"] == {
        "a": {"requests": 2, "prompt_tokens": 21, "cached_tokens": 10, "hit_rate": 10 / 21,
              "live_cached_tokens": 8, "live_hit_rate": 8 / 21},
        "b": {"requests": 1, "prompt_tokens": 10, "cached_tokens": 0, "hit_rate": 0.0,
              "live_cached_tokens": 0, "live_hit_rate": 0.0},
    }  # fmt: skip
    assert run["by_session"]["x"]["cached_tokens"] == 10 and run["by_session"]["y"]["requests"] == 1
    assert (run["prompt_tokens"], run["cached_tokens"]) == (31, 10)
    assert result["live"] == {"requests": 3, "prompt_tokens": 31, "cached_tokens": 8, "hit_rate": 8 / 31}
    table = sim.format_breakdown(result, "namespace")
    assert table.splitlines()[0].split() == ["namespace", "requests", "prompt", "tok", "live", "%", "unlimited", "%",
                                             "lru", "100", "%"]  # fmt: skip
    assert table.splitlines()[2].split()[:5] == ["a", "2", "21", "38.10", "47.62"]
    plain = sim.sweep([req(SHARED), req(SHARED)], 1, ("lru",), capacity_pages=(100,), belady=False)
    assert "by_namespace" not in plain["unlimited"] and "live" not in plain
    assert sim.format_breakdown(plain, "namespace") == ""


def test_warnings_name_the_degenerate_cases():
    assert sim.warnings_for([req(SHARED)], 1)[0].startswith("the trace has one request")
    short = sim.warnings_for([req([1] * 16), req([2] * 17), req([3] * 5)], 16)
    assert short == ["2 of 3 prompts are no longer than a page (16 tokens): the tree shares whole pages, so they "
                     "can hit only what a cached page's leading tokens share with them, all but their last two "
                     "tokens at most (try a smaller --page-size)"]  # fmt: skip
    trace = [req(list(range(30))), req([1, 2])]
    result = sim.sweep(trace, 1, ("lru",), capacity_pages=(8,), belady=False)
    (warning,) = sim.warnings_for(trace, 1, result["runs"])
    assert warning.startswith("1 of 2 requests did not fit a pool of 8 pages, lru: the longest request needs 30 pages")
    assert sim.warnings_for([req([1] * 40), req([1] * 40)], 16) == []


def test_identical_policies_are_explained():
    a, b = [1] * 8, [2] * 8
    roomy = sim.sweep([req(a), req(b), req(a)], 1, ("lru", "fifo"), capacity_pages=(100,), belady=False)
    assert sim.explain_identical(roomy) == ["lru and fifo are identical here: nothing was evicted at these "
                                            "capacities, so no policy ever chose a victim."]  # fmt: skip
    misses = sim.sweep([req(a), req(b), req([3] * 8)], 1, ("lru", "fifo", "lfu"), capacity_pages=(9,), belady=False)
    assert sim.explain_identical(misses) == ["lru, fifo and lfu are identical here: every request was a miss: no "
                                             "prompt found a whole page of an earlier one still cached."]  # fmt: skip
    different = sim.sweep([req(a), req(b), req(a), req([3] * 8), req(b), req(a)], 1, ("lru", "fifo"),
                          capacity_pages=(17,), belady=False)  # the policy test's trace: lru 9, fifo 14
    assert sim.explain_identical(different) == []


def test_plot_lines_have_distinct_styles():
    styles = {(sim.line_style(i)["marker"], sim.line_style(i)["linestyle"]) for i in range(8)}
    assert len(styles) == 8


# -- what-if ---------------------------------------------------------------------------------------


def test_what_if_replays_each_configuration_and_estimates_prefill_time():
    trace = traces.synthetic("few_shot")[:40]
    configs = [sim.WhatIf("small", 20, 16, "lru"), sim.WhatIf("big", 200, 16, "fifo"),
               sim.WhatIf("pages of 4", 200, 4, "lru", host_pages=50), sim.WhatIf("all", None, 16)]  # fmt: skip
    result = sim.what_if(trace, configs, prefill_tok_s=100.0)
    rows = result["configs"]
    prompt = sum(len(r.tokens) for r in trace)  # 40 x 1050
    assert prompt == 42_000 and all(r["prompt_tokens"] == prompt for r in rows)
    for c, r in zip(configs, rows):
        alone = sim.replay(trace, c.capacity_pages, c.page_size, c.policy, host_pages=c.host_pages)
        assert r["prefill_tokens_saved"] == sum(alone.cached_per_request) == alone.hit_tokens
        assert r["prefill_tokens"] == prompt - r["prefill_tokens_saved"]
        assert r["est_prefill_s_saved"] == pytest.approx(r["prefill_tokens_saved"] / 100.0)
    # unlimited, page size 16: the 1000-token prefix holds 62 whole pages (992 tokens) and 8 tokens of the
    # next page, which the 39 later requests copy, with what their random suffixes share with an earlier one's
    suffixes = [list(r.tokens[1000:]) for r in trace]
    agree = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: E731
    chance = sum(min(7, max(agree(s, o) for o in suffixes[:i])) for i, s in enumerate(suffixes) if i)
    assert rows[3]["prefill_tokens_saved"] == 39 * 1000 + chance and rows[3]["unlimited"]
    assert rows[0]["prefill_tokens_saved"] < rows[1]["prefill_tokens_saved"]
    table = sim.format_what_if(result)
    assert "small" in table and "pages of 4" in table and "unlimited" in table and f"{39 * 1000 + chance:,}" in table


def test_cli_what_if_side_by_side(tmp_path, capsys):
    out_json = tmp_path / "w.json"
    assert main(["sim", "--workload", "few_shot", "--what-if", "pool-bytes=8MiB,kv-dtype=fp32,name=fp32 8MiB",
                 "--what-if", "pool-bytes=8MiB,kv-dtype=int8", "--what-if", "pages=300,policy=fifo,page-size=8",
                 "--prefill-tok-s", "500", "--json", str(out_json)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "fp32 8MiB" in captured.out and "pool-bytes=8MiB,kv-dtype=int8" in captured.out
    rows = json.loads(out_json.read_text())["configs"]
    fp32, int8 = 2 * 30 * 16 * 3 * 64 * 4, 2 * 30 * 16 * 3 * (64 + 1)  # bytes per page of the embedded model
    assert [(r["capacity_pages"], r["page_size"], r["policy"]) for r in rows] == [
        ((8 << 20) // fp32, 16, "lru"), ((8 << 20) // int8, 16, "lru"), (300, 8, "fifo")]
    trace = traces.synthetic("few_shot")
    for r in rows:
        alone = sim.replay(trace, r["capacity_pages"], r["page_size"], r["policy"])
        assert r["prefill_tokens_saved"] == alone.hit_tokens
        assert r["est_prefill_s_saved"] == pytest.approx(alone.hit_tokens / 500)
    assert "did not fit a pool of 11 pages (fp32 8MiB)" in captured.err  # 11 pages < a 1050-token prompt
    for bad, message in [("colour=red", "expected KEY=VALUE with KEY one of"), ("policy=mru", "unknown policy"),
                         ("pages=3,pool-bytes=1MiB", "not both"), ("page-size=0", "must be >= 1")]:  # fmt: skip
        with pytest.raises(SystemExit):
            main(["sim", "--workload", "few_shot", "--what-if", bad])
        assert message in capsys.readouterr().err


def test_cli_sim_text_trace_with_sessions_and_arrivals(tmp_path, capsys):
    """A recorder-shaped trace of chat messages: tokenized with the embedded model's
    template; replayed in arrival order, with live numbers and per-session rows."""
    system = {"role": "system", "content": "You answer questions about the radix tree cache. " * 20}
    lines = []
    for i, (session, arrival) in enumerate([("s1", 0.0), ("s2", 0.1), ("s1", 30.0), ("s2", 30.5)]):
        lines.append({"messages": [system, {"role": "user", "content": f"Question {i} from {session}?"}],
                      "session": session, "arrival": arrival, "cached_tokens": 0, "output_tokens": 4})  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out_json = tmp_path / "r.json"
    assert main(["sim", str(path), "--capacity-pages", "1000", "--policy", "lru", "--no-belady",
                 "--json", str(out_json)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "in arrival order, up to 64 in flight" in out and "by session" in out and "live run: 0.00%" in out
    result = json.loads(out_json.read_text())
    run = result["runs"][0]
    # the shared system message: every request after the first hits its whole pages
    assert run["cached_tokens"] > 0 and run["by_session"]["s1"]["requests"] == 2


def test_program_workloads_are_offered_by_sim():
    from radixkv.cli import PROGRAM_WORKLOADS, build_parser

    assert PROGRAM_WORKLOADS == ("rag", "agent")
    sim_parser = build_parser()._subparsers._group_actions[0].choices["sim"]
    choices = next(a.choices for a in sim_parser._actions if a.dest == "workload")
    assert {"rag", "agent", "multi_turn", "few_shot", "branching", "mixed"} <= set(choices)


def test_cli_sim_agent_workload(capsys):
    assert main(["sim", "--workload", "agent", "--capacity", "0.5", "--policy", "lru", "--no-belady"]) == 0
    assert "agent program (seed 0): 56 requests" in capsys.readouterr().out  # 8 agents x (6 steps + final)


def test_defaults_match_their_sources():
    from radixkv import cli
    from radixkv.engine.config import EngineConfig

    assert (cli._PREFILL_TOK_S, cli._DECODE_TOK_S) == (sim.DEFAULT_PREFILL_TOK_S, sim.DEFAULT_DECODE_TOK_S)
    assert cli._MAX_RUNNING == EngineConfig().max_running


def test_cli_sim_runs_the_return_oracle_beside_belady(tmp_path, capsys):
    trace_path, out_json = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace = traces.synthetic("branching")
    traces.dump_jsonl(trace, trace_path)
    assert main(["sim", str(trace_path), "--page-size", "16", "--capacity-pages", "60", "--policy",
                 "lru,return-oracle", "--json", str(out_json)]) == 0  # fmt: skip
    assert "return-oracle" in capsys.readouterr().out
    runs = {r["policy"]: r for r in json.loads(out_json.read_text())["runs"]}
    assert set(runs) == {"lru", "return-oracle", "belady"}
    alone = sim.replay(traces.load_jsonl(trace_path), 60, 16, "return-oracle")
    assert runs["return-oracle"]["hit_rate"] == alone.hit_rate and runs["return-oracle"]["gap_closed"] is not None
