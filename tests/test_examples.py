"""Every example runs on the embedded model and shows the cache at work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.engine.engine import Engine
from radixkv.frontend import EngineBackend

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
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


def test_agent_example_starts_a_server_and_loops_over_tools():
    """Run as a user would, with no arguments but fewer steps: it starts `radixkv serve`,
    drives it over HTTP, prints the steps and the cache table, and stops the server."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "agent.py"), "--max-steps", "2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Observation:" in run.stdout and "select action1" in run.stdout
    total = [line for line in run.stdout.splitlines() if line.startswith("total")][0]
    assert float(total.split()[3]) > 50  # hit % over all calls: each step extends the last


def test_agent_tools():
    agent = load("agent")
    assert agent.calculator("384,400 / 299,792") == "1.28222"
    assert agent.calculator("__import__('os')").startswith("error")
    assert "384,400" in agent.lookup("the moon")
