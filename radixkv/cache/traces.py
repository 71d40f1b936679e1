"""Request traces for the hit-rate simulator: JSONL files and seeded synthetic workloads.

A trace is a list of ``TraceRequest``. In JSONL, one request a line::

    {"tokens": [1, 2, 3], "namespace": "tenant-a", "output_tokens": 16, "priority": 0}
    {"text": "Summarize: ...", "arrival": 0.25, "session": "s1", "cached_tokens": 0}
    {"messages": [{"role": "user", "content": "hi"}], "output_tokens": [42, 7]}

The prompt is exactly one of ``tokens`` (ids), ``text`` (tokenized as the server
tokenizes a /v1/completions prompt) or ``messages`` (chat messages rendered with the
model's chat template and tokenized as /v1/chat/completions does); ``text`` and
``messages`` need a ``PromptEncoder`` (``radixkv.workloads.prompt_encoder``; ``radixkv sim``
uses ``--model``'s). Optional fields:

- ``output_tokens``: a count of generated tokens (fresh ids that later prompts cannot
  share) or a list of the generated ids (which a later turn's prompt may repeat);
- ``namespace``: the cache namespace (salt or an opaque id of it): no sharing across;
- ``priority``: int, for the priority eviction policy;
- ``arrival``: seconds (float >= 0) since the trace began; all requests or none have
  one; they need not be sorted (the replay orders by arrival, ties in file order);
- ``session``: str or null, the program / conversation the request belongs to
  (breakdowns only);
- ``cached_tokens``: int >= 0, what the live run reported for it (compared, never
  used by the replay).

Any other field is an error naming the line and the field.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from radixkv.validate import is_int, is_number

VOCAB = 50_000  # synthetic token ids are drawn from [0, VOCAB)


@dataclass(frozen=True)
class TraceRequest:
    tokens: array  # array('i'): the prompt
    namespace: str | None = None
    output_tokens: int | array = 0
    priority: int = 0
    arrival: float | None = None  # seconds since the trace began
    session: str | None = None  # program / conversation id, for breakdowns
    cached_tokens: int | None = None  # what the live run reported (comparison only)

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


class PromptEncoder(Protocol):
    """Turns ``text`` / ``messages`` trace lines into prompt ids as the server would.
    Raises ValueError for input it cannot encode."""

    def encode_text(self, text: str) -> list[int]: ...

    def encode_messages(self, messages: list) -> list[int]: ...


FIELDS = ("tokens", "text", "messages", "namespace", "output_tokens", "priority", "arrival", "session",
          "cached_tokens")  # fmt: skip
PROMPT_FIELDS = ("tokens", "text", "messages")


def parse_request(obj, where: str = "request", encoder: PromptEncoder | None = None) -> TraceRequest:
    """Validate one decoded JSON object; ``text`` / ``messages`` prompts go through
    ``encoder``. Raises ValueError naming the line and field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - set(FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; a request may have {', '.join(FIELDS)}")
    given = [f for f in PROMPT_FIELDS if f in obj]
    if len(given) != 1:
        have = f"got {' and '.join(repr(f) for f in given)}" if given else "got none"
        raise ValueError(f"{where}: exactly one of 'tokens', 'text', 'messages' is required ({have})")
    if "tokens" in obj:
        tokens = _int_list(obj["tokens"], where, "tokens")
    elif "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError(f"{where}: 'text' must be a string")
        tokens = _encoded(lambda: encoder.encode_text(obj["text"]), encoder, where, "text")
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of message objects")
        tokens = _encoded(lambda: encoder.encode_messages(messages), encoder, where, "messages")
    if not tokens:
        raise ValueError(f"{where}: '{given[0]}' must not be empty")
    namespace = obj.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise ValueError(f"{where}: 'namespace' must be a string")
    out = obj.get("output_tokens", 0)
    if isinstance(out, list):
        out = _int_list(out, where, "output_tokens")
    elif not is_int(out) or out < 0:
        raise ValueError(f"{where}: 'output_tokens' must be an int >= 0 or a list of token ids")
    priority = obj.get("priority", 0)
    if not is_int(priority):
        raise ValueError(f"{where}: 'priority' must be an int")
    arrival = obj.get("arrival")
    if arrival is not None:
        if not is_number(arrival) or not math.isfinite(arrival) or arrival < 0:
            raise ValueError(f"{where}: 'arrival' must be a number of seconds >= 0")
        arrival = float(arrival)
    session = obj.get("session")
    if session is not None and not isinstance(session, str):
        raise ValueError(f"{where}: 'session' must be a string or null")
    cached = obj.get("cached_tokens")
    if cached is not None and (not is_int(cached) or cached < 0):
        raise ValueError(f"{where}: 'cached_tokens' must be an int >= 0")
    return TraceRequest(tokens, namespace, out, priority, arrival, session, cached)


def _encoded(encode: Callable[[], list[int]], encoder, where: str, field: str) -> array:
    if encoder is None:
        raise ValueError(f"{where}: '{field}' needs a tokenizer: load the trace with a PromptEncoder "
                         f"(radixkv sim uses --model's)")  # fmt: skip
    try:
        ids = encode()
    except ValueError as e:
        raise ValueError(f"{where}: '{field}' cannot be encoded: {e}") from None
    return array("i", ids)


def load_jsonl(path: str | Path, encoder: PromptEncoder | None = None) -> list[TraceRequest]:
    """Read a JSONL trace (``encoder`` for ``text`` / ``messages`` lines). Raises
    ValueError naming the file and line of a bad entry, or of the first line without an
    ``arrival`` when others have one."""
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
            requests.append((lineno, parse_request(obj, where, encoder)))
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    timed = [r.arrival is not None for _, r in requests]
    if any(timed) and not all(timed):
        lineno = next(n for (n, r) in requests if r.arrival is None)
        raise ValueError(f"{path}:{lineno}: no 'arrival', but other lines have one: give every request an arrival "
                         f"or none")  # fmt: skip
    return [r for _, r in requests]


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
            for key in ("arrival", "session", "cached_tokens"):
                if getattr(r, key) is not None:
                    obj[key] = getattr(r, key)
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
