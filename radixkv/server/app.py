"""The HTTP server: a plain ASGI application over one Engine, run by uvicorn.

Routes (everything but /health needs ``Authorization: Bearer KEY`` when an API key is set):

    POST /v1/completions        OpenAI completions (streaming with SSE)
    POST /v1/chat/completions   OpenAI chat completions (the model's chat template)
    GET  /v1/models             the one served model
    GET  /v1/models/{model}     its card (404 for another id)
    POST /generate              native: text or input_ids, SamplingParams by name
    POST /flush_cache           empty the prefix cache: pool and host tier; ?tiers=device|host|store|all
                                (409 while requests run)
    POST /pin                   keep a prompt's pages cached: pinned (until /unpin), for a ttl, or as a
                                hint (radixkv.cache.pins); 400 past --max-pinned-share
    POST /unpin                 release a pin (or hint) by id, or every entry of a session_id
    GET  /metrics               Prometheus text format
    GET  /health                200 while the engine thread lives
    GET  /stats                 Engine.stats() as JSON
    GET  /debug/integrity       pool and tree invariants (500 if broken)
    GET  /debug/kv_blocks       with --kv-events: the block hashes the cache holds per medium (GPU from
                                the tree, CPU the host tier): what a router's index of this replica holds
    GET  /model_info            context length, vocabulary, EOS ids, page size
    GET  /server_info           SGLang's: the model, its served name and the limits (what sglang-router reads)
    POST /tokenize              text -> token ids (what program frontends build prompts from); also
                                vLLM's body: a prompt, or messages rendered by the chat template
    POST /detokenize            token ids -> text (vLLM's body)
    POST /render_chat           messages -> the chat template's text and the prompt's token ids
    GET  /openapi.json          an OpenAPI 3.1 document of these routes, from protocol's Structs

Prompt caching: ``cache_control`` ({"type": "ephemeral", "ttl": "5m" | "1h"}) on a chat
message keeps the prompt through the end of that message cached for the ttl (where the
chat template's rendering of the messages up to it ends, its end marker included); at the
top of a request, the whole prompt. ``session_id`` (every generation route) keeps a
finished request's whole prefix protected for the session's next request.

With ``allowed_origins`` set (CORS), a browser's preflight (OPTIONS) is answered without
the key, and responses to an allowed origin carry Access-Control-Allow-Origin.

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
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec

from radixkv.cache.capture import MAX_SESSION_CHARS, SESSION, SESSION_HEADER, TraceWriter
from radixkv.cache.manager import check_flush_tiers
from radixkv.cache.pins import PinInfo
from radixkv.engine.engine import Engine, RequestStream
from radixkv.engine.request import CacheControl, RequestOutput, StreamChunk
from radixkv.engine.constrain import KINDS as GRAMMAR_FIELDS
from radixkv.engine.sampling import MAX_N
from radixkv.errors import FieldError, IntegrityError
from radixkv.server import ops
from radixkv.server import protocol as P
from radixkv.server.metrics import CONTENT_TYPE, Metrics
from radixkv.server.tools import ToolSpec, ToolStream, generic_messages, parse_tool_calls, tool_format, tool_grammar, tool_spec
from radixkv.validate import check_int

logger = logging.getLogger("radixkv.server")
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_ORIGIN = r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+"  # a CORS origin: scheme://host[:port]
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"  # an HTTP method or header name
CORS_SAFELISTED = ("accept", "accept-language", "content-language", "content-type")  # always allowed


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
    warmup: bool = True  # a prefill chunk through the model before serving (Engine.warm_up)
    stats_interval: float = 10.0  # seconds between stats lines in the log (radixkv.server.ops); 0: none
    access_log: str | None = None  # a file taking one JSON line per request ("-": stderr); None: none
    # CORS (browsers): origins whose pages may call the server ("*": any); none: no CORS
    # headers at all. Methods and headers a preflight may ask for ("*": any).
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    # Trace capture (radixkv.cache.capture): one JSONL line per finished request for radixkv sim;
    # past record_trace_max_bytes the file is rotated to FILE.1 (one old file kept).
    record_trace: str | None = None
    record_trace_max_bytes: int | None = None

    def __post_init__(self):
        for name in ("max_body_bytes", "max_fanout"):
            check_int(name, getattr(self, name), 1)
        if self.record_trace_max_bytes is not None:
            check_int("record_trace_max_bytes", self.record_trace_max_bytes, 1)
        if not self.stats_interval >= 0:
            raise ValueError(f"stats_interval must be >= 0 (0: no stats line), got {self.stats_interval!r}")
        if not self.graceful_shutdown_seconds >= 0:
            raise ValueError(f"graceful_shutdown_seconds must be >= 0, got {self.graceful_shutdown_seconds!r}")
        origin = lambda v: v.lower().removesuffix("/")  # noqa: E731  (browsers send it lower-case, no slash)
        for name, pattern, normal in (("allowed_origins", _ORIGIN, origin), ("allowed_methods", _TOKEN, str.upper),
                                      ("allowed_headers", _TOKEN, str.lower)):  # fmt: skip
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"{name} must be a list of strings, got {values!r}")
            values = tuple(normal(v) for v in values)
            bad = [v for v in values if v != "*" and not re.fullmatch(pattern, v)]
            if bad:
                what = "scheme://host[:port], no path" if name == "allowed_origins" else "an HTTP token"
                raise ValueError(f"{name}: {bad[0]!r} is not '*' or {what}")
            object.__setattr__(self, name, values)


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
        self.metrics = Metrics(engine, self.model_name)
        self.access_log = ops.AccessLog(self.config.access_log) if self.config.access_log else None
        if self.config.record_trace is not None:  # namespaces hashed under the metrics' key: trace ids = labels
            engine.trace_writer = TraceWriter(self.config.record_trace, self.config.record_trace_max_bytes,
                                              self.metrics.namespace_key)  # fmt: skip
        self.tool_format = tool_format(engine.tokenizer.chat_template)  # hermes or generic (tools.py)
        self.created = int(time.time())
        self.draining = False  # set on SIGINT/SIGTERM: new requests get 503
        self._loop: asyncio.AbstractEventLoop | None = None
        self.routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
            ("POST", "/generate"): self.generate,
            ("POST", "/flush_cache"): self.flush_cache,
            ("POST", "/pin"): self.pin,
            ("POST", "/unpin"): self.unpin,
            ("GET", "/metrics"): self.prometheus,
            ("GET", "/health"): self.health,
            ("GET", "/stats"): self.stats,
            ("GET", "/debug/integrity"): self.integrity,
            ("GET", "/debug/kv_blocks"): self.kv_blocks,
            ("GET", "/model_info"): self.model_info,
            ("GET", "/server_info"): self.server_info,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/render_chat"): self.render_chat,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/v1/models/{model}"): self.model_card,
            ("GET", "/openapi.json"): self.openapi,
        }
        self.paths = {path for _, path in self.routes}
        # a path with a parameter matches any request path that goes on after its prefix
        self.templates = {path.split("{", 1)[0]: path for path in self.paths if "{" in path}
        self._openapi: bytes | None = None  # /openapi.json, built on its first request

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        http = Http(scope, receive, send, self.config.max_body_bytes)
        path, method = scope["path"], scope["method"]
        route = self._route(path)
        endpoint = route or "other"
        record = self._record(http, method, path) if self.access_log is not None else None
        session = http.headers.get(SESSION_HEADER)
        if session is not None:  # this request's task only: Engine._submit reads it for the trace
            SESSION.set(session[:MAX_SESSION_CHARS])
        try:
            if self.config.allowed_origins and "origin" in http.headers and self._cors(http):
                return await self._preflight(http)  # before auth: browsers send no credentials on it
            handler = self.routes.get((method, route))
            if handler is None:
                if route is not None:
                    raise P.ApiError(405, f"{method} is not allowed on {path}")
                raise P.ApiError(404, f"no such route: {path}", type="not_found_error")
            if route != "/health":
                self._authorize(http)
            if self.draining and method == "POST":
                raise P.ApiError(503, "the server is shutting down", type="unavailable")
            await handler(http)
        except ClientGone:
            self.metrics.aborted.labels(endpoint).inc()  # its engine requests were aborted
            if record is not None:
                record["error"], record["status"] = "client disconnected", record["status"] or 499
        except P.ApiError as e:
            self.metrics.errors.labels(endpoint, str(e.status)).inc()
            self._log_error(method, path, e, record)
            if not http.gone:
                await http.error(e)
        except Exception as e:  # a bug: answer 500, keep serving
            logger.exception("%s %s failed", method, path)
            self.metrics.errors.labels(endpoint, "500").inc()
            error = P.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error")
            if record is not None:
                record["error"] = error.message
            if not http.gone:
                await http.error(error)
        finally:
            if record is not None:
                self.access_log.write(ops.finish_record(record, record.get("error"), record.get("param")))

    def _record(self, http: Http, method: str, path: str) -> dict:
        """Start this request's access-log record (ops.CURRENT: Metrics.finished adds its
        tokens) and note the status it is answered with."""
        rid = http.headers.get("x-request-id")
        record = ops.new_record(method, path, rid[:128] if rid else None)
        ops.CURRENT.set(record)
        send = http.send_raw

        async def send_noting_status(msg):
            if msg["type"] == "http.response.start":
                record["status"] = msg["status"]
            await send(msg)

        http.send_raw = send_noting_status
        return record

    @staticmethod
    def _log_error(method: str, path: str, e: P.ApiError, record: dict | None) -> None:
        """A 4xx at INFO, a 5xx at WARNING, with the reason (message and param)."""
        param = f" (param {e.param})" if e.param else ""
        logger.log(logging.WARNING if e.status >= 500 else logging.INFO, "%s %s -> %d: %s%s", method, path, e.status,
                   e.message, param)  # fmt: skip
        if record is not None:
            record["error"], record["param"] = e.message, e.param

    def close_access_log(self) -> None:
        if self.access_log is not None:
            self.access_log.close()

    def _route(self, path: str) -> str | None:
        """The route ``path`` belongs to (``/v1/models/{model}`` for ``/v1/models/x``), or None."""
        if path in self.paths:
            return path
        for prefix, template in self.templates.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                return template
        return None

    # -- CORS --------------------------------------------------------------------------------

    def _cors(self, http: Http) -> bool:
        """A request with an Origin header while ``allowed_origins`` is set. A preflight
        (OPTIONS with Access-Control-Request-Method): True, for ``_preflight``. Otherwise
        the response gets Access-Control-Allow-Origin if the origin is allowed (errors
        and streams included); other origins get no CORS headers (the browser then
        withholds the answer from the page)."""
        if http.scope["method"] == "OPTIONS" and "access-control-request-method" in http.headers:
            return True
        extra = self._allow_origin(http.headers["origin"])
        if extra:
            send = http.send_raw

            async def send_with_cors(msg):
                if msg["type"] == "http.response.start":
                    msg = {**msg, "headers": [*msg.get("headers", ()), *extra]}
                await send(msg)

            http.send_raw = send_with_cors
        return False

    def _allow_origin(self, origin: str) -> list[tuple[bytes, bytes]]:
        """The headers that let ``origin`` read responses; [] if it may not."""
        if "*" in self.config.allowed_origins:
            return [(b"access-control-allow-origin", b"*")]
        if origin.lower() in self.config.allowed_origins:
            return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        return []

    async def _preflight(self, http: Http) -> None:
        """Answer a CORS preflight: 204 with the Access-Control-* headers when the origin,
        the method and the headers it asks for are allowed, else a JSON 403 without them."""
        c = self.config
        allow = self._allow_origin(http.headers["origin"])
        if not allow:
            raise P.ApiError(403, f"origin {http.headers['origin']!r} is not allowed (--allowed-origins)",
                             type="cors_error")  # fmt: skip
        served = sorted({m for m, _ in self.routes} | {"OPTIONS"})
        methods = served if "*" in c.allowed_methods else list(c.allowed_methods)
        method = http.headers["access-control-request-method"].strip().upper()
        if method not in methods:
            raise P.ApiError(403, f"method {method} is not allowed here: {', '.join(methods)}", type="cors_error")
        asked = [h.strip().lower() for h in http.headers.get("access-control-request-headers", "").split(",")]
        asked = [h for h in asked if h]
        if "*" in c.allowed_headers:
            headers = asked  # any: echo them (a literal "*" would not cover Authorization)
        else:
            headers = [*CORS_SAFELISTED, *(h for h in c.allowed_headers if h not in CORS_SAFELISTED)]
            refused = [h for h in asked if h not in headers]
            if refused:
                raise P.ApiError(403, f"request headers not allowed here: {', '.join(refused)}", type="cors_error")
        out = [*allow, (b"access-control-allow-methods", ", ".join(methods).encode()),
               (b"access-control-max-age", b"600")]  # fmt: skip
        if headers:
            out.append((b"access-control-allow-headers", ", ".join(headers).encode("latin-1")))
        await http.send(204, b"", out)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self.engine.close)  # what still runs finishes with "abort"
                if self.engine.trace_writer is not None:
                    await asyncio.to_thread(self.engine.trace_writer.close)
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

    async def _constraints(self, params, count: int, names: dict[str, str] | None = None) -> list:
        """``count`` independent compiled constraints of ``params.grammar`` (Nones without
        one), compiled in a worker thread: a large grammar must not stall the loop."""
        names = names or {}
        if params.grammar is None:
            return [None] * count
        try:
            first = await asyncio.to_thread(self.engine.compile_constraint, params)
        except FieldError as e:
            raise P.ApiError(400, str(e), names.get(e.field, e.field)) from None
        return [first] + [first.copy() for _ in range(count - 1)]

    def _render(self, req, add_generation_prompt: bool, ids: bool = False, tools: ToolSpec | None = None,
                count: int | None = None):  # fmt: skip
        """The chat's text, or with ``ids`` its prompt ids, in which special-token text from
        the messages stays plain text unless ``req.special_tokens_in_content``. The tools
        go to a template with a tool format, else into the messages (tools.py).
        ``count``: only the first ``count`` messages."""
        messages = P.chat_messages(req)[:count]
        if tools is None and req.tools:  # /render_chat, /tokenize: the tools as a chat request would send them
            tools = tool_spec(req.tools, None, None)
        extra = {}
        if self.tool_format == "hermes":
            if tools is not None and tools.active:
                extra = {"tools": [{"type": "function", "function": f} for f in tools.functions]}
        else:
            messages = generic_messages(messages, tools)
        try:
            if ids:
                return self.engine.chat_prompt_ids(messages, add_generation_prompt, req.special_tokens_in_content,
                                                   **extra)  # fmt: skip
            return self.engine.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # the template's own checks (roles, order) or a missing template
            raise P.ApiError(400, f"messages cannot be rendered with the chat template: {e}", "messages") from None

    def _check_output(self, out: RequestOutput, names: dict[str, str] | None = None) -> None:
        """A failed request's answer: a 400 naming the field when it was the request's own
        doing (``names`` maps the engine's field names to the route's), else 500 or 503."""
        if out.error is not None and out.error_param is not None:  # the request's own doing
            param = (names or {}).get(out.error_param, out.error_param)
            raise P.ApiError(400, out.error.replace(out.error_param, param, 1), param)
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
        P.check_unsupported(req)
        prompts = P.prompts(req)
        best_of = self._best_of(req)
        self._check_fanout(len(prompts), best_of or req.n)
        ids = [await self._prompt_ids(p, "prompt", req.kv_policy is not None, req.kv_rerotate is True) for p in prompts]
        fields = P.openai_fields(req)
        fields["max_new_tokens"] = self._max_tokens(req.max_tokens, max(map(len, ids)), "max_tokens",
                                                    req.kv_rerotate is True)  # fmt: skip
        if req.logprobs is not None:
            fields["logprobs"], fields["top_logprobs"] = True, req.logprobs
        if best_of:  # rank by the sampled tokens' logprobs
            fields["n"], fields["logprobs"] = best_of, True
        scored = req.echo and req.logprobs is not None  # the prompt's tokens get logprobs too (scoring)
        if scored:
            if req.stream:
                raise P.ApiError(400, "echo with logprobs (the prompt's logprobs) cannot be streamed", "echo")
            fields["prompt_logprobs_from"] = 0
        params = await self._params(fields, P.OPENAI_NAMES)
        self._check_policy(params, ids)
        ns = self._namespace(http, req.cache_salt)
        keep = {"session_id": P.check_session(req.session_id)}
        if req.cache_control is not None:  # the whole prompt
            keep["cache_control"] = CacheControl(P.cache_ttl(req.cache_control, "cache_control"))
        cons = await self._constraints(params, len(ids))
        echo = [self.engine.decode(i) if req.echo else "" for i in ids]
        rid, created = self._ids()
        rid = "cmpl-" + rid
        self._log_user(rid, req)
        if req.stream:
            return await self._stream_completions(http, req, ids, params, ns, echo, rid, created, cons, keep)
        outs = await http.run(asyncio.gather(*(self.engine.generate_async(i, params, ns, c, **keep)
                                               for i, c in zip(ids, cons))))  # fmt: skip
        for out in outs:
            self.metrics.finished("/v1/completions", out, ns)
            self._check_output(out)
        picked = [_best(out.outputs, req.n) if best_of else out.outputs for out in outs]
        choices = []
        for p, chosen in enumerate(picked):
            for j, o in enumerate(chosen):
                lp = self._completion_logprobs(o.token_ids, o.logprobs, o.top_logprobs, req.logprobs, len(echo[p]))
                if scored:
                    lp = self._with_prompt(lp, ids[p], outs[p].prompt_logprobs, req.logprobs)
                choices.append(P.CompletionChoice(p * req.n + j, echo[p] + o.text, lp, o.finish_reason))
        body = P.CompletionResponse(rid, created, self.model_name, choices, _usage(outs))
        await http.send(200, P.encode(body))

    @staticmethod
    def _best_of(req) -> int | None:
        """``best_of`` when it asks for more than ``n`` samples (None otherwise), checked."""
        if req.best_of is None:
            return None
        if not isinstance(req.best_of, int) or req.best_of < max(req.n, 1):
            raise P.ApiError(400, f"best_of must be an int >= n ({req.n}), got {req.best_of!r}", "best_of")
        if req.best_of > MAX_N:
            raise P.ApiError(400, f"best_of must be at most {MAX_N}, got {req.best_of}", "best_of")
        if req.best_of == req.n:
            return None
        if req.stream:
            raise P.ApiError(400, "best_of > n cannot be streamed (the best are known at the end)", "best_of")
        return req.best_of

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

    def _with_prompt(self, lp: P.CompletionLogprobs, prompt_ids, prompt_lps, k) -> P.CompletionLogprobs:
        """``lp`` with the prompt's tokens first (OpenAI's echo + logprobs): the first
        token's logprob is null; a prompt token's top_logprobs hold the token itself."""
        tokens = [self._token_text(t) for t in prompt_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        tops = None
        if lp.top_logprobs is not None:
            tops = [None if v is None else {t: v} for t, v in zip(tokens, prompt_lps)] + lp.top_logprobs
        return P.CompletionLogprobs(tokens + lp.tokens, list(prompt_lps) + lp.token_logprobs, tops, offsets + lp.text_offset)

    async def _stream_completions(self, http, req, ids, params, ns, echo, rid, created, cons, keep) -> None:
        streams = [self.engine.open_stream(i, params, ns, c, **keep) for i, c in zip(ids, cons)]

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
        P.check_unsupported(req)
        self._check_fanout(1, req.n)
        tools = tool_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
        ids = await asyncio.to_thread(self._render, req, True, True, tools)  # a long chat or tool schema: off the loop
        ids = await self._prompt_ids(ids, "messages", req.kv_policy is not None, req.kv_rerotate is True)
        fields = P.openai_fields(req)
        limit, param = req.max_completion_tokens, "max_completion_tokens"
        if limit is None:
            limit, param = req.max_tokens, "max_tokens"
        fields["max_new_tokens"] = self._max_tokens(limit, len(ids), param, req.kv_rerotate is True)
        fields["logprobs"] = req.logprobs
        if req.top_logprobs is not None:
            fields["top_logprobs"] = req.top_logprobs
        names = {"max_new_tokens": param, **self._structured(req, tools, fields)}
        params = await self._params(fields, names)
        self._check_policy(params, [ids])
        ns = self._namespace(http, req.cache_salt)
        keep = {"cache_control": await self._chat_cache_control(req, ids, tools),
                "session_id": P.check_session(req.session_id)}  # fmt: skip
        (constraint,) = await self._constraints(params, 1, names)
        rid, created = self._ids()
        rid = "chatcmpl-" + rid
        self._log_user(rid, req)
        calling = tools is not None and tools.active
        if req.stream:
            return await self._stream_chat(http, req, ids, params, ns, rid, created, constraint, calling, keep)
        out = await http.run(self.engine.generate_async(ids, params, ns, constraint, **keep))
        self.metrics.finished("/v1/chat/completions", out, ns)
        self._check_output(out)
        choices = []
        for j, o in enumerate(out.outputs):
            content, calls, reason = o.text, None, o.finish_reason
            if calling:
                content, found = parse_tool_calls(o.text)
                if found:
                    calls = [P.ToolCall(c["id"], P.FunctionCall(**c["function"])) for c in found]
                    reason = "tool_calls" if reason == "stop" else reason
            lp = self._chat_logprobs(o.token_ids, o.logprobs, o.top_logprobs)
            choices.append(P.ChatChoice(j, P.AssistantMessage(content, "assistant", calls), lp, reason))
        body = P.ChatCompletionResponse(rid, created, self.model_name, choices, _usage([out]))
        await http.send(200, P.encode(body))

    async def _chat_cache_control(self, req, ids: list[int], tools) -> tuple[CacheControl, ...]:
        """The chat's ``cache_control`` markers as CacheControls. A message's marker (or one
        on a text part of it) covers the prompt through the end of that message: the
        prompt ids of the messages up to it as the template renders them without a
        generation prompt (its end marker included), cut where they stop agreeing with
        the whole prompt's; a marker at the top of the request covers the whole prompt.
        A 400 naming the marker for a bad one, or for more than MAX_CACHE_BREAKPOINTS."""
        marks: list[tuple[int | None, float]] = []
        for i, m in enumerate(req.messages):
            cc, param = m.cache_control, f"messages[{i}].cache_control"
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.cache_control is not None:
                    cc, param = part.cache_control, f"messages[{i}].content[{j}].cache_control"
            if cc is not None:
                marks.append((i, P.cache_ttl(cc, param)))
        if req.cache_control is not None:
            marks.append((None, P.cache_ttl(req.cache_control, "cache_control")))
        if len(marks) > P.MAX_CACHE_BREAKPOINTS:
            raise P.ApiError(400, f"{len(marks)} cache_control markers; at most {P.MAX_CACHE_BREAKPOINTS} per request",
                             "cache_control")  # fmt: skip
        out = []
        for i, ttl in marks:
            upto = len(ids)
            if i is not None:
                prefix = await asyncio.to_thread(self._render, req, False, True, tools, i + 1)
                upto = next((k for k, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
            if upto:
                out.append(CacheControl(ttl=ttl, upto=upto))
        return tuple(out)

    @staticmethod
    async def _params(fields: dict, names: dict | None = None, prefix: str = ""):
        """``P.sampling_params``; in a worker thread when a grammar is among the fields
        (checking a 100k-character schema takes tens of milliseconds: not on the loop)."""
        if any(fields.get(k) is not None for k in GRAMMAR_FIELDS):
            return await asyncio.to_thread(P.sampling_params, fields, names, prefix)
        return P.sampling_params(fields, names, prefix)

    @staticmethod
    def _structured(req, tools: ToolSpec | None, fields: dict) -> dict[str, str]:
        """Put the constraint of ``response_format`` or of tool calling into ``fields``
        (json_schema / ebnf); the API's names for them, for errors."""
        rf = req.response_format
        if rf is not None and rf.type not in ("text", "json_object", "json_schema"):
            raise P.ApiError(400, f'response_format.type must be "text", "json_object" or "json_schema", got {rf.type!r}',
                             "response_format.type")  # fmt: skip
        structured = rf is not None and rf.type != "text"
        if tools is not None and tools.active:
            if structured:
                raise P.ApiError(400, "response_format and tools (with tool_choice other than \"none\") cannot be "
                                      "combined: a tool call's arguments already follow the tool's schema",
                                 "response_format")  # fmt: skip
            if any(k in fields for k in ("regex", "json_schema", "ebnf")):
                raise P.ApiError(400, "tools cannot be combined with regex, json_schema or ebnf", "tools")
            fields["ebnf"] = tool_grammar(tools)
            return {"ebnf": "tools"}
        if not structured:
            return {}
        if any(k in fields for k in ("regex", "json_schema", "ebnf")):
            raise P.ApiError(400, "response_format cannot be combined with regex, json_schema or ebnf", "response_format")
        if rf.type == "json_object":
            fields["json_schema"] = {"type": "object"}
            return {"json_schema": "response_format"}
        js = rf.json_schema
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise P.ApiError(400, 'response_format.json_schema must be {"name": ..., "schema": {...}, "strict": ...}',
                             "response_format.json_schema")  # fmt: skip
        unknown = set(js) - {"name", "description", "schema", "strict"}
        if unknown:
            raise P.ApiError(400, f"response_format.json_schema has unknown field(s): {', '.join(sorted(unknown))}",
                             "response_format.json_schema")  # fmt: skip
        if "strict" in js and not isinstance(js["strict"], bool):
            raise P.ApiError(400, "response_format.json_schema.strict must be a bool", "response_format.json_schema.strict")
        fields["json_schema"] = js.get("schema", {"type": "object"})  # strict or not, the output follows it
        return {"json_schema": "response_format.json_schema.schema"}

    def _log_user(self, rid: str, req) -> None:
        labels = {k: getattr(req, k, None) for k in ("user", "safety_identifier", "prompt_cache_key")}
        labels = {k: v for k, v in labels.items() if v is not None}
        if labels:
            logger.info("%s %s", rid, " ".join(f"{k}={v!r}" for k, v in labels.items()))

    def _chat_logprobs(self, ids, logprobs, tops) -> P.ChatLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for k, (t, lp) in enumerate(zip(ids, logprobs)):
            text = self._token_text(t)
            top = [P.TopLogprob(s := self._token_text(i), v, list(s.encode())) for i, v in (tops[k] if tops else ())]
            content.append(P.TokenLogprob(text, lp, list(text.encode()), top))
        return P.ChatLogprobs(content)

    async def _stream_chat(self, http, req, ids, params, ns, rid, created, constraint, calling=False,
                           keep=None) -> None:  # fmt: skip
        stream = self.engine.open_stream(ids, params, ns, constraint, **(keep or {}))
        splitters = [ToolStream() for _ in range(params.n)] if calling else None

        def chunk(choices, usage=None):
            return P.ChatCompletionChunk(rid, created, self.model_name, choices, usage)

        async def pump():
            await http.start_sse()
            for j in range(params.n):
                await http.event(P.encode(chunk([P.ChunkChoice(j, P.Delta(role="assistant", content=""))])))
            async for _, c in merged([stream]):
                lp = self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                delta, reason = P.Delta(content=c.text), c.finish_reason
                if splitters is not None:
                    split = splitters[c.index]
                    before = split.calls
                    text, calls = split.feed(c.text, final=reason is not None)
                    delta = P.Delta(content=text or None, tool_calls=[
                        P.DeltaToolCall(before + k, call["id"], P.FunctionCall(**call["function"]))
                        for k, call in enumerate(calls)
                    ] or None)  # fmt: skip
                    if reason == "stop" and split.calls:
                        reason = "tool_calls"
                    if delta.content is None and delta.tool_calls is None and reason is None and lp is None:
                        continue
                await http.event(P.encode(chunk([P.ChunkChoice(c.index, delta, lp, reason)])))
            await self._finish_stream(http, "/v1/chat/completions", [stream], ns, req, lambda u: chunk([], u))

        await http.run(pump())

    async def models(self, http: Http) -> None:
        await http.send(200, P.encode(P.ModelList([P.ModelCard(self.model_name, self.created)])))

    async def model_card(self, http: Http) -> None:
        """GET /v1/models/{model}: the served model's card; any other id is a 404
        (``model_not_found``), as OpenAI answers. An id with a ``/`` arrives percent-encoded
        and ASGI's path has it decoded."""
        self._check_model(http.scope["path"].removeprefix("/v1/models/"))
        await http.send(200, P.encode(P.ModelCard(self.model_name, self.created)))

    # -- native ---------------------------------------------------------------------------

    async def generate(self, http: Http) -> None:
        req = await http.json(P.GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise P.ApiError(400, "give exactly one of text and input_ids", "text")
        if req.model is not None:  # SGLang's field (sglang-router sends null)
            self._check_model(req.model)
        P.check_sglang(req)
        param = "text" if req.text is not None else "input_ids"
        bounded = req.sampling_params.get("kv_policy") is not None
        unbounded = req.sampling_params.get("kv_rerotate") is True
        ids = await self._prompt_ids(req.text if req.text is not None else req.input_ids, param, bounded, unbounded)
        fields = dict(req.sampling_params)
        params = await self._params(fields, prefix="sampling_params.")
        self._check_policy(params, [ids], "sampling_params.")
        self._check_fanout(1, params.n)
        self._max_tokens(params.max_new_tokens, len(ids), "sampling_params.max_new_tokens", params.kv_rerotate)
        ns = self._namespace(http, req.cache_salt)
        keep, session = self._cache_options(req.pin, req.hint), P.check_session(req.session_id)
        (constraint,) = await self._constraints(params, 1)
        if req.stream:
            stream = self.engine.open_stream(ids, params, ns, constraint, cache_control=keep, session_id=session)

            async def pump():
                await http.start_sse()
                async for _, c in merged([stream]):
                    await http.event(P.encode(P.GenerateChunk(c.text, c.token_ids, c.index, c.finish_reason)))
                out = stream.output
                self.metrics.finished("/generate", out, ns)
                try:
                    self._check_output(out, {"cache_control": "pin"})
                except P.ApiError as e:
                    return await http.error(e)
                await http.event(P.encode(self._generate_body(out)))
                await http.event(b"[DONE]")
                await http.end()

            return await http.run(pump())
        out = await http.run(self.engine.generate_async(ids, params, ns, constraint, cache_control=keep,
                                                        session_id=session))  # fmt: skip
        self.metrics.finished("/generate", out, ns)
        self._check_output(out, {"cache_control": "pin"})
        await http.send(200, P.encode(self._generate_body(out)))

    @staticmethod
    def _cache_options(pin, hint) -> tuple[CacheControl, ...]:
        """``/generate``'s ``pin`` and ``hint`` as the engine's CacheControls, checked by it;
        a 400 naming the option's field (pin.ttl, pin.tokens, hint.uses, hint.ttl)."""
        def control(option: str, names: dict[str, str], **fields) -> CacheControl:
            try:
                return CacheControl(**fields)
            except FieldError as e:
                name = e.field.split(".", 1)[1]
                param = f"{option}.{names.get(name, name)}"
                raise P.ApiError(400, str(e).replace(e.field, param, 1), param) from None

        out = []
        if pin is not False:
            fields = {} if pin is True else {"ttl": pin.ttl, "upto": pin.tokens}
            out.append(control("pin", {"upto": "tokens"}, **fields))
        if hint is not None:
            out.append(control("hint", {}, ttl=hint.ttl, hint=True, uses=hint.uses))
        return tuple(out)

    @staticmethod
    def _pin_body(info: PinInfo | None) -> P.PinResponse | None:
        if info is None:
            return None
        return P.PinResponse(info.id, info.kind, info.tokens, info.pages, info.expires_in(time.monotonic()), info.uses)

    async def pin(self, http: Http) -> None:
        """POST /pin: pin a prompt (what is not cached is computed first), or with ``hint``
        protect what is cached of it as advice. Past the pin cap: a 400 naming the prompt's
        field, whose message names the cap (--max-pinned-share)."""
        req = await http.json(P.PinRequest)
        if (req.text is None) == (req.input_ids is None):
            raise P.ApiError(400, "give exactly one of text and input_ids", "text")
        param = "text" if req.text is not None else "input_ids"
        ids = await self._prompt_ids(req.text if req.text is not None else req.input_ids, param)
        ns = self._namespace(http, req.cache_salt)
        P.check_session(req.session_id)
        if not req.hint and (req.uses != 1 or req.session_id is not None):
            raise P.ApiError(400, "uses and session_id are for hints (\"hint\": true)", "uses" if req.uses != 1 else
                             "session_id")  # fmt: skip
        names = {"pin": param, "prompt": param}
        try:
            if req.hint:
                info = await asyncio.to_thread(self.engine.hint, ids, req.ttl, req.uses, ns, req.session_id)
            else:
                info = await asyncio.to_thread(self.engine.pin, ids, req.ttl, ns)
        except FieldError as e:
            raise P.ApiError(400, str(e), names.get(e.field, e.field)) from None
        body = self._pin_body(info) or P.PinResponse(None, None, 0, 0)
        await http.send(200, P.encode(body))

    async def unpin(self, http: Http) -> None:
        """POST /unpin: one entry by ``id`` (404 when there is none: unknown, expired or used
        up), or every entry of ``session_id``."""
        req = await http.json(P.UnpinRequest)
        if (req.id is None) == (req.session_id is None):
            raise P.ApiError(400, "give exactly one of id and session_id", "id")
        if req.id is not None:
            if not await asyncio.to_thread(self.engine.unpin, req.id):
                raise P.ApiError(404, f"no pin {req.id!r} (unknown, expired or used up)", "id", type="not_found_error")
            count = 1
        else:
            P.check_session(req.session_id)
            count = await asyncio.to_thread(self.engine.end_session, req.session_id)
        await http.send(200, P.encode(P.UnpinResponse(count)))

    def _generate_body(self, out: RequestOutput):
        m = out.metrics
        bodies = [
            P.GenerateResponse(o.text, o.token_ids, P.GenerateMeta(
                out.rid, out.prompt_tokens, len(o.token_ids), out.cached_tokens, o.finish_reason,
                o.logprobs, o.top_logprobs, out.prompt_logprobs,
                None if m is None else m.finish_time - m.arrival_time, None if m is None else m.ttft,
                self._pin_body(out.pin),
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
        await http.send(200, P.encode(P.FlushResponse(True)))

    async def prometheus(self, http: Http) -> None:
        await http.send(200, self.metrics.render(), [(b"content-type", CONTENT_TYPE.encode())])

    async def health(self, http: Http) -> None:
        if not self.engine.is_alive():
            raise P.ApiError(503, "the engine thread has stopped", type="unavailable")
        await http.send(200, P.encode(P.HealthResponse()))

    async def stats(self, http: Http) -> None:
        await http.send(200, P.encode(await asyncio.to_thread(self.engine.stats)))

    async def model_info(self, http: Http) -> None:
        e = self.engine
        info = P.ModelInfo(self.model_name, e.max_context, e.vocab_size, sorted(e.eos_token_ids), e.config.page_size)
        await http.send(200, P.encode(info))

    async def server_info(self, http: Http) -> None:
        """SGLang's /server_info: sglang-router names a worker's model after it."""
        from radixkv import package_version

        e = self.engine
        info = P.ServerInfo(e.config.model, self.model_name, package_version(), e.max_context,
                            e.loop.capacity_tokens, e.config.max_running, e.config.page_size)  # fmt: skip
        await http.send(200, P.encode(info))

    async def tokenize(self, http: Http) -> None:
        """radixkv's body (``text``) or vLLM's (``prompt``, or ``messages`` rendered by the
        chat template into the prompt ids a chat request would use); the answer carries
        radixkv's ``tokens`` and vLLM's ``count``, ``max_model_len`` and ``token_strs``."""
        req = await http.json(P.TokenizeRequest)
        given = [name for name in ("text", "prompt", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            raise P.ApiError(400, "give exactly one of text, prompt and messages", given[1] if given else "text")
        if req.model is not None:
            self._check_model(req.model)
        ids = await asyncio.to_thread(self._tokenize, req)
        strs = [self.engine.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        await http.send(200, P.encode(P.TokenizeResponse(ids, len(ids), self.engine.max_context, strs)))

    def _tokenize(self, req: P.TokenizeRequest) -> list[int]:
        if req.messages is None:
            special = req.add_special_tokens if req.add_special_tokens is not None else req.prompt is not None
            text = req.text if req.text is not None else req.prompt
            return self.engine.encode(text, special, req.split_special_tokens)
        if req.split_special_tokens:
            raise P.ApiError(400, "split_special_tokens is for text and prompt; special-token text in messages "
                                  "is plain text unless special_tokens_in_content", "split_special_tokens")  # fmt: skip
        ids = self._render(req, req.add_generation_prompt, True)
        if req.add_special_tokens:  # vLLM: what the tokenizer adds around a sequence, on top of the template
            plain, full = self.engine.encode("a", False), self.engine.encode("a", True)
            at = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
            ids = full[:at] + ids + full[at + len(plain) :]
        return ids

    async def detokenize(self, http: Http) -> None:
        """vLLM's /detokenize: ``tokens`` -> ``prompt`` (special tokens kept as text)."""
        req = await http.json(P.DetokenizeRequest)
        if req.model is not None:
            self._check_model(req.model)
        vocab = self.engine.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise P.ApiError(400, f"tokens[{bad}] is {req.tokens[bad]}, outside the vocabulary (0 to {vocab - 1})",
                             "tokens")  # fmt: skip
        try:
            text = await asyncio.to_thread(self.engine.decode, req.tokens)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
            raise P.ApiError(400, f"tokens cannot be decoded: {e}", "tokens") from None
        await http.send(200, P.encode(P.DetokenizeResponse(text)))

    async def openapi(self, http: Http) -> None:
        """The OpenAPI document of every route (``radixkv.server.openapi``)."""
        if self._openapi is None:
            from radixkv import package_version
            from radixkv.server.openapi import document

            doc = document(self.routes, "radixkv", package_version(), self.config.api_key is not None)
            self._openapi = P.encode(doc)
        await http.send(200, self._openapi)

    async def render_chat(self, http: Http) -> None:
        """``text``: the template's text. Tokenized as a whole it would parse special-token
        text in message content as markers, so ``tokens`` are the prompt ids as
        /v1/chat/completions computes them (content stays text unless
        ``special_tokens_in_content``)."""
        req = await http.json(P.RenderChatRequest)
        text = await asyncio.to_thread(self._render, req, req.add_generation_prompt)
        ids = await asyncio.to_thread(self._render, req, req.add_generation_prompt, True)
        await http.send(200, P.encode(P.RenderChatResponse(text, ids)))

    async def kv_blocks(self, http: Http) -> None:
        try:
            blocks = await asyncio.to_thread(self.engine.kv_blocks)
        except ValueError as e:
            raise P.ApiError(409, str(e), "kv_events") from None
        await http.send(200, P.encode(blocks))

    async def integrity(self, http: Http) -> None:
        try:
            await asyncio.to_thread(self.engine.check_integrity)
        except IntegrityError as e:
            raise P.ApiError(500, f"integrity check failed: {e}", type="integrity_error") from None
        await http.send(200, P.encode(P.IntegrityResponse(True)))


def _best(outputs, n: int) -> list:
    """The ``n`` outputs of highest mean token logprob (OpenAI's best_of), best first."""
    def score(o):
        return sum(o.logprobs) / len(o.logprobs) if o.logprobs else float("-inf")

    return sorted(outputs, key=score, reverse=True)[:n]


def _usage(outs: list[RequestOutput]) -> P.Usage:
    return P.usage(sum(o.prompt_tokens for o in outs), sum(o.completion_tokens for o in outs),
                   sum(o.cached_tokens for o in outs))  # fmt: skip
