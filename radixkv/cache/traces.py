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

import itertools
import json
import math
from array import array
from dataclasses import dataclass, replace
from functools import partial
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


def _json_lines(path: str | Path):
    """``(lineno, where, object)`` for each non-empty line of a JSONL file; ValueError
    naming ``path:line`` for a line that is not JSON."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield lineno, where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None


def load_jsonl(path: str | Path, encoder: PromptEncoder | None = None) -> list[TraceRequest]:
    """Read a JSONL trace (``encoder`` for ``text`` / ``messages`` lines). Raises
    ValueError naming the file and line of a bad entry, or of the first line without an
    ``arrival`` when others have one."""
    requests = [(lineno, parse_request(obj, where, encoder)) for lineno, where, obj in _json_lines(path)]
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    timed = [r.arrival is not None for _, r in requests]
    if any(timed) and not all(timed):
        lineno = next(n for (n, r) in requests if r.arrival is None)
        raise ValueError(f"{path}:{lineno}: no 'arrival', but other lines have one: give every request an arrival "
                         f"or none")  # fmt: skip
    return [r for _, r in requests]


# -- Mooncake traces ---------------------------------------------------------------

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512  # the block size of Mooncake's released traces
_INT32_LIMIT = 2**31


def parse_mooncake(obj, where: str = "request", block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                   outputs: bool = True) -> TraceRequest:  # fmt: skip
    """One Mooncake line as a request (``load_mooncake``). Raises ValueError naming
    ``where`` and the field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - set(MOONCAKE_FIELDS)
    missing = [f for f in MOONCAKE_FIELDS if f not in obj]
    if unknown or missing:
        detail = f"unknown field(s) {sorted(unknown)}" if unknown else f"missing field(s) {missing}"
        raise ValueError(f"{where}: {detail}; a Mooncake request has exactly {', '.join(MOONCAKE_FIELDS)}")
    stamp = obj["timestamp"]
    if not is_number(stamp) or not math.isfinite(stamp) or stamp < 0:
        raise ValueError(f"{where}: 'timestamp' must be a number of milliseconds >= 0")
    length = obj["input_length"]
    if not is_int(length) or length < 1:
        raise ValueError(f"{where}: 'input_length' must be an int >= 1")
    out = obj["output_length"]
    if not is_int(out) or out < 0:
        raise ValueError(f"{where}: 'output_length' must be an int >= 0")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids or not all(is_int(h) and h >= 0 for h in ids):
        raise ValueError(f"{where}: 'hash_ids' must be a non-empty list of block ids (ints >= 0)")
    if length > len(ids) * block_tokens:
        raise ValueError(f"{where}: 'input_length' {length} exceeds its {len(ids)} hash_ids of {block_tokens} "
                         f"tokens ({len(ids) * block_tokens})")  # fmt: skip
    blocks = ids[: -(-length // block_tokens)]  # a longer list's unused tail is cut with the prompt
    if (max(blocks) + 1) * block_tokens > _INT32_LIMIT:
        raise ValueError(f"{where}: block id {max(blocks)} times {block_tokens} tokens per block overflows the "
                         f"int32 token ids; use a smaller block_tokens")  # fmt: skip
    starts = np.asarray(blocks, dtype=np.int64) * block_tokens
    tokens = (starts[:, None] + np.arange(block_tokens, dtype=np.int64)).ravel()[:length].astype(np.int32)
    return TraceRequest(array("i", tokens.tobytes()), output_tokens=out if outputs else 0, arrival=stamp / 1000)


def load_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, outputs: bool = True,
                  limit: int | None = None) -> list[TraceRequest]:  # fmt: skip
    """Read a Mooncake trace (kvcache-ai/Mooncake, FAST'25), one request a line::

        {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49]}

    Each hash id stands for one block of ``block_tokens`` prompt tokens (equal ids are
    equal blocks, and an id encodes its whole prefix); here block ``h`` becomes the
    token ids ``h * block_tokens .. h * block_tokens + block_tokens - 1`` (distinct per
    id), and the prompt is cut to ``input_length`` (the last block may be partial):

        hash_ids     [  7        |  9        |  4   ...  ]
        tokens       [7B .. 8B-1 | 9B .. 10B-1| 4B .. 4B+r-1]   B = block_tokens,
                                                  r = input_length - 2B

    ``output_tokens`` is ``output_length`` (a count: fresh ids that no prompt repeats;
    the next turn's own hash ids stand for what a conversation reuses of it) with
    ``outputs``, else 0; ``arrival`` is ``timestamp`` / 1000 (seconds). ``limit``: read
    at most that many requests. Raises ValueError naming the file, line and field of a
    bad line (``input_length`` above its blocks' tokens included), or when block ids
    times ``block_tokens`` overflow int32 token ids.
    """
    if not is_int(block_tokens) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    if limit is not None and (not is_int(limit) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
    lines = itertools.islice(_json_lines(path), limit)  # lines past the limit are not read
    requests = [parse_mooncake(obj, where, block_tokens, outputs) for _, where, obj in lines]
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


TRACE_FORMATS = ("auto", "radixkv", "mooncake")


def trace_format(path: str | Path) -> str:
    """``"mooncake"`` when the first non-empty line of ``path`` is a JSON object with
    ``hash_ids``, else ``"radixkv"`` (whose loader then reports what is wrong). Reads
    one line; raises OSError for a file that cannot be read."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return "radixkv"
                return "mooncake" if isinstance(obj, dict) and "hash_ids" in obj else "radixkv"
    return "radixkv"


def load_trace(path: str | Path, fmt: str = "auto", encoder: PromptEncoder | None = None,
               **mooncake) -> list[TraceRequest]:  # fmt: skip
    """Read a trace file of format ``fmt`` (``TRACE_FORMATS``; ``auto``: ``trace_format``):
    ``load_jsonl`` with ``encoder``, or ``load_mooncake`` with ``mooncake``'s keywords.
    Raises ValueError for an unknown format or a bad line."""
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"trace format must be one of {', '.join(TRACE_FORMATS)}, got {fmt!r}")
    if fmt == "auto":
        fmt = trace_format(path)
    return load_mooncake(path, **mooncake) if fmt == "mooncake" else load_jsonl(path, encoder)


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


# The timed workloads' clock, a chat service: conversations start as a Poisson process
# (CONVERSATION_RATE a second), a conversation's next turn arrives a think time after
# its previous turn (lognormal: median THINK_MEDIAN_S, THINK_SIGMA the spread of its
# log), and few-shot questions arrive as a Poisson process of their own (QUESTION_RATE
# a second). The think time includes reading the previous answer (the traces have no
# outputs), so it counts from the previous turn's arrival.
CONVERSATION_RATE = 0.1
THINK_MEDIAN_S = 30.0
THINK_SIGMA = 0.8
QUESTION_RATE = 0.2


def _clock(seed: int) -> np.random.Generator:
    """The arrival times' own stream: a timed workload has the same prompts as the
    untimed one of its seed."""
    return np.random.default_rng((seed, 0x7143))


def _poisson(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process of ``rate`` per second from 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def _in_arrival_order(requests: list[TraceRequest], arrival) -> list[TraceRequest]:
    """``requests`` with their ``arrival`` set, sorted by it (ties in the given order)."""
    order = sorted(range(len(requests)), key=lambda i: (arrival[i], i))
    return [replace(requests[i], arrival=float(arrival[i])) for i in order]


def multi_turn(conversations: int = 100, turns: int = 18, min_new: int = 50, max_new: int = 200, seed: int = 0,
               arrivals: bool = False, conversation_rate: float = CONVERSATION_RATE,
               think_median: float = THINK_MEDIAN_S, think_sigma: float = THINK_SIGMA):  # fmt: skip
    """Chats: each turn's prompt is the previous full prompt plus 50-200 new tokens.
    Conversations interleave in a random (seeded) order, turns in order.

    With ``arrivals``, the same prompts with arrival times, in arrival order: the
    conversations start as a Poisson process of ``conversation_rate`` per second, and
    each next turn arrives a think time after the previous one (lognormal, median
    ``think_median`` s, ``think_sigma`` the standard deviation of its log)."""
    rng = np.random.default_rng(seed)
    history = [np.empty(0, dtype=np.int32) for _ in range(conversations)]
    order = np.repeat(np.arange(conversations), turns)
    rng.shuffle(order)
    prompts = []
    for c in order:
        history[c] = np.concatenate([history[c], _fresh(rng, int(rng.integers(min_new, max_new + 1)))])
        prompts.append(history[c])
    if not arrivals:
        return _requests(prompts)
    if not (think_median > 0 and think_sigma >= 0):
        raise ValueError(f"think_median must be > 0 and think_sigma >= 0, got {think_median!r}, {think_sigma!r}")
    clock = _clock(seed)
    start = _poisson(clock, conversation_rate, conversations)
    think = clock.lognormal(math.log(think_median), think_sigma, size=(conversations, max(turns - 1, 0)))
    at = np.concatenate([start[:, None], start[:, None] + np.cumsum(think, axis=1)], axis=1)  # [conversation, turn]
    turn = [0] * conversations
    arrival = []
    for c in order:
        arrival.append(at[c, turn[c]])
        turn[c] += 1
    return _in_arrival_order(_requests(prompts), arrival)


def few_shot(prefix: int = 1000, questions: int = 200, suffix: int = 50, seed: int = 0, arrivals: bool = False,
             rate: float = QUESTION_RATE):  # fmt: skip
    """One shared few-shot prefix followed by a different short question each time;
    with ``arrivals``, the questions arrive as a Poisson process of ``rate`` a second."""
    rng = np.random.default_rng(seed)
    shared = _fresh(rng, prefix)
    requests = _requests([np.concatenate([shared, _fresh(rng, suffix)]) for _ in range(questions)])
    return _in_arrival_order(requests, _poisson(_clock(seed), rate, questions)) if arrivals else requests


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


def mixed(seed: int = 0, arrivals: bool = False):
    """Multi-turn chat and few-shot requests interleaved in a random (seeded) order;
    with ``arrivals``, both timed (``multi_turn``, ``few_shot``) and merged by arrival."""
    if arrivals:
        merged = multi_turn(seed=seed, arrivals=True) + few_shot(seed=seed + 2, arrivals=True)
        return sorted(merged, key=lambda r: r.arrival)  # stable: chats first on a tie
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
    # the same prompts with a chat service's arrival times (CONVERSATION_RATE and below)
    "multi_turn_timed": partial(multi_turn, arrivals=True),
    "mixed_timed": partial(mixed, arrivals=True),
}


def synthetic(name: str, seed: int = 0) -> list[TraceRequest]:
    """A built-in workload by name. Raises ValueError naming the known ones."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name](seed=seed)
