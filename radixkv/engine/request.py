"""A request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import itertools
import time
from array import array
from dataclasses import dataclass, field

from radixkv.cache.capture import MAX_SESSION_CHARS
from radixkv.cache.manager import SeqKV
from radixkv.cache.pins import MAX_TTL, PinInfo
from radixkv.engine.constrain import Constraint
from radixkv.engine.sampling import SamplerState, SamplingParams
from radixkv.errors import FieldError
from radixkv.model.tokenizer import IncrementalDetokenizer
from radixkv.validate import check_bool, check_float, check_int, check_optional_int

_ids = itertools.count()


def new_rid() -> str:
    return f"req-{next(_ids)}"


@dataclass
class Request:
    """One sequence being generated.

    ``tokens`` is the prompt followed by what has been generated so far. ``kv`` is its
    KV memory (page table, locked node, computed and published counts, cache namespace),
    which only the ``KVCacheManager`` changes:

        tokens   |======= prompt =======|==== output ====|
                 |== kv.computed (KV in kv.pages) ==|todo|
    """

    rid: str  # the caller's request id, shared by its n completions
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SamplerState
    detok: IncrementalDetokenizer
    kv: SeqKV = field(default_factory=SeqKV)
    tokens: array = field(default_factory=lambda: array("i"))
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_param: str | None = None  # the request field at fault when ``error`` is the client's doing
    constraint: Constraint | None = None  # when the request has a regex
    text: str = ""
    emitted: int = 0  # characters of ``text`` already streamed
    emitted_tokens: int = 0
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    index: int = 0  # which of the request's n completions
    stream: bool = False  # send a StreamChunk per new text (see output.py)
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # perf_counter when each output token was sampled
    # what the request leaves protected in the cache when it ends (radixkv.cache.pins): its
    # CacheControl entries, their claims on the pin cap, the pin it made; its session's entry
    cache_control: tuple[CacheControl, ...] = ()
    claims: dict = field(default_factory=dict)  # cache_control index -> PendingPin
    pin: PinInfo | None = None
    session_id: str | None = None
    rank: tuple[int, int] | None = None  # (its program's birth, its admission): set at its first admission

    def __post_init__(self):
        if not self.tokens:
            self.tokens = array("i", self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class CacheControl:
    """What a request keeps in the prefix cache when it ends (radixkv.cache.pins): the
    whole pages of its first ``upto`` prompt tokens (None: the whole prompt), pinned
    (``ttl`` None: until unpinned; else for ``ttl`` seconds), or with ``hint`` protected
    as advice until ``uses`` requests continue it, or for ``ttl`` seconds (None: the
    engine's ``hint_ttl``). Raises FieldError naming the field."""

    ttl: float | None = None
    upto: int | None = None
    hint: bool = False
    uses: int = 1

    def __post_init__(self):
        check_bool("cache_control.hint", self.hint)
        if self.ttl is not None:
            check_float("cache_control.ttl", self.ttl, 0.0, MAX_TTL, lo_open=True)
        check_optional_int("cache_control.upto", self.upto, 1)
        check_int("cache_control.uses", self.uses, 1, 1 << 20)


def check_session_id(session_id) -> str | None:
    """``session_id`` when None or a string of 1 to MAX_SESSION_CHARS characters, else FieldError."""
    if session_id is not None and (not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_CHARS):
        raise FieldError("session_id", f"session_id must be a string of 1 to {MAX_SESSION_CHARS} characters, got "
                                       f"{session_id!r:.80}")  # fmt: skip
    return session_id


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Timings of one request, in seconds (``time.perf_counter`` clock)."""

    arrival_time: float
    first_token_time: float | None  # None when no token was generated
    finish_time: float
    inter_token_latencies: list[float]  # gaps between consecutive tokens of each completion

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt: ``outputs`` holds ``n`` completions."""

    rid: str
    prompt_tokens: int
    cached_tokens: int
    outputs: list[CompletionOutput]
    prompt_logprobs: list[float] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    error_param: str | None = None  # set when the error is the request's own (e.g. "regex"), not a fault
    pin: PinInfo | None = None  # the entry its CacheControl pinned (the first completion's), if any

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(frozen=True)
class StreamChunk:
    """New text and token ids of one completion since the last chunk."""

    rid: str
    index: int  # which of the n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # of token_ids, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None
