"""Typed messages between an Engine's client side and its loop.

The client side (``engine.py``: threads, futures, streams) and the loop (``loop.py``:
scheduling, the model step, output processing) share nothing but two queues of these:
plain frozen dataclasses, no closures, no handles to objects on the other side. A
request is named by its ``rid`` (shared by its ``n`` completions) and ``index``; a
query by a number. So the loop runs in its own thread today and could run in its own
process with the queues replaced by a pipe.

    client                      inbox                          loop
    generate / stream  ->  AddRequests(NewRequest...)  ->  scheduler.add
    abort / close      ->  Abort | AbortAll | Close     ->  end requests
    stats / flush      ->  Query(what, qid)             ->  run it between steps
    hint / unpin       ->  Hint | Unpin (qid)           ->  KVCacheManager.hint / unpin, end_session
                       <-  StreamChunk                  <-  output processing, per token
                       <-  Finished                     <-  a completion ended
                       <-  QueryDone(qid, ...)          <-  the query's answer
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.cache.pins import PinInfo
from radixkv.engine.constrain import Constraint
from radixkv.engine.request import CacheControl, CompletionOutput, StreamChunk
from radixkv.engine.sampling import SamplingParams

# -- client -> loop ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NewRequest:
    """One completion to generate: the ``index``-th of request ``rid``. ``prompt_ids``
    are checked already; ``constraint`` is compiled already (off the loop), one per
    completion; ``stream``: send a StreamChunk per new text; ``cache_control``: what it
    keeps cached when it ends; ``session_id``: its session (radixkv.cache.pins)."""

    rid: str
    index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    namespace: str | None
    constraint: Constraint | None
    stream: bool
    arrival_time: float
    cache_control: tuple[CacheControl, ...] = ()
    session_id: str | None = None


@dataclass(frozen=True)
class AddRequests:
    reqs: tuple[NewRequest, ...]


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class Query:
    what: str  # a name in EngineLoop.QUERIES (its keys are the list)
    qid: int


@dataclass(frozen=True)
class Hint:
    """Protect what is cached of ``tokens`` as a hint (KVCacheManager.hint); the answer is
    its PinInfo, or None when nothing of it is cached. ``ttl`` None: the engine's hint_ttl."""

    qid: int
    tokens: tuple[int, ...]
    namespace: str | None
    ttl: float | None
    uses: int
    session_id: str | None


@dataclass(frozen=True)
class Unpin:
    """Release the entry ``pin_id`` (answer: whether there was one), or every entry of
    ``session_id`` (answer: how many)."""

    qid: int
    pin_id: str | None = None
    session_id: str | None = None


Command = AddRequests | Abort | AbortAll | Close | Query | Hint | Unpin

# -- loop -> client ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    """Completion ``index`` of request ``rid`` ended; what its RequestOutput needs.
    Request-level fields (prompt tokens, cached tokens, prompt logprobs) are the same
    in every completion's message."""

    rid: str
    index: int
    completion: CompletionOutput
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: list | None
    error: str | None
    error_param: str | None
    arrival_time: float
    token_times: tuple[float, ...]
    finish_time: float
    pin: PinInfo | None = None


@dataclass(frozen=True)
class QueryDone:
    """The answer to ``Query(qid)``: its value, or the exception it raised."""

    qid: int
    value: object = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Stopped:
    """The loop has ended (after Close, or a crash): nothing follows."""


Output = StreamChunk | Finished | QueryDone | Stopped
