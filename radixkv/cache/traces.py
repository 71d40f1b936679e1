"""Request traces for the hit-rate simulator: JSONL files and seeded synthetic workloads.

A trace is a list of ``TraceRequest``. In JSONL, one request a line::

    {"tokens": [1, 2, 3], "namespace": "tenant-a", "output_tokens": 16, "priority": 0}

``tokens`` is required (``text`` needs a tokenizer, which arrives with the model);
``output_tokens`` is a count of generated tokens (fresh ids that later prompts cannot
share) or a list of the generated ids (which a later turn's prompt may repeat).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

VOCAB = 50_000  # synthetic token ids are drawn from [0, VOCAB)


@dataclass(frozen=True)
class TraceRequest:
    tokens: array  # array('i'): the prompt
    namespace: str | None = None
    output_tokens: int | array = 0
    priority: int = 0

    @property
    def num_output(self) -> int:
        return self.output_tokens if isinstance(self.output_tokens, int) else len(self.output_tokens)


def _int_list(value, where: str, field: str) -> array:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{where}: '{field}' must be a list of integer token ids")
    try:
        return array("i", value)
    except OverflowError:
        raise ValueError(f"{where}: '{field}' has a token id outside int32") from None


def parse_request(obj, where: str = "request") -> TraceRequest:
    """Validate one decoded JSON object. Raises ValueError naming the line and field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {"tokens", "text", "namespace", "output_tokens", "priority"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    if "tokens" not in obj:
        if "text" in obj:
            raise ValueError(f"{where}: 'text' needs the model's tokenizer, which radixkv sim does not load; give 'tokens'")
        raise ValueError(f"{where}: 'tokens' is required")
    tokens = _int_list(obj["tokens"], where, "tokens")
    if not tokens:
        raise ValueError(f"{where}: 'tokens' must not be empty")
    namespace = obj.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise ValueError(f"{where}: 'namespace' must be a string")
    out = obj.get("output_tokens", 0)
    if isinstance(out, list):
        out = _int_list(out, where, "output_tokens")
    elif not isinstance(out, int) or isinstance(out, bool) or out < 0:
        raise ValueError(f"{where}: 'output_tokens' must be an int >= 0 or a list of token ids")
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"{where}: 'priority' must be an int")
    return TraceRequest(tokens, namespace, out, priority)


def load_jsonl(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace. Raises ValueError naming the file and line of a bad entry."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            requests.append(parse_request(obj, where))
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


def dump_jsonl(requests: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict = {"tokens": r.tokens.tolist()}
            if r.namespace is not None:
                obj["namespace"] = r.namespace
            if r.num_output:
                obj["output_tokens"] = r.output_tokens if isinstance(r.output_tokens, int) else r.output_tokens.tolist()
            if r.priority:
                obj["priority"] = r.priority
            f.write(json.dumps(obj) + "\n")


# -- synthetic workloads ---------------------------------------------------------


def _fresh(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def _requests(prompts: list[np.ndarray]) -> list[TraceRequest]:
    return [TraceRequest(array("i", p.tobytes())) for p in prompts]


def multi_turn(conversations: int = 100, turns: int = 18, min_new: int = 50, max_new: int = 200, seed: int = 0):
    """Chats: each turn's prompt is the previous full prompt plus 50-200 new tokens.
    Conversations interleave in a random (seeded) order, turns in order."""
    rng = np.random.default_rng(seed)
    history = [np.empty(0, dtype=np.int32) for _ in range(conversations)]
    order = np.repeat(np.arange(conversations), turns)
    rng.shuffle(order)
    prompts = []
    for c in order:
        history[c] = np.concatenate([history[c], _fresh(rng, int(rng.integers(min_new, max_new + 1)))])
        prompts.append(history[c])
    return _requests(prompts)


def few_shot(prefix: int = 1000, questions: int = 200, suffix: int = 50, seed: int = 0):
    """One shared few-shot prefix followed by a different short question each time."""
    rng = np.random.default_rng(seed)
    shared = _fresh(rng, prefix)
    return _requests([np.concatenate([shared, _fresh(rng, suffix)]) for _ in range(questions)])


def branching(fanout: int = 3, depth: int = 4, step: int = 100, seed: int = 0):
    """Tree of thought: a question, then ``fanout`` continuations of ``step`` tokens per
    node down to ``depth``; each expanded node is one request, level by level."""
    rng = np.random.default_rng(seed)
    level = [_fresh(rng, step)]
    prompts = []
    for _ in range(depth):
        level = [np.concatenate([p, _fresh(rng, step)]) for p in level for _ in range(fanout)]
        prompts.extend(level)
    return _requests(prompts)


def mixed(seed: int = 0):
    """Multi-turn chat and few-shot requests interleaved in a random (seeded) order."""
    rng = np.random.default_rng(seed + 1)
    a, b = multi_turn(seed=seed), few_shot(seed=seed + 2)
    tags = np.array([0] * len(a) + [1] * len(b))
    rng.shuffle(tags)
    ia, ib = iter(a), iter(b)
    return [next(ia) if t == 0 else next(ib) for t in tags]


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "multi_turn": multi_turn,
    "few_shot": few_shot,
    "branching": branching,
    "mixed": mixed,
}


def synthetic(name: str, seed: int = 0) -> list[TraceRequest]:
    """A built-in workload by name. Raises ValueError naming the known ones."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name](seed=seed)
