"""The HTTP server: a plain ASGI application over one Engine, run by uvicorn.

Routes (everything but /health needs ``Authorization: Bearer KEY`` when an API key is set):

    POST /v1/completions        OpenAI completions (streaming with SSE)
    POST /v1/chat/completions   OpenAI chat completions (the model's chat template)
    GET  /v1/models             the one served model
    POST /generate              native: text or input_ids, SamplingParams by name
    POST /flush_cache           empty the prefix cache: pool and host tier; ?tiers=device|host|store|all
                                (409 while requests run)
    GET  /metrics               Prometheus text format
    GET  /health                200 while the engine thread lives
    GET  /stats                 Engine.stats() as JSON
    GET  /debug/integrity       pool and tree invariants (500 if broken)
    GET  /model_info            context length, vocabulary, EOS ids, page size
    POST /tokenize              text -> token ids (what program frontends build prompts from)
    POST /render_chat           messages -> the chat template's text and the prompt's token ids

In chat requests, special-token text inside messages (``<|im_end|>``) is tokenized as plain
text, never as role markers, unless the request sets ``special_tokens_in_content``; raw
prompts (/v1/completions, /generate) are the caller's own template and keep it special.

The event loop never waits for the model: requests go to the engine thread and come
back through futures and queues; blocking engine calls run in worker threads. A
client that disconnects aborts its requests (their pages go back to the pool).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec

from radixkv.cache.manager import check_flush_tiers
from radixkv.engine.engine import Engine, RequestStream
from radixkv.engine.request import RequestOutput, StreamChunk
from radixkv.errors import FieldError, IntegrityError
from radixkv.server import protocol as P
from radixkv.server.metrics import CONTENT_TYPE, Metrics
from radixkv.validate import check_int

logger = logging.getLogger("radixkv.server")
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


@dataclass(frozen=True)
class ServerConfig:
    """HTTP settings; ``radixkv serve``'s defaults come from here."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the engine's model name
    max_body_bytes: int = 8 << 20
    max_fanout: int = 128  # prompts x n of one call
    cache_salt_header_only: bool = False  # refuse a body cache_salt: only a gateway's X-Cache-Salt counts
    graceful_shutdown_seconds: float = 10.0
    log_level: str = "info"

    def __post_init__(self):
        for name in ("max_body_bytes", "max_fanout"):
            check_int(name, getattr(self, name), 1)
        if not self.graceful_shutdown_seconds >= 0:
            raise ValueError(f"graceful_shutdown_seconds must be >= 0, got {self.graceful_shutdown_seconds!r}")


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


class Http:
    """One HTTP exchange over ASGI: read the body (bounded), answer JSON or SSE, and
    notice a disconnect."""

    def __init__(self, scope, receive, send, max_body: int):
        self.scope, self.receive, self.send_raw, self.max_body = scope, receive, send, max_body
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.started = False
        self.gone = False

    async def body(self) -> bytes:
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise P.ApiError(413, f"request body is {declared} bytes; the limit is {self.max_body}")
        chunks, size, more = [], 0, True
        while more:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                self.gone = True
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise P.ApiError(413, f"request body is over the limit of {self.max_body} bytes")
            chunks.append(chunk)
            more = msg.get("more_body", False)
        return b"".join(chunks)

    async def json(self, type_):
        body = await self.body()
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise P.ApiError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
        try:
            return msgspec.json.decode(body, type=type_)
        except RecursionError:
            raise P.ApiError(400, "request body is nested too deeply") from None
        except msgspec.ValidationError as e:
            raise P.ApiError(400, f"invalid request: {e}", _path(str(e))) from None
        except msgspec.DecodeError as e:
            raise P.ApiError(400, f"malformed JSON: {e}") from None

    async def send(self, status: int, body: bytes, headers=JSON) -> None:
        self.started = True
        try:
            await self.send_raw({"type": "http.response.start", "status": status, "headers": headers})
            await self.send_raw({"type": "http.response.body", "body": body})
        except OSError:
            raise ClientGone from None

    async def start_sse(self) -> None:
        self.started = True
        await self.send_raw({"type": "http.response.start", "status": 200, "headers": SSE})

    async def event(self, data: bytes) -> None:
        try:
            await self.send_raw({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})
        except OSError:
            raise ClientGone from None

    async def end(self) -> None:
        try:
            await self.send_raw({"type": "http.response.body", "body": b""})
        except OSError:
            pass

    async def error(self, e: P.ApiError) -> None:
        body = P.encode(P.ErrorResponse(P.ErrorDetail(e.message, e.type, e.param, e.code)))
        if not self.started:
            await self.send(e.status, body)
        else:  # mid-stream: the status has gone out; say it as the last event, then end the stream
            await self.event(body)
            await self.event(b"[DONE]")
            await self.end()

    async def run(self, coro):
        """Await ``coro`` unless the client disconnects first: then cancel it (which
        aborts its engine requests) and raise ClientGone."""
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(self._disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        await asyncio.gather(work, return_exceptions=True)  # let its clean-up run
        raise ClientGone

    async def _disconnected(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True


def _path(message: str) -> str | None:
    """The field a msgspec error names: ``... - at `$.messages[0].role``` ->
    ``messages[0].role``; ``Object contains unknown field `foo``` -> ``foo``."""
    _, sep, path = message.rpartition("at `$")
    if sep:
        return path.rstrip("`").lstrip(".") or None
    _, sep, name = message.rpartition("unknown field `")
    return name.rstrip("`") or None if sep else None


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Chunks of several streams as they come, as (stream index, chunk); leaving early
    aborts every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def feed(i, stream):
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(feed(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, chunk = await queue.get()
            if chunk is None:
                left -= 1
            else:
                yield i, chunk
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


class Server:
    """``Server(engine, ServerConfig())`` is an ASGI application."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.engine = engine
        self.config = config or ServerConfig()
        self.model_name = self.config.served_model_name or engine.config.model
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.draining = False  # set on SIGINT/SIGTERM: new requests get 503
        self._loop: asyncio.AbstractEventLoop | None = None
        self.routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
            ("POST", "/generate"): self.generate,
            ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/metrics"): self.prometheus,
            ("GET", "/health"): self.health,
            ("GET", "/stats"): self.stats,
            ("GET", "/debug/integrity"): self.integrity,
            ("GET", "/model_info"): self.model_info,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/render_chat"): self.render_chat,
        }
        self.paths = {path for _, path in self.routes}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        http = Http(scope, receive, send, self.config.max_body_bytes)
        path, method = scope["path"], scope["method"]
        endpoint = path if path in self.paths else "other"
        try:
            handler = self.routes.get((method, path))
            if handler is None:
                if path in self.paths:
                    raise P.ApiError(405, f"{method} is not allowed on {path}")
                raise P.ApiError(404, f"no such route: {path}", type="not_found_error")
            if path != "/health":
                self._authorize(http)
            if self.draining and method == "POST":
                raise P.ApiError(503, "the server is shutting down", type="unavailable")
            await handler(http)
        except ClientGone:
            pass
        except P.ApiError as e:
            self.metrics.errors.labels(endpoint, str(e.status)).inc()
            if not http.gone:
                await http.error(e)
        except Exception as e:  # a bug: answer 500, keep serving
            logger.exception("%s %s failed", method, path)
            self.metrics.errors.labels(endpoint, "500").inc()
            if not http.gone:
                await http.error(P.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error"))

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self.engine.close)  # what still runs finishes with "abort"
                await send({"type": "lifespan.shutdown.complete"})
                return

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM arrived (callable from a signal handler): refuse new requests,
        let running ones finish for ``graceful_shutdown_seconds``, then abort the rest,
        so that each still waiting client gets a JSON 503, or an SSE error event and
        ``[DONE]``, before the HTTP server closes its connections."""
        if self.draining or self._loop is None:
            return
        self.draining = True

        async def abort_later():
            await asyncio.sleep(self.config.graceful_shutdown_seconds)
            self.engine.abort_all()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(abort_later()))

    def _authorize(self, http: Http) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = http.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())):
            raise P.ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                             type="authentication_error", code="invalid_api_key")  # fmt: skip

    # -- helpers ---------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise P.ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                             "model", code="model_not_found")  # fmt: skip

    async def _prompt_ids(self, prompt, param: str, bounded: bool = False, unbounded: bool = False) -> list[int]:
        try:
            return await asyncio.to_thread(self.engine.prompt_ids, prompt, bounded, unbounded)
        except (ValueError, TypeError) as e:
            raise P.ApiError(400, str(e), param) from None

    def _check_policy(self, params, ids: list[list[int]], prefix: str = "") -> None:
        """A long-context policy that fits each prompt, else a 400 naming the field."""
        try:
            for i in ids:
                self.engine.check_policy(params, len(i))
        except FieldError as e:
            raise P.ApiError(400, str(e), prefix + e.field) from None

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str, unbounded: bool = False) -> int:
        """The output budget: ``requested`` (None: the rest of the context), checked
        against what the context leaves after the prompt. ``unbounded`` (kv_rerotate):
        positions stay within the context whatever the length, so ``requested`` stands
        (None: one context's worth)."""
        if unbounded:
            return self.engine.max_context if requested is None else requested
        room = self.engine.max_context - prompt_len
        if requested is None:
            return room
        if isinstance(requested, int) and requested > room:
            raise P.ApiError(400, f"{param} is {requested}, but the context is {self.engine.max_context} tokens and "
                                  f"the prompt has {prompt_len}: at most {room}", param)  # fmt: skip
        return requested

    def _namespace(self, http: Http, salt: str | None) -> str | None:
        """The request's cache namespace. A gateway's ``X-Cache-Salt`` header wins over the
        body's ``cache_salt``; with ``cache_salt_header_only`` a body salt is refused."""
        header = http.headers.get("x-cache-salt")
        if salt is not None and self.config.cache_salt_header_only:
            raise P.ApiError(400, "cache_salt is not accepted in the body here: the X-Cache-Salt header sets it",
                             "cache_salt")  # fmt: skip
        for value, name in ((header, "X-Cache-Salt"), (salt, "cache_salt")):
            if value is not None and not 0 < len(value) <= P.MAX_SALT_CHARS:
                raise P.ApiError(400, f"{name} must be 1 to {P.MAX_SALT_CHARS} characters, got {len(value)}",
                                 "cache_salt")  # fmt: skip
        return header if header is not None else salt

    def _check_fanout(self, prompts: int, n: int) -> None:
        if prompts * n > self.config.max_fanout:
            param = "n" if n > 1 else "prompt"
            raise P.ApiError(400, f"{prompts} prompts x n={n} is {prompts * n} completions; the limit per call is "
                                  f"{self.config.max_fanout}", param)  # fmt: skip

    async def _constraints(self, params, count: int) -> list:
        """``count`` independent compiled constraints of ``params.regex`` (Nones without
        one), compiled in a worker thread: a large pattern must not stall the loop."""
        if params.regex is None:
            return [None] * count
        try:
            first = await asyncio.to_thread(self.engine.compile_constraint, params)
        except ValueError as e:
            raise P.ApiError(400, str(e), "regex") from None
        return [first] + [first.copy() for _ in range(count - 1)]

    def _render(self, req, add_generation_prompt: bool, ids: bool = False) -> str | list[int]:
        """The chat's text, or with ``ids`` its prompt ids, in which special-token text from
        the messages stays plain text unless ``req.special_tokens_in_content``."""
        messages = P.chat_messages(req)
        extra = {"tools": req.tools} if req.tools else {}
        try:
            if ids:
                return self.engine.chat_prompt_ids(messages, add_generation_prompt, req.special_tokens_in_content,
                                                   **extra)  # fmt: skip
            return self.engine.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # the template's own checks (roles, order) or a missing template
            raise P.ApiError(400, f"messages cannot be rendered with the chat template: {e}", "messages") from None

    def _check_output(self, out: RequestOutput) -> None:
        if out.error is not None and out.error_param is not None:  # the request's own doing
            raise P.ApiError(400, out.error, out.error_param)
        if out.error is not None:
            raise P.ApiError(500, f"generation failed: {out.error}", type="internal_error")
        if any(o.finish_reason == "abort" for o in out.outputs):
            raise P.ApiError(503, "the request was aborted (the server is shutting down)", type="unavailable")

    def _token_text(self, token_id: int) -> str:
        return self.engine.decode([token_id])

    def _ids(self) -> tuple[str, int]:
        return uuid.uuid4().hex[:24], int(time.time())

    # -- OpenAI completions ------------------------------------------------------------

    async def completions(self, http: Http) -> None:
        req = await http.json(P.CompletionRequest)
        self._check_model(req.model)
        prompts = P.prompts(req)
        self._check_fanout(len(prompts), req.n)
        ids = [await self._prompt_ids(p, "prompt", req.kv_policy is not None, req.kv_rerotate is True) for p in prompts]
        fields = P.openai_fields(req)
        fields["max_new_tokens"] = self._max_tokens(req.max_tokens, max(map(len, ids)), "max_tokens",
                                                    req.kv_rerotate is True)  # fmt: skip
        if req.logprobs is not None:
            fields["logprobs"], fields["top_logprobs"] = True, req.logprobs
        params = P.sampling_params(fields, P.OPENAI_NAMES)
        self._check_policy(params, ids)
        ns = self._namespace(http, req.cache_salt)
        cons = await self._constraints(params, len(ids))
        echo = [self.engine.decode(i) if req.echo else "" for i in ids]
        rid, created = self._ids()
        rid = "cmpl-" + rid
        if req.stream:
            return await self._stream_completions(http, req, ids, params, ns, echo, rid, created, cons)
        outs = await http.run(asyncio.gather(*(self.engine.generate_async(i, params, ns, c) for i, c in zip(ids, cons))))
        for out in outs:
            self.metrics.finished("/v1/completions", out, ns)
            self._check_output(out)
        choices = [
            P.CompletionChoice(p * params.n + j, echo[p] + o.text,
                               self._completion_logprobs(o.token_ids, o.logprobs, o.top_logprobs, req.logprobs,
                                                         len(echo[p])),
                               o.finish_reason)  # fmt: skip
            for p, out in enumerate(outs)
            for j, o in enumerate(out.outputs)
        ]
        body = P.CompletionResponse(rid, created, self.model_name, choices, _usage(outs))
        await http.send(200, P.encode(body))

    def _completion_logprobs(self, ids, logprobs, tops, k, offset) -> P.CompletionLogprobs | None:
        if k is None or logprobs is None:
            return None
        tokens = [self._token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top = [{self._token_text(t): lp for t, lp in row} for row in tops] if k and tops else None
        return P.CompletionLogprobs(tokens, logprobs, top, offsets)

    async def _stream_completions(self, http, req, ids, params, ns, echo, rid, created, cons) -> None:
        streams = [self.engine.open_stream(i, params, ns, c) for i, c in zip(ids, cons)]

        async def pump():
            await http.start_sse()
            if req.echo:
                for p, text in enumerate(echo):
                    for j in range(params.n):
                        choice = P.CompletionChoice(p * params.n + j, text)
                        await http.event(P.encode(P.CompletionResponse(rid, created, self.model_name, [choice])))
            offsets = {}
            async for p, c in merged(streams):
                index = p * params.n + c.index
                lp = self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, req.logprobs,
                                               offsets.get(index, len(echo[p])))  # fmt: skip
                offsets[index] = offsets.get(index, len(echo[p])) + len(c.text)
                choice = P.CompletionChoice(index, c.text, lp, c.finish_reason)
                await http.event(P.encode(P.CompletionResponse(rid, created, self.model_name, [choice])))
            await self._finish_stream(http, "/v1/completions", streams, ns, req,
                                      lambda u: P.CompletionResponse(rid, created, self.model_name, [], u))  # fmt: skip

        await http.run(pump())

    async def _finish_stream(self, http, endpoint, streams, ns, req, usage_body) -> None:
        outs = [s.output for s in streams]
        for out in outs:
            self.metrics.finished(endpoint, out, ns)
        try:
            for out in outs:
                self._check_output(out)
        except P.ApiError as e:
            return await http.error(e)
        if req.stream_options is not None and req.stream_options.include_usage:
            await http.event(P.encode(usage_body(_usage(outs))))
        await http.event(b"[DONE]")
        await http.end()

    # -- OpenAI chat -----------------------------------------------------------------------

    async def chat_completions(self, http: Http) -> None:
        req = await http.json(P.ChatCompletionRequest)
        self._check_model(req.model)
        self._check_fanout(1, req.n)
        ids = await asyncio.to_thread(self._render, req, True, True)  # a long chat or tool schema: off the loop
        ids = await self._prompt_ids(ids, "messages", req.kv_policy is not None, req.kv_rerotate is True)
        fields = P.openai_fields(req)
        limit, param = req.max_completion_tokens, "max_completion_tokens"
        if limit is None:
            limit, param = req.max_tokens, "max_tokens"
        fields["max_new_tokens"] = self._max_tokens(limit, len(ids), param, req.kv_rerotate is True)
        fields["logprobs"] = req.logprobs
        if req.top_logprobs is not None:
            fields["top_logprobs"] = req.top_logprobs
        params = P.sampling_params(fields, {"max_new_tokens": param})
        self._check_policy(params, [ids])
        ns = self._namespace(http, req.cache_salt)
        (constraint,) = await self._constraints(params, 1)
        rid, created = self._ids()
        rid = "chatcmpl-" + rid
        if req.stream:
            return await self._stream_chat(http, req, ids, params, ns, rid, created, constraint)
        out = await http.run(self.engine.generate_async(ids, params, ns, constraint))
        self.metrics.finished("/v1/chat/completions", out, ns)
        self._check_output(out)
        choices = [
            P.ChatChoice(j, P.AssistantMessage(o.text), self._chat_logprobs(o.token_ids, o.logprobs, o.top_logprobs),
                         o.finish_reason)  # fmt: skip
            for j, o in enumerate(out.outputs)
        ]
        body = P.ChatCompletionResponse(rid, created, self.model_name, choices, _usage([out]))
        await http.send(200, P.encode(body))

    def _chat_logprobs(self, ids, logprobs, tops) -> P.ChatLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for k, (t, lp) in enumerate(zip(ids, logprobs)):
            text = self._token_text(t)
            top = [P.TopLogprob(s := self._token_text(i), v, list(s.encode())) for i, v in (tops[k] if tops else ())]
            content.append(P.TokenLogprob(text, lp, list(text.encode()), top))
        return P.ChatLogprobs(content)

    async def _stream_chat(self, http, req, ids, params, ns, rid, created, constraint) -> None:
        stream = self.engine.open_stream(ids, params, ns, constraint)

        def chunk(choices, usage=None):
            return P.ChatCompletionChunk(rid, created, self.model_name, choices, usage)

        async def pump():
            await http.start_sse()
            for j in range(params.n):
                await http.event(P.encode(chunk([P.ChunkChoice(j, P.Delta(role="assistant", content=""))])))
            async for _, c in merged([stream]):
                lp = self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                await http.event(P.encode(chunk([P.ChunkChoice(c.index, P.Delta(content=c.text), lp, c.finish_reason)])))
            await self._finish_stream(http, "/v1/chat/completions", [stream], ns, req, lambda u: chunk([], u))

        await http.run(pump())

    async def models(self, http: Http) -> None:
        await http.send(200, P.encode(P.ModelList([P.ModelCard(self.model_name, self.created)])))

    # -- native ---------------------------------------------------------------------------

    async def generate(self, http: Http) -> None:
        req = await http.json(P.GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise P.ApiError(400, "give exactly one of text and input_ids", "text")
        param = "text" if req.text is not None else "input_ids"
        bounded = req.sampling_params.get("kv_policy") is not None
        unbounded = req.sampling_params.get("kv_rerotate") is True
        ids = await self._prompt_ids(req.text if req.text is not None else req.input_ids, param, bounded, unbounded)
        fields = dict(req.sampling_params)
        params = P.sampling_params(fields, prefix="sampling_params.")
        self._check_policy(params, [ids], "sampling_params.")
        self._check_fanout(1, params.n)
        self._max_tokens(params.max_new_tokens, len(ids), "sampling_params.max_new_tokens", params.kv_rerotate)
        ns = self._namespace(http, req.cache_salt)
        (constraint,) = await self._constraints(params, 1)
        if req.stream:
            stream = self.engine.open_stream(ids, params, ns, constraint)

            async def pump():
                await http.start_sse()
                async for _, c in merged([stream]):
                    await http.event(P.encode(P.GenerateChunk(c.text, c.token_ids, c.index, c.finish_reason)))
                out = stream.output
                self.metrics.finished("/generate", out, ns)
                try:
                    self._check_output(out)
                except P.ApiError as e:
                    return await http.error(e)
                await http.event(P.encode(self._generate_body(out)))
                await http.event(b"[DONE]")
                await http.end()

            return await http.run(pump())
        out = await http.run(self.engine.generate_async(ids, params, ns, constraint))
        self.metrics.finished("/generate", out, ns)
        self._check_output(out)
        await http.send(200, P.encode(self._generate_body(out)))

    def _generate_body(self, out: RequestOutput):
        m = out.metrics
        bodies = [
            P.GenerateResponse(o.text, o.token_ids, P.GenerateMeta(
                out.rid, out.prompt_tokens, len(o.token_ids), out.cached_tokens, o.finish_reason,
                o.logprobs, o.top_logprobs, out.prompt_logprobs,
                None if m is None else m.finish_time - m.arrival_time, None if m is None else m.ttft,
            ))  # fmt: skip
            for o in out.outputs
        ]
        return bodies[0] if len(bodies) == 1 else bodies

    # -- control and observability ------------------------------------------------------------

    async def flush_cache(self, http: Http) -> None:
        from urllib.parse import parse_qs

        tiers = parse_qs(http.scope.get("query_string", b"").decode("latin-1")).get("tiers", ["memory"])[-1]
        try:
            check_flush_tiers(tiers)
        except FieldError as e:
            raise P.ApiError(400, str(e), param=e.field) from None
        if not await asyncio.to_thread(self.engine.flush_cache, tiers):
            raise P.ApiError(409, "the cache was not flushed: requests are running or waiting", type="conflict")
        await http.send(200, P.encode({"flushed": True}))

    async def prometheus(self, http: Http) -> None:
        await http.send(200, self.metrics.render(), [(b"content-type", CONTENT_TYPE.encode())])

    async def health(self, http: Http) -> None:
        if not self.engine.is_alive():
            raise P.ApiError(503, "the engine thread has stopped", type="unavailable")
        await http.send(200, P.encode({"status": "ok"}))

    async def stats(self, http: Http) -> None:
        await http.send(200, P.encode(await asyncio.to_thread(self.engine.stats)))

    async def model_info(self, http: Http) -> None:
        e = self.engine
        info = P.ModelInfo(self.model_name, e.max_context, e.vocab_size, sorted(e.eos_token_ids), e.config.page_size)
        await http.send(200, P.encode(info))

    async def tokenize(self, http: Http) -> None:
        req = await http.json(P.TokenizeRequest)
        ids = await asyncio.to_thread(self.engine.encode, req.text, req.add_special_tokens, req.split_special_tokens)
        await http.send(200, P.encode({"tokens": ids}))

    async def render_chat(self, http: Http) -> None:
        """``text``: the template's text. Tokenized as a whole it would parse special-token
        text in message content as markers, so ``tokens`` are the prompt ids as
        /v1/chat/completions computes them (content stays text unless
        ``special_tokens_in_content``)."""
        req = await http.json(P.RenderChatRequest)
        text = await asyncio.to_thread(self._render, req, req.add_generation_prompt)
        ids = await asyncio.to_thread(self._render, req, req.add_generation_prompt, True)
        await http.send(200, P.encode({"text": text, "tokens": ids}))

    async def integrity(self, http: Http) -> None:
        try:
            await asyncio.to_thread(self.engine.check_integrity)
        except IntegrityError as e:
            raise P.ApiError(500, f"integrity check failed: {e}", type="integrity_error") from None
        await http.send(200, P.encode({"ok": True}))


def _usage(outs: list[RequestOutput]) -> P.Usage:
    return P.usage(sum(o.prompt_tokens for o in outs), sum(o.completion_tokens for o in outs),
                   sum(o.cached_tokens for o in outs))  # fmt: skip
