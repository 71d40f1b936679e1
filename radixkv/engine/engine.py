"""The Engine's client side: the API callers use (threads, futures, streams).

An ``Engine`` starts an ``EngineLoop`` (loop.py: scheduling, the model step, output
processing) in its own thread and talks to it only through two queues of typed
messages (messages.py): commands in, outputs back. A dispatcher thread routes each
output to the caller's sink by request id, so ``generate`` (blocking),
``generate_async`` / ``stream`` (asyncio) and ``abort`` never block the loop, and the
loop holds nothing of the caller's.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import queue
import threading
import time
from typing import AsyncIterator, Sequence

from radixkv.cache.capture import SESSION, TraceWriter
from radixkv.cache.compress import resolve_policy
from radixkv.cache.manager import check_flush_tiers
from radixkv.cache.pins import MAX_TTL, PinInfo
from radixkv.errors import FieldError
from radixkv.engine.config import EngineConfig
from radixkv.engine.constrain import Constraint, Grammar
from radixkv.engine.loop import EngineLoop
from radixkv.engine.messages import (
    Abort, AbortAll, AddRequests, Close, Finished, Hint, NewRequest, Output, Query, QueryDone, Stopped, Unpin,
)  # fmt: skip
from radixkv.engine.request import (
    CacheControl, CompletionOutput, RequestMetrics, RequestOutput, StreamChunk, check_session_id, new_rid,
)  # fmt: skip
from radixkv.engine.sampling import SamplingParams
from radixkv.model.chat_template import ChatTemplate
from radixkv.model.registry import DEFAULT_MODEL, resolve_model
from radixkv.model.tokenizer import Tokenizer
from radixkv.validate import check_float, check_int, is_int

__all__ = ["CacheControl", "Engine", "EngineConfig", "PinInfo", "RequestStream"]


class _Sink:
    """Collects a request's ``n`` completions from the loop's messages; wakes a thread,
    resolves a future or feeds a stream. Called from the dispatcher thread only."""

    def __init__(self, rid: str, n: int, loop: asyncio.AbstractEventLoop | None = None, stream: bool = False):
        self.rid = rid
        self.parts: list[Finished | None] = [None] * n
        self.loop = loop
        self.done = threading.Event()
        self.future = loop.create_future() if loop is not None and not stream else None
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.result: RequestOutput | None = None
        self._left = n
        self.trace: tuple | None = None  # (prompt ids, namespace, priority, session) while a trace is recorded

    def chunk(self, chunk: StreamChunk) -> None:
        if self.queue is not None:
            self._post(self.queue.put_nowait, chunk)

    def _post(self, fn, *args) -> None:
        """Hand ``fn(*args)`` to the caller's event loop; a caller that has gone away
        (its loop closed) simply gets nothing more."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def finished(self, part: Finished) -> bool:
        """Record one completion's end; True once all ``n`` have ended."""
        self.parts[part.index] = part
        self._left -= 1
        if self._left:
            return False
        self.resolve(_output(self.rid, self.parts))
        return True

    def resolve(self, result: RequestOutput) -> None:
        self.result = result
        if self.future is not None:
            self._post(_resolve, self.future, self.result)
        if self.queue is not None:
            self._post(self.queue.put_nowait, None)
        self.done.set()


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _output(rid: str, parts: list[Finished]) -> RequestOutput:
    first = parts[0]
    stamps = [t for p in parts for t in p.token_times[:1]]
    metrics = RequestMetrics(
        first.arrival_time, min(stamps, default=None), max(p.finish_time for p in parts),
        [b - a for p in parts for a, b in zip(p.token_times, p.token_times[1:])],
    )  # fmt: skip
    return RequestOutput(
        rid, first.prompt_tokens, first.cached_tokens, [p.completion for p in parts], first.prompt_logprobs,
        next((p.error for p in parts if p.error), None), metrics,
        next((p.error_param for p in parts if p.error), None), next((p.pin for p in parts if p.pin), None),
    )  # fmt: skip


def _cache_controls(value) -> tuple[CacheControl, ...]:
    """``cache_control`` as a tuple: None, a CacheControl, or a list of them."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, CacheControl) else tuple(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(c, CacheControl) for c in items):
        raise FieldError("cache_control", f"cache_control must be a CacheControl or a list of them, got "
                                          f"{type(value).__name__}")  # fmt: skip
    return items


class Reply:
    """One answer from the loop to a waiting caller: a value or an exception."""

    def __init__(self):
        self._done = threading.Event()
        self.value = None
        self.error: BaseException | None = None

    def set(self, value=None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self._done.set()

    def wait(self, alive) -> object:
        """The value (or raise the error); RuntimeError if ``alive()`` turns False first."""
        while not self._done.wait(0.5):
            if not alive():
                raise RuntimeError("the engine thread has stopped")
        if self.error is not None:
            raise self.error
        return self.value


def release_openmp_workers() -> None:
    """Free the OpenMP worker threads the calling thread started (libgomp keeps a pool per
    thread that opens a parallel region; loading a model opens some). While libgomp
    manages more threads than there are cores, its workers stop spinning between parallel
    regions and sleep, so every region of a step, hundreds of them, waits for a wake-up
    (~50 us each on a 2-core VM): a decode step on the engine thread measured 16 ms with the
    loader's pool alive, 6 ms without. A no-op where the runtime has no
    ``omp_pause_resource_all`` (OpenMP 5.0)."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all  # the runtime torch has loaded
    except (OSError, AttributeError):
        return
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    pause(1)  # omp_pause_soft


class Engine:
    """``Engine(model="smollm2-135m-instruct", page_size=16, ...)``; see EngineConfig.

    Use as a context manager, or call ``close()``, to stop the engine thread.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **settings):
        self.config = cfg = EngineConfig(model=model, **settings)
        self.tokenizer = Tokenizer.load(resolve_model(cfg.model))
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer) if self.tokenizer.chat_template else None
        self._outbox: queue.Queue[Output] = queue.Queue()
        self.loop = EngineLoop(cfg, self._outbox.put, self.tokenizer)
        self.grammar = Grammar(self.tokenizer, self.loop.vocab_size)  # compiles constraints (regex, json_schema, ...)
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._replies: dict[int, Reply] = {}
        self._qids = itertools.count()
        self._closed = False
        # Set (radixkv serve --record-trace) to write every finished request as a trace line
        # (radixkv.cache.capture): the dispatcher queues it, the writer's thread writes it.
        self.trace_writer: TraceWriter | None = None
        self._thread = threading.Thread(target=self.loop.run, args=(self._commands,), name="radixkv-engine",
                                        daemon=True)  # fmt: skip
        self._dispatcher = threading.Thread(target=self._dispatch, name="radixkv-output", daemon=True)
        release_openmp_workers()  # the model was loaded here: the engine thread computes from now on
        self._thread.start()
        self._dispatcher.start()

    # The loop's objects, for in-process introspection (tests, benchmarks); the server and
    # the frontend use only the methods below.

    @property
    def model(self):
        return self.loop.model

    @property
    def pool(self):
        return self.loop.pool

    @property
    def tree(self):
        return self.loop.tree

    @property
    def backend(self):
        return self.loop.backend

    # -- public API --------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 namespace: str | None = None, *, cache_control=None,
                 session_id: str | None = None) -> RequestOutput | list[RequestOutput]:  # fmt: skip
        """Generate for one prompt (text or token ids) or a list of them; returns one
        output or a list, in order. Blocks the caller, not the engine.

        ``cache_control``: a CacheControl (or a list of them) saying what each request
        keeps cached when it ends: its prompt's prefix pinned, for a ttl, or as a hint
        (the output's ``pin`` is the entry pinned); past ``max_pinned_share`` the request
        fails at once with ``error_param`` "cache_control". ``session_id``: when a
        request ends, its whole prefix stays protected for ``session_ttl`` seconds,
        until the session's next request (advice: see radixkv.cache.pins)."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"params has {len(plist)} entries for {len(batch)} prompts")
        compiled = [self.compile_constraint(sp) if isinstance(sp, SamplingParams) else None for sp in plist]
        # every prompt checked before any is sent, then one command: the loop admits them together
        sinks = self._send([self._prepare(p, sp, namespace, constraint=c, cache_control=cache_control,
                                          session_id=session_id) for p, sp, c in zip(batch, plist, compiled)])  # fmt: skip
        for sink in sinks:
            sink.done.wait()
        outs = [sink.result for sink in sinks]
        return outs[0] if single else outs

    async def generate_async(self, prompt, params: SamplingParams | None = None, namespace: str | None = None,
                             constraint: Constraint | None = None, *, cache_control=None,
                             session_id: str | None = None) -> RequestOutput:  # fmt: skip
        """Generate for one prompt; cancelling the awaiting task aborts the request. A
        constraint (``params.grammar``) is compiled in a worker thread unless ``constraint``
        (from ``compile_constraint``) is given. ``cache_control``, ``session_id``: as in
        ``generate``."""
        if constraint is None and params is not None and params.grammar is not None:
            constraint = await asyncio.to_thread(self.compile_constraint, params)
        sink = self._submit(prompt, params, namespace, loop=asyncio.get_running_loop(), constraint=constraint,
                            cache_control=cache_control, session_id=session_id)  # fmt: skip
        try:
            return await sink.future
        except asyncio.CancelledError:
            if not sink.done.is_set():
                self.abort(sink.rid)
            raise

    async def stream(self, prompt, params: SamplingParams | None = None, namespace: str | None = None, *,
                     cache_control=None, session_id: str | None = None) -> AsyncIterator[StreamChunk]:  # fmt: skip
        """Text deltas and token ids as they are generated; never splits a character
        or emits text a stop string will cut. Closing the iterator early aborts.
        ``cache_control``, ``session_id``: as in ``generate``."""
        constraint = None
        if params is not None and params.grammar is not None:
            constraint = await asyncio.to_thread(self.compile_constraint, params)
        async with self.open_stream(prompt, params, namespace, constraint, cache_control=cache_control,
                                    session_id=session_id) as stream:  # fmt: skip
            async for chunk in stream:
                yield chunk

    def open_stream(self, prompt, params: SamplingParams | None = None, namespace: str | None = None,
                    constraint: Constraint | None = None, *, cache_control=None,
                    session_id: str | None = None) -> RequestStream:  # fmt: skip
        """Submit a request now and return its RequestStream (see ``stream``), which also
        knows the request id and, once exhausted, the whole RequestOutput. Call from a
        running event loop; a constrained request (``params.grammar``) needs its ``constraint``
        compiled first (``compile_constraint``, off the loop)."""
        loop = asyncio.get_running_loop()
        return RequestStream(self, self._submit(prompt, params, namespace, loop=loop, stream=True, constraint=constraint,
                                                cache_control=cache_control, session_id=session_id))  # fmt: skip

    def compile_constraint(self, params: SamplingParams | None) -> Constraint | None:
        """The compiled constraint of ``params`` (regex, json_schema, ebnf or choices; None
        without one). Takes microseconds for a cached grammar, milliseconds up to the
        grammar engine's limits for a new one: call it from a worker thread, not an
        event loop. Raises FieldError naming the field for a grammar that is invalid or
        too large."""
        if params is None or params.grammar is None:
            return None
        return self.grammar.compile(params.grammar)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, namespace: str | None = None, *,
             cache_control=None, session_id: str | None = None, **template_args) -> RequestOutput:  # fmt: skip
        """Generate for ``messages`` as ``chat_prompt_ids`` tokenizes them (which takes
        ``template_args``, ``special_tokens_in_content`` among them); ``cache_control``,
        ``session_id`` as in ``generate``."""
        return self.generate(self.chat_prompt_ids(messages, **template_args), params, namespace,
                             cache_control=cache_control, session_id=session_id)  # fmt: skip

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_args) -> str:
        """``messages`` as the model's chat template writes them (text, not ids). Encoding
        this text parses special-token text in message content as markers; use
        ``chat_prompt_ids`` for the prompt's ids."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **template_args)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        special_tokens_in_content: bool = False, **template_args) -> list[int]:  # fmt: skip
        """The prompt ids of ``messages`` (``tools=`` and other template variables in
        ``template_args``): the chat template's markers are special tokens; special-token
        text in messages (``<|im_end|>``) is plain text unless ``special_tokens_in_content``.
        Without such text, exactly ``tokenizer.encode(render_chat(...))``. Not checked
        against the context (generation does that); raises ValueError for a model without
        a template or messages it rejects."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        return self.chat_template.encode(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                         special_tokens_in_content=special_tokens_in_content, **template_args)

    def abort(self, rid: str) -> None:
        """Stop a request (all its ``n`` completions) now; it finishes with "abort"."""
        self._commands.put(Abort(rid))

    def abort_all(self) -> None:
        """Stop every queued and running request now (they finish with "abort"); the
        engine keeps serving what comes after."""
        self._commands.put(AbortAll())

    def flush_cache(self, tiers: str = "memory") -> bool:
        """Empty the prefix cache's tiers: ``memory`` (default: the pool's pages and the
        host tier), ``device``, ``host``, ``store`` (the KV store, which other processes
        may share) or ``all``. Only when no request is queued or running: returns False
        (and does nothing) otherwise. Raises ValueError naming ``tiers``."""
        return self._query(f"flush:{check_flush_tiers(tiers)}")

    def warm_up(self) -> int:
        """Run one prefill chunk of placeholder tokens through the model, discarded, so that
        the first request does not pay the first use of the engine thread's OpenMP team,
        the activation buffers and the weights' pages (on a 2-core CPU a cold 512-token
        chunk took 0.9-1.1 s, a warm one 0.65-0.7 s). ``radixkv serve`` calls it before
        it answers ``/health`` (``--no-warmup`` skips it), as SGLang's server warms up.
        Nothing is cached or counted. Returns the tokens run: 0 when requests are
        queued or the pool has no page free."""
        return self._query("warm_up")

    def stats(self) -> dict:
        """Counters and gauges, read on the engine thread between steps (consistent;
        waits for the current step)."""
        return self._query("stats")

    def snapshot(self) -> dict:
        """``stats()`` read from the calling thread without waiting for the engine:
        never blocks, but fields may come from either side of a step (for metrics)."""
        return self.loop.stats()

    def kv_blocks(self) -> dict:
        """With ``kv_events``: the block hashes of the pages the cache holds, per medium
        (``GPU``: recomputed from the tree; ``CPU``: the host tier), between steps. A router
        fed by this engine's events holds the same at idle. ValueError without events."""
        return self._query("kv_blocks")

    def check_integrity(self) -> None:
        """Pool and tree invariants, with every running request's references counted.
        Raises IntegrityError."""
        self._query("check")

    # -- pins, TTLs, hints, sessions (radixkv.cache.pins) --------------------------------

    def pin(self, prompt, ttl: float | None = None, namespace: str | None = None) -> PinInfo:
        """Pin the whole pages of ``prompt`` (text or token ids) in the prefix cache: its
        pages are never evicted until ``unpin(info.id)`` (with ``ttl``: for ``ttl`` seconds).
        What is not cached yet is computed first (a one-token generation). Pinning a
        pinned prefix refreshes it (the later expiry wins). Raises FieldError naming the
        field: past ``max_pinned_share`` of the pool ("pin", the message names the cap),
        a prompt shorter than a page ("prompt")."""
        if ttl is not None:
            check_float("ttl", ttl, 0.0, MAX_TTL, lo_open=True)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        out = self.generate(prompt, params, namespace, cache_control=CacheControl(ttl=ttl))
        if out.error is not None:
            field = "pin" if out.error_param == "cache_control" else out.error_param or "prompt"
            raise FieldError(field, out.error.replace("cache_control", field, 1))
        if out.pin is None:
            raise FieldError("prompt", f"prompt has {out.prompt_tokens} tokens, no whole page ({self.config.page_size}"
                                       f" tokens) to pin")  # fmt: skip
        return out.pin

    def unpin(self, pin_id: str) -> bool:
        """Release the entry ``pin_id`` (a pin, TTL, hint or session entry); False when
        there is none (unknown, expired or used up)."""
        return self._command(lambda qid: Unpin(qid, pin_id=pin_id))

    def hint(self, prompt, ttl: float | None = None, uses: int = 1, namespace: str | None = None,
             session_id: str | None = None) -> PinInfo | None:  # fmt: skip
        """Protect what is cached of ``prompt`` until ``uses`` requests that continue it
        are admitted, or ``ttl`` seconds (None: ``hint_ttl``), or ``end_session`` of
        ``session_id``: advice, given up under memory pressure (radixkv.cache.pins).
        Computes nothing; None when no whole page of it is cached."""
        ids = tuple(self.prompt_ids(prompt))
        if ttl is not None:
            check_float("ttl", ttl, 0.0, MAX_TTL, lo_open=True)
        check_int("uses", uses, 1, 1 << 20)
        check_session_id(session_id)
        return self._command(lambda qid: Hint(qid, ids, namespace, ttl, uses, session_id))

    def end_session(self, session_id: str) -> int:
        """Release every entry of ``session_id`` (its session entry and hints); how many."""
        check_session_id(session_id)
        return self._command(lambda qid: Unpin(qid, session_id=session_id))

    def pins(self) -> list[dict]:
        """Every pin, TTL, hint and session entry (id, kind, tokens, pages, expires_in in
        seconds, uses, session), oldest first: ``stats()["pins"]["entries"]``."""
        return self.stats()["pins"]["entries"]

    def is_alive(self) -> bool:
        """True while the engine thread runs (False after ``close`` or a crash)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Abort what is queued or running, stop the loop and the dispatcher."""
        if not self._closed:
            self._closed = True
            self._commands.put(Close())
            self._thread.join()
            self._dispatcher.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- submission --------------------------------------------------------------

    def _submit(self, prompt, params, namespace, loop=None, stream=False, constraint=None, cache_control=None,
                session_id=None) -> _Sink:  # fmt: skip
        return self._send([self._prepare(prompt, params, namespace, loop, stream, constraint, cache_control,
                                         session_id)])[0]  # fmt: skip

    def _send(self, prepared: list[tuple[_Sink, tuple[NewRequest, ...]]]) -> list[_Sink]:
        """Register the prepared requests' sinks and send the requests to the loop in one
        command."""
        for sink, _ in prepared:
            self._sinks[sink.rid] = sink
        self._commands.put(AddRequests(tuple(r for _, reqs in prepared for r in reqs)))
        return [sink for sink, _ in prepared]

    def _prepare(self, prompt, params, namespace, loop=None, stream=False, constraint=None, cache_control=None,
                 session_id=None) -> tuple[_Sink, tuple[NewRequest, ...]]:  # fmt: skip
        """Check one prompt and its settings (errors name the field); its sink (not yet
        registered: ``_send``) and the requests to send (``params.n`` of them)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        controls = _cache_controls(cache_control)
        check_session_id(session_id)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if (params.grammar is None) != (constraint is None):
            raise ValueError("a constrained request needs its compiled constraint (compile_constraint), and only it")
        ids = tuple(self.prompt_ids(prompt, bounded=params.kv_policy is not None, unbounded=params.kv_rerotate))
        self.check_policy(params, len(ids))
        rid = new_rid()
        sink = _Sink(rid, params.n, loop, stream)
        if self.trace_writer is not None:
            sink.trace = (ids, namespace, params.priority, SESSION.get())
        now = time.perf_counter()
        reqs = tuple(
            NewRequest(rid, i, ids, params, namespace,
                       constraint if i == 0 or constraint is None else constraint.copy(), stream, now,
                       controls, session_id)  # fmt: skip
            for i in range(params.n)
        )
        return sink, reqs

    def check_policy(self, params: SamplingParams, prompt_len: int) -> None:
        """FieldError naming the field unless ``params``' long-context policy (if any)
        applies to a prompt of ``prompt_len`` tokens on this engine. Any thread."""
        if params.kv_policy is None:
            return
        if self.loop.model.config.sliding_window is not None:
            raise FieldError("kv_policy", "kv_policy is not supported for sliding-window models yet")
        if self.config.tp > 1:  # rank 0 sees its heads' attention and keys only (radixkv.model.tp)
            raise FieldError("kv_policy", "kv_policy is not supported with tp > 1 yet")
        resolve_policy(params.kv_policy, params.kv_budget, params.kv_compress_at, self.loop.config.page_size, prompt_len,
                       params.kv_rerotate, self.max_context)  # fmt: skip

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` by the model's tokenizer (``split_special_tokens``:
        special-token text as plain text). Reads no engine state: any thread."""
        return self.tokenizer.encode(text, add_special_tokens, split_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids by the model's tokenizer. Any thread."""
        return self.tokenizer.decode(list(ids), skip_special_tokens)

    @property
    def max_context(self) -> int:
        """The context length in tokens (prompt and output together): the engine's
        ``context_length``, or the model's trained context. A ``kv_rerotate`` request
        bounds positions, not tokens: it may run past this."""
        return self.loop.max_context

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``."""
        return self.loop.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a generation (end-of-turn tokens included)."""
        return frozenset(self.tokenizer.eos_token_ids)

    def prompt_ids(self, prompt, bounded: bool = False, unbounded: bool = False) -> list[int]:
        """``prompt`` (text or token ids) as checked token ids: not empty, in the
        vocabulary, shorter than the context (unless ``kv_rerotate`` bounds its
        positions: ``unbounded``) and (unless a long-context policy bounds its KV:
        ``bounded``) than the pool. Raises ValueError/TypeError."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError("a prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        if len(ids) >= self.max_context and not unbounded:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        capacity = self.loop.capacity_tokens
        if len(ids) >= capacity and not bounded:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds {capacity} (raise kv_cache_tokens)")
        return ids

    # -- talking to the loop ---------------------------------------------------------

    def _query(self, what: str):
        """Run the named query on the loop between steps and return its result
        (directly once the engine is closed)."""
        if self._closed:
            return EngineLoop.QUERIES[what](self.loop)
        return self._command(lambda qid: Query(what, qid))

    def _command(self, make):
        """Send ``make(qid)`` (a Query, Hint or Unpin) to the loop and return its answer."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        qid = next(self._qids)
        reply = self._replies[qid] = Reply()
        self._commands.put(make(qid))
        try:
            return reply.wait(self._thread.is_alive)
        finally:
            self._replies.pop(qid, None)

    def _trace(self, sink: _Sink) -> None:
        """Queue a finished request's trace line (the first completion's ids; a failed
        request is left out). Dispatcher thread."""
        out = sink.result
        if out is None or out.error is not None:
            return
        ids, namespace, priority, session = sink.trace
        self.trace_writer.record(ids, out.outputs[0].token_ids, salt=namespace, priority=priority, session=session,
                                 arrival=out.metrics.arrival_time if out.metrics else None,
                                 cached_tokens=out.cached_tokens)  # fmt: skip

    def _dispatch(self) -> None:
        """The dispatcher thread: route each output of the loop to its sink or reply.
        When the loop stops, whatever still waits fails instead of hanging."""
        while True:
            msg = self._outbox.get()
            if isinstance(msg, StreamChunk):
                sink = self._sinks.get(msg.rid)
                if sink is not None:
                    sink.chunk(msg)
            elif isinstance(msg, Finished):
                sink = self._sinks.get(msg.rid)
                if sink is not None and sink.finished(msg):
                    del self._sinks[msg.rid]
                    if sink.trace is not None and self.trace_writer is not None:
                        self._trace(sink)
            elif isinstance(msg, QueryDone):
                reply = self._replies.get(msg.qid)
                if reply is not None:
                    reply.set(msg.value, msg.error)
            elif isinstance(msg, Stopped):
                for rid, sink in list(self._sinks.items()):
                    ended = [CompletionOutput("", [], "error")] * len(sink.parts)
                    sink.resolve(RequestOutput(rid, 0, 0, ended, error="the engine loop has stopped"))
                self._sinks.clear()
                for reply in list(self._replies.values()):
                    reply.set(error=RuntimeError("the engine loop has stopped"))
                return


class RequestStream:
    """One streamed request: ``async for chunk in stream`` yields StreamChunks until the
    request ends; ``output`` is its RequestOutput afterwards. Leaving an ``async with``
    block (or calling ``abort``) before the end aborts the request."""

    def __init__(self, engine: Engine, sink: _Sink):
        self._engine = engine
        self._sink = sink
        self.rid = sink.rid

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        item = await self._sink.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    @property
    def output(self) -> RequestOutput | None:
        return self._sink.result

    def abort(self) -> None:
        if not self._sink.done.is_set():
            self._engine.abort(self.rid)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()
