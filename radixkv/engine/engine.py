"""The Engine: model, pool, prefix cache and scheduler behind a small API.

The engine loop runs in its own thread; it alone touches the pool, the tree and the
model. Callers talk to it through a command queue and get results through sinks, so
``generate`` (blocking), ``generate_async`` / ``stream`` (asyncio) and ``abort`` never
block the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import torch

from radixkv.cache.formats import KVFormat, kv_format
from radixkv.cache.pool import KVPool, PoolConfig
from radixkv.cache.manager import KVCacheManager, SeqKV
from radixkv.cache.radix import RadixCache
from radixkv.engine.constrain import Constraint, Grammar
from radixkv.engine.output import OutputProcessor
from radixkv.engine.request import CompletionOutput, Request, RequestMetrics, RequestOutput, StreamChunk, new_rid
from radixkv.engine.sampling import Sampler, SamplerState, SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.kernels import get_backend
from radixkv.model.chat_template import ChatTemplate
from radixkv.model.loader import as_dtype, load_model
from radixkv.model.registry import DEFAULT_MODEL, resolve_model
from radixkv.model.tokenizer import IncrementalDetokenizer, Tokenizer
from radixkv.validate import ceil_div, check_int, check_optional_int, is_int

logger = logging.getLogger("radixkv.engine")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; the CLI's defaults come from here.

    KV capacity: ``kv_cache_tokens`` (tokens) or ``memory_bytes`` (bytes), at most one;
    neither means 1 GiB.
    """

    model: str = DEFAULT_MODEL
    page_size: int = 16
    kv_cache_tokens: int | None = None
    memory_bytes: int | None = None
    device: str = "cpu"
    dtype: str = "float32"  # weights and activations
    kv_dtype: str = "auto"  # the KV cache's format; auto: the weights' dtype
    attention_backend: str = "auto"
    policy: str = "lru"
    enable_prefix_cache: bool = True
    chunked_prefill_size: int | None = 512
    max_batch_tokens: int = 2048
    max_running: int = 64
    debug: bool = False  # check pool/tree integrity whenever the engine goes idle

    def __post_init__(self):
        for name in ("page_size", "max_batch_tokens", "max_running"):
            check_int(name, getattr(self, name), 1)
        for name in ("kv_cache_tokens", "memory_bytes", "chunked_prefill_size"):
            check_optional_int(name, getattr(self, name), 1)
        if self.kv_cache_tokens is not None and self.memory_bytes is not None:
            raise ValueError("give at most one of kv_cache_tokens and memory_bytes")
        as_dtype(self.dtype)
        self.kv_format  # a clear error for an unknown kv_dtype

    @property
    def kv_format(self) -> KVFormat:
        return kv_format(as_dtype(self.dtype) if self.kv_dtype == "auto" else self.kv_dtype)


class _Sink:
    """Collects a request's ``n`` completions; wakes a thread, resolves a future or
    feeds a stream. Called from the engine thread only."""

    def __init__(self, rid: str, n: int, loop: asyncio.AbstractEventLoop | None = None, stream: bool = False):
        self.rid = rid
        self.children: list[Request | None] = [None] * n
        self.loop = loop
        self.done = threading.Event()
        self.future = loop.create_future() if loop is not None and not stream else None
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.result: RequestOutput | None = None
        self._left = n

    def chunk(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
              logprobs: list | None, top_logprobs: list | None) -> None:  # fmt: skip
        if self.queue is not None and (text or token_ids or finish_reason):
            chunk = StreamChunk(self.rid, index, text, token_ids, finish_reason, logprobs, top_logprobs)
            self._post(self.queue.put_nowait, chunk)

    def _post(self, fn, *args) -> None:
        """Hand ``fn(*args)`` to the caller's event loop; a caller that has gone away
        (its loop closed) simply gets nothing more."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def finished(self, index: int, req: Request) -> None:
        self.children[index] = req
        self._left -= 1
        if self._left:
            return
        self.result = _output(self.rid, self.children)
        if self.future is not None:
            self._post(_resolve, self.future, self.result)
        if self.queue is not None:
            self._post(self.queue.put_nowait, None)
        self.done.set()


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _output(rid: str, children: list[Request]) -> RequestOutput:
    first = children[0]
    stamps = [t for c in children for t in c.token_times[:1]]
    metrics = RequestMetrics(
        first.arrival_time, min(stamps, default=None), time.perf_counter(),
        [b - a for c in children for a, b in zip(c.token_times, c.token_times[1:])],
    )  # fmt: skip
    outs = [
        CompletionOutput(
            c.text, list(c.output_ids), c.finish_reason,
            c.logprobs if c.params.logprobs else None,
            c.top_logprobs if c.params.top_logprobs else None,
        )  # fmt: skip
        for c in children
    ]
    return RequestOutput(
        rid, len(first.prompt_ids), first.kv.cached_tokens or 0, outs,
        first.prompt_logprobs if first.params.prompt_logprobs_from is not None else None,
        next((c.error for c in children if c.error), None), metrics,
        next((c.error_param for c in children if c.error), None),
    )  # fmt: skip


# -- commands from client threads to the engine loop -----------------------------------
# Plain data: the loop matches on the type. A query names what to run (no closures), and
# its answer comes back through a Reply.


@dataclass(frozen=True)
class AddRequests:
    reqs: tuple[Request, ...]


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Close:
    pass


class Reply:
    """One answer from the engine thread to a waiting caller: a value or an exception."""

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


@dataclass(frozen=True)
class Query:
    what: str  # "flush" | "stats" | "check"
    reply: Reply


Command = AddRequests | Abort | AbortAll | Close | Query


class Engine:
    """``Engine(model="smollm2-135m-instruct", page_size=16, ...)``; see EngineConfig.

    Use as a context manager, or call ``close()``, to stop the engine thread.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **settings):
        self.config = cfg = EngineConfig(model=model, **settings)
        source = resolve_model(cfg.model)
        self.model = load_model(source.path, cfg.dtype, cfg.device)
        self.tokenizer = Tokenizer.load(source)
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer) if self.tokenizer.chat_template else None
        mc = self.model.config
        pool_cfg = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        page_size=cfg.page_size, kv_dtype=cfg.kv_format, device=cfg.device)  # fmt: skip
        if cfg.kv_cache_tokens is not None:
            pool_cfg["num_pages"] = ceil_div(cfg.kv_cache_tokens, cfg.page_size)
        else:
            pool_cfg["memory_bytes"] = cfg.memory_bytes or 1 << 30
        self.pool = KVPool(PoolConfig(**pool_cfg))
        self.tree = RadixCache(self.pool, cfg.page_size, cfg.policy) if cfg.enable_prefix_cache else None
        self.backend = get_backend(cfg.attention_backend, cfg.device, cfg.kv_format.dtype, as_dtype(cfg.dtype))
        self.max_context = mc.max_position_embeddings
        self.kv = KVCacheManager(self.pool, self.tree, cfg.page_size)
        self.scheduler = Scheduler(self.kv, cfg.max_batch_tokens, cfg.max_running,
                                   cfg.chunked_prefill_size)  # fmt: skip
        self.sampler = Sampler()
        self.output = OutputProcessor(self.tokenizer.eos_token_ids, self.max_context)
        self.grammar = Grammar(self.tokenizer, mc.vocab_size)  # compiles regex constraints
        self.steps = 0
        self.generated_tokens = 0
        self._commands: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="radixkv-engine", daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 namespace: str | None = None) -> RequestOutput | list[RequestOutput]:  # fmt: skip
        """Generate for one prompt (text or token ids) or a list of them; returns one
        output or a list, in order. Blocks the caller, not the engine."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"params has {len(plist)} entries for {len(batch)} prompts")
        compiled = [self.compile_constraint(sp) if isinstance(sp, SamplingParams) else None for sp in plist]
        sinks = [self._submit(p, sp, namespace, constraint=c) for p, sp, c in zip(batch, plist, compiled)]
        for sink in sinks:
            sink.done.wait()
        outs = [sink.result for sink in sinks]
        return outs[0] if single else outs

    async def generate_async(self, prompt, params: SamplingParams | None = None, namespace: str | None = None,
                             constraint: Constraint | None = None) -> RequestOutput:  # fmt: skip
        """Generate for one prompt; cancelling the awaiting task aborts the request. A
        ``params.regex`` is compiled in a worker thread unless ``constraint`` (from
        ``compile_constraint``) is given."""
        if constraint is None and params is not None and params.regex is not None:
            constraint = await asyncio.to_thread(self.compile_constraint, params)
        sink = self._submit(prompt, params, namespace, loop=asyncio.get_running_loop(), constraint=constraint)
        try:
            return await sink.future
        except asyncio.CancelledError:
            if not sink.done.is_set():
                self.abort(sink.rid)
            raise

    async def stream(self, prompt, params: SamplingParams | None = None,
                     namespace: str | None = None) -> AsyncIterator[StreamChunk]:  # fmt: skip
        """Text deltas and token ids as they are generated; never splits a character
        or emits text a stop string will cut. Closing the iterator early aborts."""
        constraint = None
        if params is not None and params.regex is not None:
            constraint = await asyncio.to_thread(self.compile_constraint, params)
        async with self.open_stream(prompt, params, namespace, constraint) as stream:
            async for chunk in stream:
                yield chunk

    def open_stream(self, prompt, params: SamplingParams | None = None, namespace: str | None = None,
                    constraint: Constraint | None = None) -> RequestStream:  # fmt: skip
        """Submit a request now and return its RequestStream (see ``stream``), which also
        knows the request id and, once exhausted, the whole RequestOutput. Call from a
        running event loop; a request with ``params.regex`` needs its ``constraint``
        compiled first (``compile_constraint``, off the loop)."""
        loop = asyncio.get_running_loop()
        return RequestStream(self, self._submit(prompt, params, namespace, loop=loop, stream=True, constraint=constraint))

    def compile_constraint(self, params: SamplingParams | None) -> Constraint | None:
        """The compiled ``params.regex`` (None without one). Takes milliseconds, up to the
        grammar engine's limits for a large pattern: call it from a worker thread, not an
        event loop. Raises ValueError naming ``regex`` for a pattern that is invalid or
        too large."""
        if params is None or params.regex is None:
            return None
        return self.grammar.compile(params.regex)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, namespace: str | None = None,
             **template_args) -> RequestOutput:  # fmt: skip
        """Generate for ``messages`` as ``chat_prompt_ids`` tokenizes them (which takes
        ``template_args``, ``special_tokens_in_content`` among them)."""
        return self.generate(self.chat_prompt_ids(messages, **template_args), params, namespace)

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

    def flush_cache(self) -> bool:
        """Empty the prefix cache. Only when no request is queued or running: returns
        False (and does nothing) otherwise."""
        return self._query("flush")

    def stats(self) -> dict:
        """Counters and gauges, read on the engine thread between steps (consistent;
        waits for the current step)."""
        return self._query("stats")

    def snapshot(self) -> dict:
        """``stats()`` read from the calling thread without waiting for the engine:
        never blocks, but fields may come from either side of a step (for metrics)."""
        return self._stats()

    def check_integrity(self) -> None:
        """Pool and tree invariants, with every running request's references counted.
        Raises IntegrityError."""
        self._query("check")

    def is_alive(self) -> bool:
        """True while the engine thread runs (False after ``close`` or a crash)."""
        return self._thread.is_alive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._commands.put(Close())
            self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- submission --------------------------------------------------------------

    def _submit(self, prompt, params, namespace, loop=None, stream=False, constraint=None) -> _Sink:
        if self._closed:
            raise RuntimeError("the engine is closed")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if (params.regex is None) != (constraint is None):
            raise ValueError("a request with regex needs its compiled constraint (compile_constraint), and only it")
        ids = self.prompt_ids(prompt)
        rid = new_rid()
        sink = _Sink(rid, params.n, loop, stream)
        reqs = []
        for i in range(params.n):
            req = Request(
                rid=rid if params.n == 1 else f"{rid}-{i}",
                prompt_ids=ids,
                params=params,
                sampler=SamplerState(params, ids, seed_offset=i),
                detok=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                kv=SeqKV(namespace),
                sink=(sink, i),
                constraint=constraint if i == 0 or constraint is None else constraint.copy(),
            )
            reqs.append(req)
        self._commands.put(AddRequests(tuple(reqs)))
        return sink

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` by the model's tokenizer (``split_special_tokens``:
        special-token text as plain text). Reads no engine state: any thread."""
        return self.tokenizer.encode(text, add_special_tokens, split_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids by the model's tokenizer. Any thread."""
        return self.tokenizer.decode(list(ids), skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``."""
        return self.model.config.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a generation (end-of-turn tokens included)."""
        return frozenset(self.tokenizer.eos_token_ids)

    def prompt_ids(self, prompt) -> list[int]:
        """``prompt`` (text or token ids) as checked token ids: not empty, in the
        vocabulary, shorter than the context and the pool. Raises ValueError/TypeError."""
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
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        capacity = self.pool.num_pages * self.pool.page_size
        if len(ids) >= capacity:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds {capacity} (raise kv_cache_tokens)")
        return ids

    # -- engine thread -----------------------------------------------------------

    def _query(self, what: str):
        """Run the named query on the engine thread between steps and return its result
        (directly once the engine is closed)."""
        if self._closed:
            return self._QUERIES[what](self)
        reply = Reply()
        self._commands.put(Query(what, reply))
        return reply.wait(self._thread.is_alive)

    def _loop(self) -> None:
        while True:
            idle = not self.scheduler.has_work()
            try:
                command = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command is not None:
                if isinstance(command, Close):
                    self._end([*self.scheduler.running, *self.scheduler.waiting], "abort")
                    return
                self._run_command(command)
                continue  # drain all commands before the next step
            if self.scheduler.has_work():
                try:
                    self._step()
                except Exception as e:  # a bug must not take the engine down: fail what is queued
                    logger.exception("engine step failed")
                    self._end([*self.scheduler.running, *self.scheduler.waiting], "error", f"{type(e).__name__}: {e}")
            elif self.config.debug:
                self._check()

    def _run_command(self, command: Command) -> None:
        if isinstance(command, AddRequests):
            for req in command.reqs:
                self.scheduler.add(req)
        elif isinstance(command, AbortAll):
            self._end([*self.scheduler.running, *self.scheduler.waiting], "abort")
        elif isinstance(command, Abort):
            self._end([r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.sink[0].rid == command.rid],
                      "abort")  # fmt: skip
        elif isinstance(command, Query):
            try:
                command.reply.set(self._QUERIES[command.what](self))
            except Exception as e:  # delivered to the caller's thread
                command.reply.set(error=e)
        else:
            raise TypeError(f"unknown engine command {type(command).__name__}")

    def _end(self, reqs: list[Request], reason: str, error: str | None = None, flush: bool = True) -> None:
        """The one way a request ends (length, stop, abort, error): take ``reqs`` out of
        the scheduler wherever they are (their computed pages still enter the cache),
        record ``reason`` and deliver their final output."""
        for req in reqs:
            self.scheduler.remove(req)
            req.finish_reason, req.error = reason, error
            self.output.deliver(req, flush)

    def _step(self) -> None:
        sched = self.scheduler
        plan = sched.schedule()
        for req in sched.stopped:
            self.output.deliver(req, flush=True)
        sched.stopped.clear()
        if not plan:
            if not sched.running and sched.waiting:  # nothing fits even in an empty pool
                self._end([sched.waiting[0]], "error", "not enough KV cache for this request")
            return
        batch = sched.build_batch(plan, self.config.device)
        prompt_lp = [s for s in plan if s.req.params.prompt_logprobs_from is not None and s.start < len(s.req.prompt_ids)]
        try:
            logits = self.model.forward(batch, self.pool, self.backend, all_logits=bool(prompt_lp))
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            self._end([s.req for s in plan], "error", f"{type(e).__name__}: {e}")
            return
        sched.advance(plan)
        self.steps += 1
        if prompt_lp:
            ends = batch.qo_indptr[1:].tolist()
            for s, end in zip(plan, ends):
                if s in prompt_lp:
                    self.output.prompt_logprobs(s.req, s.start, logits[end - s.count : end])
            logits = logits[torch.tensor(ends, device=logits.device) - 1]
        sampling = [i for i, s in enumerate(plan) if s.samples]
        if not sampling:
            return
        kept = []
        for i in sampling:
            req = plan[i].req
            error = self.output.constraint_error(req, logits.shape[1])
            if error is None:
                kept.append(i)
            else:
                req.error_param = "regex"
                self._end([req], "error", error)
        if not kept:
            return
        reqs = [plan[i].req for i in kept]
        rows = self.output.mask(logits[kept], reqs)
        result = self.sampler.sample(rows, [r.sampler for r in reqs])
        for j, req in enumerate(reqs):
            reason, flush = self.output.append(req, result.tokens[j], result.logprobs[j], result.top_logprobs[j])
            self.generated_tokens += 1
            if reason is not None:
                self._end([req], reason, flush=flush)

    def _flush(self) -> bool:
        if self.scheduler.has_work():
            return False
        self.kv.flush()
        return True

    def _stats(self) -> dict:
        tree = None
        if self.tree is not None:
            stats = self.tree.stats()
            tree = {**stats._asdict(), "hit_rate": stats.hit_rate}
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.scheduler.preemptions,
            "pool": {"pages": self.pool.num_pages, "free": self.pool.num_free(), "page_size": self.pool.page_size},
            "cache": tree,
        }

    def _check(self) -> None:
        self.kv.check(self.scheduler.owners())

    _QUERIES = {"flush": _flush, "stats": _stats, "check": _check}  # what a Query may name


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
