"""SGLang programs on the frontend, on the real embedded model: select's choices methods
(checked against the model's logprobs computed here, apart from the runtime), gen's
constraints and ``choices``, ``with s.user():`` blocks, forks that broadcast, run
defaults and batches of tuples, ``s[name] = value``, errors that name the gen, and the
OpenAI-compatible backend against a real ``radixkv serve``."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import torch

from radixkv.engine.engine import Engine
from radixkv.engine.sampling import SamplingParams
from radixkv.frontend import (
    BackendError,
    ChoicesDecision,
    ChoicesSamplingMethod,
    EngineBackend,
    ForkGroup,
    OpenAIBackend,
    ProgramError,
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    greedy_token_selection,
    select,
    system,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
)
from radixkv.frontend.backends import _echo_score
from radixkv.server.process import ServerProcess

PAGE = 16
GREEDY = {"temperature": 0, "max_tokens": 12}
HAS_JSON_SCHEMA = "json_schema" in SamplingParams.__dataclass_fields__
HAS_RESPONSE_FORMAT = hasattr(__import__("radixkv.server.protocol").server.protocol, "ResponseFormat")


@pytest.fixture(scope="module")
def engine():
    with Engine(attention_backend="torch", kv_cache_tokens=8192, page_size=PAGE, weights="fp32") as e:  # exact mode: logprobs compared across paths
        yield e


@pytest.fixture(scope="module")
def backend(engine):
    return EngineBackend(engine)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("frontend-sglang-server") / "server.log"
    with ServerProcess("--attention-backend", "torch", "--kv-cache-tokens", "8192", "--debug", "--weights", "fp32",
                       log_path=log) as server:  # fmt: skip
        yield server
    assert server.exit_code == 0


@pytest.fixture(scope="module")
def endpoint(server):
    ep = RuntimeEndpoint(server.url)
    yield ep
    ep.close()


@pytest.fixture(scope="module")
def oai(server):
    b = OpenAIBackend(server.url + "/v1")
    yield b
    b.close()


@pytest.fixture(autouse=True)
def server_integrity_after_each_test(request):
    """A test that used the server leaves it idle with pool and tree consistent."""
    server = request.getfixturevalue("server") if "server" in request.fixturenames else None
    yield
    if server is not None:
        deadline = time.monotonic() + 30
        while (stats := httpx.get(server.url + "/stats").json())["running"] or stats["waiting"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        r = httpx.get(server.url + "/debug/integrity")
        assert r.status_code == 200, r.text


# -- select's choices methods ------------------------------------------------------------------


def position_logprobs(engine: Engine, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = 1 .. len(ids)-1, from one forward of the engine's
    model on a private pool: no cache, no sampler, no runtime."""
    from radixkv.cache import KVPool, PoolConfig
    from radixkv.model.batch import ForwardBatch, SeqInput

    c = engine.model.config
    pages = -(-len(ids) // PAGE)
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, PAGE, num_pages=pages))
    batch = ForwardBatch.build([SeqInput(ids, 0, pool.alloc(pages))], PAGE, "cpu")
    with torch.inference_mode():
        logits = engine.model.forward(batch, pool, engine.backend, all_logits=True)
    lp = torch.log_softmax(logits.double(), -1)
    return [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]


def expected_picks(engine: Engine, prefix: list[int], choices: list[str]) -> dict[str, str]:
    """What each method's definition picks, from logprobs computed here. A context seen
    before (choices that share their first tokens) keeps its first value: the same
    conditional probability, whichever forward computed it."""
    memo: dict[tuple, float] = {}
    cond, uncond = [], []
    for c in choices:
        toks = engine.tokenizer.encode(c, add_special_tokens=False)
        after = position_logprobs(engine, prefix + toks)[len(prefix) - 1 :]
        cond.append([memo.setdefault(("cond", *toks[: j + 1]), v) for j, v in enumerate(after)])
        alone = [0.0] + position_logprobs(engine, toks)  # the first token has no context: 0
        uncond.append([memo.setdefault(("alone", *toks[: j + 1]), v) for j, v in enumerate(alone)])

    def first_max(scores):
        return choices[scores.index(max(scores))]

    means = [sum(r) / len(r) for r in cond]
    width = max(map(len, cond))
    padded = [r + [sum(r) / len(r)] * (width - len(r)) for r in cond]
    left = list(range(len(choices)))
    for col in range(width):
        if len(left) == 1:
            break
        best = max(padded[i][col] for i in left)
        left = [i for i in left if padded[i][col] == best]
    lifted = [sum(a - b for a, b in zip(rc, ru)) / len(rc) for rc, ru in zip(cond, uncond)]
    return {"token_length_normalized": first_max(means), "greedy_token_selection": choices[left[0]],
            "unconditional_likelihood_normalized": first_max(lifted), "means": means}  # fmt: skip


@function
def pick(s, question, choices, method):
    s += user(question)
    s += assistant(select("choice", choices, choices_method=method))


CASES = [  # each: the three methods do not all agree (checked below)
    ("What is the capital of France? Answer with the city.",
     ["Paris", "London", "The city of Berlin", "Paris, France"]),
    ("What is the capital of India? Answer with the city.", ["New York", "New Delhi", "Mumbai", "Bangalore"]),
    ("Name a fruit.", ["apple", "an apple", "a banana", "the durian fruit"]),
]
METHODS = [token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized]


def test_choices_methods_pick_what_their_definitions_pick(backend, engine):
    for question, choices in CASES:
        picked = {}
        for method in METHODS:
            s = pick.run(question=question, choices=choices, method=method, backend=backend)
            picked[method.name] = s["choice"]
            meta = s.get_meta_info("choice")
            assert meta["choices_method"] == method.name
            assert s.messages()[-1] == {"role": "assistant", "content": s["choice"]}
        first = list(s.calls[0].prompt_ids)
        prefix = first[: len(first) - len(engine.tokenizer.encode(choices[0], add_special_tokens=False))]
        want = expected_picks(engine, prefix, choices)
        assert picked == {m.name: want[m.name] for m in METHODS}, question
        assert meta["normalized_prompt_logprobs"] == pytest.approx(want["means"], abs=1e-3)
        assert len(set(picked.values())) > 1, f"{question}: the methods agree, so this case tests nothing"
        ids = [t for _, t, _ in meta["input_token_logprobs"][2]]  # (logprob, token id, text) as SGLang
        assert ids == engine.tokenizer.encode(choices[2], add_special_tokens=False)
        assert [t[0] for t in meta["unconditional_token_logprobs"][2]][0] is None


def test_greedy_ties_shared_first_tokens_and_pads_with_the_mean(backend, engine):
    # "Paris" and "Paris, France" share their first token: tied there, so the second
    # column decides between "Paris"'s mean (its only logprob) and ","'s logprob
    choices = ["Paris, France", "Paris"]
    s = pick.run(question="What is the capital of France? Answer with the city.", choices=choices,
                 method=greedy_token_selection, backend=backend)  # fmt: skip
    matrix = s.get_meta_info("choice")["greedy_logprob_matrix"]
    assert matrix[0][0] == matrix[1][0]  # exactly: one context, one value
    assert matrix[1] == [matrix[1][0]] * len(matrix[0])  # padded with its mean
    assert s["choice"] == (choices[0] if matrix[0][1] >= matrix[1][1] else choices[1])


def test_select_over_http_picks_as_in_process(backend, endpoint):
    question, choices = CASES[2]
    for method in METHODS:
        here = pick.run(question=question, choices=choices, method=method, backend=backend)
        there = pick.run(question=question, choices=choices, method=method, backend=endpoint)
        assert here["choice"] == there["choice"]
        assert here.get_meta_info("choice")["normalized_prompt_logprobs"] == pytest.approx(
            there.get_meta_info("choice")["normalized_prompt_logprobs"], abs=1e-4)


def test_gen_with_choices_is_a_select(backend):
    @function
    def as_gen(s, method):
        s += user("Name a fruit.")
        s += assistant(gen("choice", choices=CASES[2][1], choices_method=method))

    for method in (None, greedy_token_selection):
        g = as_gen.run(method=method, backend=backend)
        sel = pick.run(question="Name a fruit.", choices=CASES[2][1], method=method or token_length_normalized,
                       backend=backend)  # fmt: skip
        assert g["choice"] == sel["choice"] and g.token_ids() == sel.token_ids()
        assert [c.kind for c in g.calls] == ["select"] * len(g.calls)
    with pytest.raises(ProgramError, match="is a select: max_tokens"):
        gen("x", choices=["a", "b"], max_tokens=3)
    with pytest.raises(ProgramError, match="temperature must be 0"):
        gen("x", choices=["a", "b"], temperature=0.7)
    with pytest.raises(ProgramError, match="choices_method needs choices"):
        gen("x", choices_method=greedy_token_selection)


class Shortest(ChoicesSamplingMethod):
    """A custom method written against SGLang's interface: the choice with fewest tokens."""

    name = "shortest"

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None):  # fmt: skip
        lengths = [len(x) for x in input_token_logprobs]
        return ChoicesDecision(choices[lengths.index(min(lengths))], {"lengths": lengths})


def test_a_custom_choices_method_and_bad_ones(backend, engine):
    choices = ["the durian fruit", "a ripe banana", "an apple"]
    s = pick.run(question="Name a fruit.", choices=choices, method=Shortest(), backend=backend)
    lengths = [len(engine.tokenizer.encode(c, add_special_tokens=False)) for c in choices]
    assert s.get_meta_info("choice")["lengths"] == lengths and len(set(lengths)) == 3
    assert s["choice"] == choices[lengths.index(min(lengths))]

    def rogue(**kw):
        return ChoicesDecision("cherry")

    with pytest.raises(ProgramError, match="returned 'cherry', not one of the choices"):
        pick.run(question="Name a fruit.", choices=["apple"], method=rogue, backend=backend)
    with pytest.raises(ProgramError, match="choices_method must be"):
        select("x", ["a"], choices_method="greedy")


# -- gen constraints ------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


@function
def person(s, schema):
    s += user("Describe a person as JSON with a name and an age.")
    s += assistant(gen("person", max_tokens=60, temperature=0, json_schema=schema))


def test_json_schema_reaches_the_runtime_as_json_text():
    g = gen("x", json_schema=SCHEMA)
    assert json.loads(g.params["json_schema"]) == SCHEMA
    assert gen("x", json_schema=json.dumps(SCHEMA)).params["json_schema"] == json.dumps(SCHEMA)
    with pytest.raises(ProgramError, match="json_schema is not valid JSON"):
        gen("x", json_schema="{nope")
    with pytest.raises(ProgramError, match="regex and json_schema are 2 constraints"):
        gen("x", regex="a", json_schema=SCHEMA)


@pytest.mark.skipif(not HAS_JSON_SCHEMA, reason="this runtime's SamplingParams has no json_schema yet")
def test_gen_with_a_json_schema_gives_a_valid_value(backend, endpoint, oai):
    outs = []
    ways = [(backend, SCHEMA), (endpoint, json.dumps(SCHEMA))] + ([(oai, SCHEMA)] if HAS_RESPONSE_FORMAT else [])
    for b, schema in ways:
        s = person.run(schema=schema, backend=b)
        value = json.loads(s["person"])
        assert set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
        outs.append(s["person"])
    assert outs == [outs[0]] * len(ways)  # one prompt, one grammar, greedy: the same text every way


def test_regex_over_every_backend(backend, endpoint, oai):
    @function
    def legs(s):
        s += user("How many legs does a spider have?")
        s += assistant(gen("n", max_tokens=6, temperature=0, regex=r"[0-9]{1,2}"))

    got = [legs.run(backend=b)["n"] for b in (backend, endpoint, oai)]
    assert re.fullmatch(r"[0-9]{1,2}", got[0]) and got == [got[0]] * 3


# -- roles as blocks ------------------------------------------------------------------------------


@function
def as_blocks(s, question):
    with s.system():
        s += "You are terse."
    with s.user():
        s += question
    with s.assistant():
        s += gen("answer", **GREEDY)
    with s.user():
        s += "Again, "
        s += "briefer."
    with s.assistant():
        s += "In short: "
        s += gen("short", max_tokens=6, temperature=0)


@function
def as_exprs(s, question):
    s += system("You are terse.")
    s += user(question)
    s += assistant(gen("answer", **GREEDY))
    s += user(["Again, ", "briefer."])
    s += assistant(["In short: ", gen("short", max_tokens=6, temperature=0)])


@function
def as_calls(s, question):
    s.system("You are terse.")
    s.user(question)
    s.assistant(gen("answer", **GREEDY))
    s.user(["Again, ", "briefer."])
    s.assistant(["In short: ", gen("short", max_tokens=6, temperature=0)])


def test_role_blocks_send_the_same_tokens_as_role_expressions(backend):
    runs = [p.run(question="What is a radix tree?", backend=backend) for p in (as_blocks, as_exprs, as_calls)]
    for s in runs[1:]:
        assert s.token_ids() == runs[0].token_ids()
        assert [c.prompt_ids for c in s.calls] == [c.prompt_ids for c in runs[0].calls]
        assert (s["answer"], s["short"]) == (runs[0]["answer"], runs[0]["short"])
        assert s.messages() == runs[0].messages()
    assert [m["role"] for m in runs[0].messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert runs[0].messages()[3]["content"] == "Again, briefer."

    @function
    def nested(s):
        with s.user():
            s += "Hi"
            with s.assistant():
                s += "Hello"

    with pytest.raises(ProgramError, match="while the user message is still open"):
        nested.run(backend=backend)


# -- forks ------------------------------------------------------------------------------------------

STYLES = ["formal", "funny", "poetic"]


@function
def forks_broadcast(s, styles):
    s += system("You write short lines.")
    s += user("Write one line about the sea.")
    s += assistant(gen("draft", **GREEDY))
    forks = s.fork(len(styles))
    forks += [user(f"Rewrite it in a {style} style.") for style in styles]  # one to each branch
    forks += assistant(gen("line", **GREEDY))  # to every branch
    forks += user("Thanks!")
    forks += lambda i: assistant(f"You're welcome ({i}).")
    forks[0] += user("One more?")
    assert isinstance(forks, ForkGroup) and len(forks) == len(styles)
    forks.join()


@function
def forks_looped(s, styles):
    s += system("You write short lines.")
    s += user("Write one line about the sea.")
    s += assistant(gen("draft", **GREEDY))
    forks = s.fork(len(styles))
    for i, (f, style) in enumerate(zip(forks, styles)):
        f += user(f"Rewrite it in a {style} style.")
        f += assistant(gen("line", **GREEDY))
        f += user("Thanks!")
        f += assistant(f"You're welcome ({i}).")
    forks.join()


def test_forks_plus_equals_broadcasts_to_every_branch(backend):
    s = forks_broadcast.run(styles=STYLES, backend=backend)
    looped = forks_looped.run(styles=STYLES, backend=backend)
    assert s["line"] == looped["line"] and len(s["line"]) == 3
    for i, (child, other) in enumerate(zip(s.children, looped.children)):
        tail = [{"role": "user", "content": f"Rewrite it in a {STYLES[i]} style."},
                {"role": "assistant", "content": child["line"]}, {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": f"You're welcome ({i})."}]  # fmt: skip
        assert other.messages()[-4:] == tail
        assert child.messages() == other.messages() + ([{"role": "user", "content": "One more?"}] if i == 0 else [])

    @function
    def uneven(s):
        s += "x"
        forks = s.fork(2)
        forks += ["a", "b", "c"]

    with pytest.raises(ProgramError, match="one expression per branch: 2 branches, 3"):
        uneven.run(backend=backend)

    @function
    def replace(s):
        s += "x"
        forks = s.fork(2)
        forks[0] = forks[1]

    with pytest.raises(ProgramError, match="cannot be replaced"):
        replace.run(backend=backend)


# -- run defaults, batches, variables -------------------------------------------------------------


@function
def three_gens(s, question):
    s += user(question)
    s += assistant_begin()
    s += gen("a")  # the run's defaults
    s += gen("b", max_tokens=3)  # its own max_tokens wins
    s += gen("c", temperature=1.0, seed=11)  # its own temperature wins
    s += assistant_end()


def test_run_defaults_apply_where_a_gen_sets_nothing(backend, engine):
    s = three_gens.run("Tell me about the sea.", backend=backend, max_new_tokens=5, temperature=0, ignore_eos=True)
    assert [c.completion_tokens for c in s.calls] == [5, 3, 5]

    def reference(prompt, **fields):
        return engine.generate([list(prompt)], SamplingParams(**fields))[0].text

    a, _, c = s.calls
    assert s["a"] == reference(a.prompt_ids, max_new_tokens=5, temperature=0, ignore_eos=True)
    sampled = reference(c.prompt_ids, max_new_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    assert s["c"] == sampled != reference(c.prompt_ids, max_new_tokens=5, temperature=0, ignore_eos=True)


def test_a_program_parameter_named_like_a_default_stays_the_programs(backend):
    @function
    def takes_temperature(s, temperature):
        s += f"The temperature is {temperature} degrees and"
        s += gen("rest", max_tokens=3, temperature=0)

    s = takes_temperature.run(temperature=21, backend=backend)
    assert s.text().startswith("The temperature is 21 degrees") and s.defaults == {}


@function
def short_answer(s, question, prefix="A:"):
    s += user(question)
    s += assistant([prefix, gen("answer")])


def test_run_batch_takes_tuples_dicts_and_defaults(backend):
    items = [("What is a tree?",), ("What is a page?", "Answer:"), {"question": "What is a cache?"}]
    states = short_answer.run_batch(items, backend=backend, num_threads=2, max_new_tokens=6, temperature=0)
    alone = [short_answer.run(*it, backend=backend, max_new_tokens=6, temperature=0) if isinstance(it, tuple)
             else short_answer.run(**it, backend=backend, max_new_tokens=6, temperature=0) for it in items]  # fmt: skip
    assert [s["answer"] for s in states] == [s["answer"] for s in alone]
    assert [s.token_ids() for s in states] == [s.token_ids() for s in alone]
    assert all(s.calls[0].completion_tokens <= 6 for s in states)
    assert states[1].messages()[-1]["content"].startswith("Answer:")
    with pytest.raises(ProgramError, match="run_batch item 1: short_answer.*too many"):
        short_answer.run_batch([("q",), ("q", "p", "extra")], backend=backend)
    with pytest.raises(ProgramError, match="item 0 must be a dict .* or a tuple"):
        short_answer.run_batch(["just a string"], backend=backend)
    with pytest.raises(ProgramError, match="unknown keywords question"):
        short_answer.run_batch([()], backend=backend, question="q")
    assert short_answer.run_batch([], backend=backend) == []


def test_setting_variables(backend):
    @function
    def sets(s):
        s["given"] = {"k": 1}
        s += "The sea is"
        s += gen("x", max_tokens=3, temperature=0)
        s["copy"] = s["x"]  # reading waits for the gen
        s["x"] = "replaced"  # in order: after the gen wrote it
        s += gen("x2", max_tokens=2, temperature=0)

    s = sets.run(backend=backend)
    assert s["given"] == {"k": 1} and s["x"] == "replaced" and "given" in s and "nope" not in s
    assert s["copy"] and s.text() == "The sea is" + s["copy"] + s["x2"]  # variables add no text
    s["after"] = 5  # a finished state still takes variables
    assert s.get_var("after") == 5
    with pytest.raises(ProgramError, match="has finished"):
        s += "more"


def test_failures_name_the_gen_and_the_field(backend, endpoint):
    @function
    def bad_regex(s):
        s += user("Hi")
        s += assistant(gen("reply", max_tokens=4, regex="(unclosed"))

    with pytest.raises(BackendError) as over_http:
        bad_regex.run(backend=endpoint)
    e = over_http.value
    assert str(e).startswith("gen('reply'): the runtime answered 400 on sampling_params.regex:")
    assert "(unclosed" in str(e) and e.status == 400 and e.param == "sampling_params.regex"
    with pytest.raises(ProgramError, match=r"^gen\('reply'\): .*regex"):
        bad_regex.run(backend=backend)

    @function
    def too_long(s):
        s += user("Hi")
        s += assistant(gen("reply", max_tokens=10**7))

    with pytest.raises(BackendError, match=r"^gen\('reply'\): the runtime answered 400 on "
                                           r"sampling_params.max_new_tokens"):  # fmt: skip
        too_long.run(backend=endpoint)


# -- the OpenAI-compatible backend ------------------------------------------------------------------


@function
def two_turns(s, question):
    s += system("You are a helpful assistant. Answer in one short sentence.")
    s += user(question)
    s += assistant(gen("first", **GREEDY))
    s += user("Why?")
    s += assistant(gen("second", **GREEDY))


def test_openai_chat_program_matches_the_engine(backend, oai):
    here = two_turns.run(question="What is a radix tree?", backend=backend)
    there = two_turns.run(question="What is a radix tree?", backend=oai)
    assert (there["first"], there["second"]) == (here["first"], here["second"])
    assert there.messages() == here.messages()
    assert [c.prompt_tokens for c in there.calls] == [c.prompt_tokens for c in here.calls]
    assert there.calls[1].cached_tokens >= PAGE  # the server's cache served the first turn
    assert there.text().startswith("system: You are a helpful assistant.")
    with pytest.raises(ProgramError, match="token ids are not known"):
        there.token_ids()
    forked = [forks_broadcast.run(styles=STYLES[:2], backend=b) for b in (backend, oai)]
    assert forked[1]["line"] == forked[0]["line"]
    assert [c.kind for c in forked[1].calls] == ["gen"]  # no prefix request over the API
    assert [c.messages() for c in forked[1].children] == [c.messages() for c in forked[0].children]


def test_openai_completion_program_matches_the_engine(engine, oai):
    @function
    def raw(s, text):
        s += text
        s += gen("more", max_tokens=8, temperature=0)

    text = "The three primary colors are"
    s = raw.run(text, backend=oai, stream=False)
    assert s["more"] == engine.generate([text], SamplingParams(max_new_tokens=8, temperature=0))[0].text
    assert s.text() == text + s["more"] and 0 < s.calls[0].completion_tokens <= 8


def test_openai_streams_and_takes_run_defaults(oai):
    streamed = two_turns.run(question="What is a cache?", backend=oai, stream=True)
    pieces = list(streamed.text_iter())
    plain = two_turns.run(question="What is a cache?", backend=oai)
    assert "".join(pieces) == streamed.text() == plain.text() and len(pieces) > 10
    assert streamed["second"] == plain["second"]

    @function
    def unset(s):
        s += user("Tell me a story.")
        s += assistant(gen("story"))

    s = unset.run(backend=oai, max_new_tokens=4, temperature=0, ignore_eos=True)
    assert s.calls[0].completion_tokens == 4 and s.get_meta_info("story")["finish_reason"] == "length"


def test_openai_refuses_what_the_api_cannot_do(oai):
    @function
    def select_in_chat(s):
        s += user("Is the sky blue?")
        s += assistant(select("yn", ["yes", "no"]))

    with pytest.raises(ProgramError, match=r"select\('yn'\): select over chat completions .* not supported.*regex"):
        select_in_chat.run(backend=oai)

    @function
    def select_in_text(s):
        s += "Is the sky blue? Answer:"
        s += select("yn", [" yes", " no"])

    # over /completions, select reads echoed prompt logprobs, which radixkv serve returns
    assert select_in_text.run(backend=oai)["yn"] in (" yes", " no")

    @function
    def continue_message(s):
        s += user("Hi")
        s += assistant(["Sure: ", gen("x", max_tokens=4)])

    with pytest.raises(ProgramError, match="first thing in an assistant message"):
        continue_message.run(backend=oai)

    @function
    def loose_text(s):
        s += "Some raw text. "
        s += user("Hi")
        s += assistant(gen("x", max_tokens=4))

    with pytest.raises(ProgramError, match="text outside any message"):
        loose_text.run(backend=oai)

    @function
    def too_long(s):
        s += user("Hi")
        s += assistant(gen("x", max_tokens=10**7))

    with pytest.raises(BackendError, match=r"^gen\('x'\): the server answered 400 on max_tokens") as e:
        too_long.run(backend=oai)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(BackendError, match="cannot reach the OpenAI-compatible server at http://127.0.0.1:9"):
        OpenAIBackend("http://127.0.0.1:9/v1")


def test_echoed_logprobs_give_the_choices_tokens():
    """``select`` over /completions reads a server's echoed prompt logprobs (OpenAI's
    legacy format): the tokens that overlap the choice's text, a token across the
    prompt's end included; the generated token left out."""
    body = {"choices": [{"text": "ab cd!", "finish_reason": "length", "logprobs": {
        "tokens": ["a", "b c", "d", "!"], "text_offset": [0, 1, 4, 5], "token_logprobs": [None, -1.5, -0.25, -3.0]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip
    score = _echo_score(body, "ab", " cd", "http://x")
    assert score.tokens == ["b c", "d"] and score.logprobs == [-1.5, -0.25]
    assert _echo_score(body, "", "ab cd", "http://x").logprobs == [None, -1.5, -0.25]
    no_prompt = {"choices": [{"text": "ab cd!", "logprobs": {"tokens": ["!"], "text_offset": [5],
                                                                "token_logprobs": [-3.0]}}]}  # fmt: skip
    with pytest.raises(BackendError, match="no logprobs for the prompt"):
        _echo_score(no_prompt, "ab", " cd", "http://x")


def test_ebnf_and_min_tokens_in_gen(backend, endpoint):
    @function
    def yes_no(s):
        s += user("Is the sky blue?")
        s += assistant(gen("a", max_tokens=4, temperature=0, ebnf='root ::= "yes" | "no"'))

    @function
    def at_least(s):
        s += user("Answer yes or no: is the sky blue?")
        s += assistant(gen("a", max_tokens=30, temperature=0, min_tokens=12))

    got = [yes_no.run(backend=b)["a"] for b in (backend, endpoint)]
    assert got[0] in ("yes", "no") and got == [got[0]] * 2
    state = at_least.run(backend=backend)
    assert state.calls[-1].completion_tokens >= 12
    with pytest.raises(ProgramError, match="regex and ebnf are 2 constraints"):
        gen("x", regex="a", ebnf='root ::= "a"')
    with pytest.raises(ProgramError, match="unexpected keyword argument 'ebnf'"):  # per gen, never a run default
        yes_no.run(backend=backend, ebnf='root ::= "a"')
