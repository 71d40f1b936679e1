"""Agents through the official OpenAI client against a real `radixkv serve` process:
structured output (response_format), tool calling (tools, tool_choice, streaming),
logit_bias, min_tokens, best_of, and a 400 for every OpenAI field radixkv cannot honour.

The embedded SmolLM2 has no tool format in its chat template, so tool calls go through
the generic format (radixkv/server/tools.py) and the constraint makes them valid.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from radixkv.server.process import ServerProcess
from radixkv.server.tools import ToolStream, parse_tool_calls, tool_grammar, tool_spec
from tests.test_server import integrity_after_each_test, wait_idle  # noqa: F401  (the autouse fixture)

MODEL = "smollm2-135m-instruct"
KEY = "agents-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--attention-backend", "torch", "--kv-cache-tokens", "8192", "--api-key", KEY, "--debug",
                       log_path=tmp_path_factory.mktemp("agents") / "server.log") as server:  # fmt: skip
        yield server.url
    assert server.exit_code == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


# -- structured output ------------------------------------------------------------------------

SCHEMAS = {
    "nested object with an enum": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "address", "role"], "additionalProperties": False,
    },
    "array of bounded numbers": {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                                  "minItems": 2, "maxItems": 4},
                       "mean": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["scores", "mean"], "additionalProperties": False,
    },
    "booleans and strings": {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 40},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
        "required": ["answer", "reason", "tags"], "additionalProperties": False,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_schema_output_validates(client, name, sampled):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Give an example record ({name}) as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}},
        max_tokens=160, temperature=1.0 if sampled else 0, seed=7,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode_and_its_errors(client, http):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}],
                                       response_format={"type": "json_object"}, max_tokens=120, temperature=0)  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for body, param in [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
         "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "response_format"),
    ]:  # fmt: skip
        resp = http.post("/v1/chat/completions", json={**chat, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_regex_and_choices_through_the_client(client):
    r = client.completions.create(model=MODEL, prompt="The year the war ended:", max_tokens=12, temperature=0.8,
                                  seed=1, n=3, extra_body={"regex": r"19[0-9]{2}"})  # fmt: skip
    assert all(re.fullmatch(r"19[0-9]{2}", c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=5,
                                       temperature=0, extra_body={"ebnf": 'root ::= "yes" | "no"'})  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")


# -- tool calling -----------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def _check_calls(calls, names=None):
    assert calls, "no tool_calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])  # fmt: skip
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_tool_choice_required_and_named_give_valid_calls(client, choice, sampled):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, max_tokens=80, temperature=0.9 if sampled else 0,
                                       seed=3)  # fmt: skip
    msg = r.choices[0].message
    names = {"add"} if isinstance(choice, dict) else None
    _check_calls(msg.tool_calls, names)
    assert len(msg.tool_calls) == 1 and msg.content is None
    assert r.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_assemble_into_the_same_calls(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, reasons, content = {}, [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:  # OpenAI's accumulation: by index, arguments appended
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assembled = [calls[i] for i in sorted(calls)]
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
    assert assembled == expected and content == ""
    assert reasons[-1] == whole.finish_reason


def test_async_client_tool_calls_and_a_conversation_turn(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0) as aclient:
            first = await aclient.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                          max_tokens=60, temperature=0)  # fmt: skip
            call = first.choices[0].message.tool_calls[0]
            turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
            second = await aclient.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                                           max_tokens=30, temperature=0)  # fmt: skip
            return call, second

    call, second = asyncio.run(run())
    _check_calls([call], {"get_weather"})
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_auto_lets_the_model_answer_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                                       max_tokens=20, temperature=0)  # fmt: skip
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    if msg.tool_calls:
        _check_calls(msg.tool_calls)


def test_the_tool_grammar_and_parser_agree():
    """The grammar's sentences parse back into the calls (no model involved)."""
    import llguidance

    spec = tool_spec(TOOLS, "required", True)
    grammar = llguidance.grammar_from("lark", tool_grammar(spec))
    assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    stream, got, shown = ToolStream(), [], ""
    for i in range(0, len(text), 7):  # pieces that cut the markers
        t, c = stream.feed(text[i : i + 7])
        got += c
        shown += t
    t, c = stream.feed("", final=True)
    got, shown = got + c, shown + t
    assert shown == "" and [c["function"]["arguments"] for c in got] == [c["function"]["arguments"] for c in calls]
    assert parse_tool_calls("no calls here <tool_call>not json</tool_call>")[1] == []


BAD_TOOLS = [
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("unknown tool named", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("bad tool_choice", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("tool not a function", {"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ("tools and response_format", {"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", [b[1:] for b in BAD_TOOLS], ids=[b[0] for b in BAD_TOOLS])
def test_bad_tools_get_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- sampling fields ----------------------------------------------------------------------------


def test_logit_bias_and_min_tokens(client, http):
    tok = http.post("/tokenize", json={"text": " banana"}).json()["tokens"][0]
    r = client.completions.create(model=MODEL, prompt="Fruit:", max_tokens=5, temperature=0,
                                  logit_bias={str(tok): 100})  # fmt: skip
    assert r.choices[0].text == " banana" * 5
    plain = client.completions.create(model=MODEL, prompt="Fruit:", max_tokens=5, temperature=0, logprobs=0)
    first = http.post("/tokenize", json={"text": plain.choices[0].text}).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt="Fruit:", max_tokens=5, temperature=0,
                                       logit_bias={str(first): -100})  # fmt: skip
    assert banned.choices[0].text != plain.choices[0].text
    # "No." ends at once; min_tokens keeps EOS away until 12 tokens are out
    ask = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]
    short = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0)
    assert short.usage.completion_tokens < 12 and short.choices[0].finish_reason == "stop"
    long = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": 12})  # fmt: skip
    assert long.usage.completion_tokens >= 12
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)


def test_best_of_returns_the_samples_with_the_best_mean_logprob(client):
    kw = dict(model=MODEL, prompt="A short poem about the sea:", max_tokens=8, temperature=1.0, seed=11)
    every = client.completions.create(**kw, n=4, logprobs=0).choices
    best = client.completions.create(**kw, n=2, best_of=4).choices
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every}
    assert [c.text for c in best] == sorted(mean, key=mean.get, reverse=True)[:2]
    assert [c.index for c in best] == [0, 1] and best[0].logprobs is None


UNSUPPORTED = [
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"metadata": {"k": "v"}}, "metadata"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"some_new_field": 1}, "some_new_field"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 30, "max_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"priority": 2**40}, "priority"),
]


@pytest.mark.parametrize("path, extra, param", UNSUPPORTED, ids=[u[2] + " " + u[0] for u in UNSUPPORTED])
def test_every_unhonoured_field_is_a_400_naming_it(http, path, extra, param):
    base = {"model": MODEL, "max_tokens": 5}
    base.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": ASK})
    r = http.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_accepted_labels_are_honoured_not_refused(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0, user="u-1",
                                       store=False, service_tier="auto", modalities=["text"],
                                       extra_body={"safety_identifier": "s-1", "prompt_cache_key": "k", "priority": 5})  # fmt: skip
    assert r.choices[0].message.content is not None


def test_echo_with_logprobs_scores_the_prompt(client, http):
    """OpenAI's scoring call: the prompt's tokens come back with their logprobs (what a
    program's select needs over the OpenAI API)."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    n = len(http.post("/tokenize", json={"text": prompt}).json()["tokens"])
    assert "".join(lp.tokens[:n]) == prompt and r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    native = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0, "prompt_logprobs_from": 0}}).json()["meta_info"]["prompt_logprobs"]
    assert lp.token_logprobs[1:n] == pytest.approx(native[1:n], abs=1e-4)
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[n] == len(prompt)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_tool_format_and_the_generic_messages():
    from radixkv.server.tools import generic_messages, tool_format

    hermes = "{% if tools %}<tools>{{ tools }}</tools> answer in <tool_call></tool_call>{% endif %}"
    assert tool_format(hermes) == "hermes" and tool_format("{{ messages }}") == "generic" and tool_format(None) == "generic"
    spec = tool_spec(TOOLS, "auto", True)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = generic_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "3"}], spec)  # fmt: skip
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in msgs[0]["content"]
    assert parse_tool_calls(msgs[2]["content"])[1][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert msgs[3]["content"] == "<tool_response>\n3\n</tool_response>"
    assert generic_messages([{"role": "user", "content": "hi"}], tool_spec(TOOLS, "none", None)) == [
        {"role": "user", "content": "hi"}]  # "none": no tools in the prompt
