"""Every example runs on the embedded model and shows the cache at work."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pytest

from radixkv.engine.engine import Engine
from radixkv.frontend import EngineBackend
from radixkv.server.process import ServerProcess

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine():
    with Engine(attention_backend="torch", kv_cache_tokens=16384) as e:
        yield e


@pytest.fixture
def backend(engine):
    engine.flush_cache()
    return EngineBackend(engine)


def test_multi_turn_example(backend, capsys):
    state = load("multi_turn").main(["--turns", "3", "--max-tokens", "8"], backend=backend)
    cached = [c.cached_tokens for c in state.calls]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    out = capsys.readouterr().out
    assert "turn 3" in out and "assistant:" in out


def test_branching_example(backend, capsys):
    state = load("branching").main(["--branches", "2", "--max-tokens", "8"], backend=backend)
    assert len(state["idea"]) == 2 and state["best"] in ("1", "2")
    prefix = next(c for c in state.all_calls() if c.kind == "prefix")
    for child in state.children:  # each branch found the shared prefix cached
        assert child.calls[0].cached_tokens >= (prefix.prompt_tokens - 1) // 16 * 16
    assert "the model picks idea" in capsys.readouterr().out


def test_rag_example(backend, capsys):
    states, hit_rate = load("rag").main(["--questions", "4", "--max-tokens", "4"], backend=backend)
    assert len(states) == 4 and all(s["answer"] is not None for s in states)
    assert states[0].calls[0].cached_tokens == 0 and hit_rate > 0
    assert "overall" in capsys.readouterr().out


def test_agent_example_starts_a_server_and_calls_tools(capsys):
    """Run as a user would, with no --url: it starts `radixkv serve`, drives it through the
    official OpenAI client's tool calling, runs the tools locally and answers in text."""
    agent = load("agent")
    runs = agent.main(["--tasks", "2", "--max-steps", "3", "--max-tokens", "48"])
    calls = [c for run in runs for step in run.steps for c in step.calls]
    assert calls, "the agent executed no tool call"
    for call in calls:  # each call was constrained to its tool's schema, and the tool ran
        jsonschema.validate(json.loads(call.arguments), agent.SCHEMAS[call.name])
        assert not call.result.startswith("error"), call
    for run in runs:
        assert run.steps[0].tool_choice == "required" and run.steps[0].calls
        assert run.answer and not run.steps[-1].calls  # a final answer in text
        roles = [m["role"] for m in run.messages[len(agent.EXAMPLE) + 2 :]]
        assert roles[:2] == ["assistant", "tool"] and roles[-1] == "assistant"
    requests = [step for run in runs for step in run.steps]
    assert requests[0].cached_tokens == 0  # a fresh server
    for step in requests[1:]:  # each step extends the last; each task shares the tools and example turns
        if step.tool_choice != "none":  # "none" drops the tools from the system message: a new prompt
            assert step.cached_tokens >= step.prompt_tokens // 2, step
    out = capsys.readouterr().out
    assert "tool_choice=required" in out and "assistant -> " in out and "answer: " in out and "total: 2 tasks" in out


def test_agent_tools():
    agent = load("agent")
    assert agent.calculator("384,400 / 299,792") == "1.28222"
    assert agent.calculator("__import__('os')").startswith("error")
    assert json.loads(agent.weather("paris")) == {"city": "Paris", "condition": "sunny", "celsius": 18}
    assert "error" in json.loads(agent.weather("Atlantis"))
    assert agent.search_docs("priority queue").startswith("[heapq]")
    assert agent.execute("calculator", '{"expression": "2 * 21"}') == "42"
    assert agent.execute("calculator", '{"expr": "1"}').startswith("error: bad arguments")
    assert agent.execute("rm", "{}").startswith("error: no tool")
    assert [agent.tool_choice_for(i, 4) for i in range(4)] == ["required", "auto", "auto", "none"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--kv-cache-tokens", "16384") as server:
        yield server.url


def test_extract_example_gives_valid_records_and_cache_hits(server, capsys):
    extract = load("extract")
    results = extract.main(["--url", server, "--docs", "3", "--max-tokens", "96"])
    assert [x.module for x in results] == [name for name, _ in load("rag").documents()[:3]]
    for x in results:
        jsonschema.validate(x.record, extract.SCHEMA)
        assert x.finish_reason == "stop" and x.record["topic"] in extract.TOPICS
    assert results[0].cached_tokens == 0  # a fresh server
    for x in results[1:]:  # the instruction, a shared prefix, came from the cache
        assert x.cached_tokens >= 96 and x.cached_tokens < x.prompt_tokens
    out = capsys.readouterr().out
    assert "3 records, all valid" in out and out.count('"topic": ') == 3
