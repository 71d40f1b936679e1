"""Where programs run: an in-process Engine, a `radixkv serve` process over HTTP, or any
OpenAI-compatible server.

A backend is the frontend's whole view of the runtime: tokenize text, render a chat,
generate for token-id prompts (with prompt logprobs when ``select`` scores choices),
stream, and say which token ids end a sequence. Prompts go in as token ids, so what
the runtime caches is exactly what the program built.

``OpenAIBackend`` is the exception (``token_level = False``): it speaks the OpenAI API,
so it sends text, either the program's messages to /chat/completions or its text to
/completions, and the server tokenizes.

Backends with ``hints`` (EngineBackend and RuntimeEndpoint, unless built with
``hints=False``) also take a program's structure as cache advice (radixkv.cache.pins): a
``session_id`` on each generation (its prefix stays protected for the program's next
step), ``hint_uses`` on a fork's prefix request, ``hint``, ``end_session``, ``pin`` and
``unpin``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator


class BackendError(RuntimeError):
    """The runtime could not be reached or refused a request. ``status`` is the HTTP
    status and ``param`` the request field the server blamed, where known."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class CallResult:
    """One generation: the completion and what the runtime's cache did for its prompt."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    prompt_logprobs: list[float | None] | None = None
    ttft: float | None = None
    completion_tokens: int | None = None  # when it differs from len(token_ids) (a text-only peer)

    @property
    def generated(self) -> int:
        return len(self.token_ids) if self.completion_tokens is None else self.completion_tokens


@dataclass(frozen=True)
class Delta:
    """A streamed piece of one generation."""

    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TextScore:
    """A text-level backend's logprobs for a continuation's tokens after a prompt: the
    server's tokens (their text) and the logprob of each (None: no context before it)."""

    tokens: list[str]
    logprobs: list[float | None]
    result: CallResult


class Backend:
    """What a program needs from the runtime. ``params`` are SamplingParams fields by name.
    ``token_level``: prompts are token ids the program builds (False: text, see
    ``OpenAIBackend``)."""

    eos_token_ids: frozenset[int]
    max_context: int
    token_level: bool = True
    hints: bool = False  # takes session_id / hint_uses, hint, end_session, pin, unpin (radixkv.cache.pins)

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text in it is the special token, or with
        ``split_special_tokens`` plain text (programs pass that for message content)."""
        raise NotImplementedError

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: dict) -> list[CallResult]:
        """One result per prompt; the prompts are submitted together."""
        raise NotImplementedError

    def stream(self, prompt: list[int], params: dict) -> Iterator[Delta | CallResult]:
        """Deltas as they come, then the CallResult."""
        raise NotImplementedError

    # With ``hints``, ``generate`` and ``stream`` also take ``session_id`` (when the request
    # ends its whole prefix stays protected until the session's next request) and
    # ``hint_uses`` (its prompt stays protected until that many requests continue it).

    def hint(self, prompt: list[int], uses: int = 1, ttl: float | None = None,
             session_id: str | None = None) -> None:  # fmt: skip
        """Protect what the runtime has cached of ``prompt`` until ``uses`` requests
        continue it (or ``ttl`` seconds, or ``end_session``)."""

    def end_session(self, session_id: str) -> None:
        """Release what ``session_id`` protects (its program has ended)."""

    def pin(self, prompt: list[int], ttl: float | None = None) -> str:
        """Pin ``prompt``'s pages in the runtime's cache (computing what is missing);
        returns the pin's id for ``unpin``."""
        raise BackendError(f"{type(self).__name__} cannot pin prefixes")

    def unpin(self, pin_id: str) -> bool:
        raise BackendError(f"{type(self).__name__} cannot pin prefixes")

    def close(self) -> None:
        pass


class EngineBackend(Backend):
    """An in-process ``radixkv.Engine``: ``EngineBackend(engine)`` or
    ``EngineBackend(**engine_settings)`` (then the backend owns and closes it).
    ``hints=False``: programs send no cache advice (sessions, fork hints)."""

    def __init__(self, engine=None, namespace: str | None = None, hints: bool = True, **settings):
        from radixkv.engine.engine import Engine

        self._owned = engine is None
        self.engine = Engine(**settings) if engine is None else engine
        self.namespace = namespace
        self.hints = hints
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_context = self.engine.max_context

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return self.engine.encode(text, add_special_tokens, split_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.engine.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def generate(self, prompts: list[list[int]], params: dict, session_id: str | None = None,
                 hint_uses: int | None = None) -> list[CallResult]:  # fmt: skip
        from radixkv.engine.sampling import SamplingParams

        outs = self.engine.generate(prompts, SamplingParams(**params), namespace=self.namespace,
                                    **_engine_cache(session_id, hint_uses))  # fmt: skip
        return [_engine_result(o) for o in outs]

    def stream(self, prompt: list[int], params: dict, session_id: str | None = None,
               hint_uses: int | None = None) -> Iterator[Delta | CallResult]:  # fmt: skip
        from radixkv.engine.sampling import SamplingParams

        sp = SamplingParams(**params)
        loop = asyncio.new_event_loop()  # this thread's own loop: the engine posts chunks to it

        async def opened():
            return self.engine.open_stream(prompt, sp, self.namespace, **_engine_cache(session_id, hint_uses))

        stream = loop.run_until_complete(opened())
        try:
            while True:
                try:
                    chunk = loop.run_until_complete(stream.__anext__())
                except StopAsyncIteration:
                    break
                yield Delta(chunk.text, chunk.token_ids)
            yield _engine_result(stream.output)
        finally:
            stream.abort()
            loop.close()

    def hint(self, prompt: list[int], uses: int = 1, ttl: float | None = None, session_id: str | None = None) -> None:
        self.engine.hint(prompt, ttl, uses, self.namespace, session_id)

    def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)

    def pin(self, prompt: list[int], ttl: float | None = None) -> str:
        return self.engine.pin(prompt, ttl, self.namespace).id

    def unpin(self, pin_id: str) -> bool:
        return self.engine.unpin(pin_id)

    def close(self) -> None:
        if self._owned:
            self.engine.close()


def _engine_cache(session_id: str | None, hint_uses: int | None) -> dict:
    """Engine.generate's cache keywords for a program's advice."""
    from radixkv.engine.request import CacheControl

    control = None if hint_uses is None else CacheControl(hint=True, uses=hint_uses)
    return {"session_id": session_id, "cache_control": control}


def _engine_result(out) -> CallResult:
    if out.error is not None:
        raise BackendError(f"generation failed: {out.error}", param=getattr(out, "error_param", None))
    ttft = out.metrics.ttft if out.metrics is not None else None
    return CallResult(out.text, out.token_ids, out.prompt_tokens, out.cached_tokens, out.finish_reason,
                      out.prompt_logprobs, ttft)  # fmt: skip


TOKENIZE_CACHE_ENTRIES = 4096  # texts whose ids a RuntimeEndpoint keeps (least recently used out)
TOKENIZE_CACHE_CHARS = 1 << 16  # longer texts are asked for each time


class RuntimeEndpoint(Backend):
    """A running ``radixkv serve``: ``RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)``.

    Checks the server at construction (raises BackendError if it cannot be reached).
    ``cache_salt`` puts every request of this backend in its own cache namespace.

    ``tokenize`` keeps the ids the server answered for up to ``TOKENIZE_CACHE_ENTRIES``
    texts (each up to ``TOKENIZE_CACHE_CHARS`` characters): a program tokenizes every
    piece it adds (chat markers, a system prompt, documents) and most repeat from run to
    run; each asked again was a round trip in the program's path to its ``/generate``
    (8 a RAG program, ~8 ms each while the server computes). Like the model facts read
    at construction, the ids assume the server keeps its tokenizer: point a new endpoint
    at a server started with another model.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, cache_salt: str | None = None,
                 max_parallel: int = 64, hints: bool = True):  # fmt: skip
        import httpx

        self.hints = hints
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="radixkv-endpoint")
        self.cache_salt = cache_salt
        self._token_ids: OrderedDict[tuple[str, bool, bool], tuple[int, ...]] = OrderedDict()
        self._token_lock = threading.Lock()
        info = self._call("GET", "/model_info")
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.max_context = info["max_context"]
        self.model = info["model"]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            r = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the radixkv runtime at {self.url}: {e}") from None
        return _checked(r)

    def flush_cache(self) -> None:
        """Empty the server's prefix cache (BackendError while requests run there)."""
        self._call("POST", "/flush_cache")

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        key = (text, bool(add_special_tokens), bool(split_special_tokens))
        keep = isinstance(text, str) and len(text) <= TOKENIZE_CACHE_CHARS
        if keep:
            with self._token_lock:
                ids = self._token_ids.get(key)
                if ids is not None:
                    self._token_ids.move_to_end(key)
                    return list(ids)
        body = {"text": text, "add_special_tokens": add_special_tokens}
        if split_special_tokens:  # only then: a server from before the field still answers the rest
            body["split_special_tokens"] = True
        ids = self._call("POST", "/tokenize", body)["tokens"]
        if keep:
            with self._token_lock:
                self._token_ids[key] = tuple(ids)
                if len(self._token_ids) > TOKENIZE_CACHE_ENTRIES:
                    self._token_ids.popitem(last=False)
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return self._call("POST", "/render_chat", body)["text"]

    def _body(self, prompt: list[int], params: dict, stream: bool = False, session_id: str | None = None,
              hint_uses: int | None = None) -> dict:  # fmt: skip
        body = self._salted({"input_ids": prompt, "sampling_params": params, "stream": stream})
        if session_id is not None:
            body["session_id"] = session_id
        if hint_uses is not None:
            body["hint"] = {"uses": hint_uses}
        return body

    def generate(self, prompts: list[list[int]], params: dict, session_id: str | None = None,
                 hint_uses: int | None = None) -> list[CallResult]:  # fmt: skip
        futures = [self._pool.submit(self._call, "POST", "/generate", self._body(p, params, False, session_id, hint_uses))
                   for p in prompts]  # fmt: skip
        results = []
        for f in futures:
            body = f.result()
            for b in body if isinstance(body, list) else [body]:
                results.append(_http_result(b))
        return results

    def stream(self, prompt: list[int], params: dict, session_id: str | None = None,
               hint_uses: int | None = None) -> Iterator[Delta | CallResult]:  # fmt: skip
        import httpx

        body = self._body(prompt, params, True, session_id, hint_uses)
        try:
            with self._http.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    _checked(r)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        raise BackendError(f"the runtime failed the stream{_on(error.get('param'))}: "
                                           f"{error.get('message')}", param=error.get("param"))  # fmt: skip
                    if "meta_info" in event:
                        yield _http_result(event)
                    else:
                        yield Delta(event["text"], event["output_ids"])
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the radixkv runtime at {self.url}: {e}") from None

    def _salted(self, body: dict) -> dict:
        return body if self.cache_salt is None else {**body, "cache_salt": self.cache_salt}

    def hint(self, prompt: list[int], uses: int = 1, ttl: float | None = None, session_id: str | None = None) -> None:
        self._call("POST", "/pin", self._salted({"input_ids": prompt, "hint": True, "uses": uses, "ttl": ttl,
                                                 "session_id": session_id}))  # fmt: skip

    def end_session(self, session_id: str) -> None:
        self._call("POST", "/unpin", {"session_id": session_id})

    def pin(self, prompt: list[int], ttl: float | None = None) -> str:
        return self._call("POST", "/pin", self._salted({"input_ids": prompt, "ttl": ttl}))["id"]

    def unpin(self, pin_id: str) -> bool:
        try:
            self._call("POST", "/unpin", {"id": pin_id})
        except BackendError as e:
            if e.status == 404:
                return False
            raise
        return True

    def close(self) -> None:
        self._pool.shutdown()
        self._http.close()


class OpenAIBackend(Backend):
    """Any OpenAI-compatible server: ``OpenAIBackend("http://127.0.0.1:30000/v1",
    model=None, api_key=None)`` (radixkv serve, vLLM, SGLang, OpenAI). ``base_url`` ends
    where the API's paths begin (``.../v1``, as the ``openai`` client takes it);
    ``model`` defaults to the first the server lists. ``extra_body`` is added to every
    request (e.g. ``{"cache_salt": "tenant-1"}`` for radixkv).

    A program that uses roles generates through /chat/completions with its finished
    messages, so a gen must be the first thing in an assistant message (the API cannot
    continue a message); a program without roles generates through /completions with its
    text. Sampling fields keep their names (``max_new_tokens`` is ``max_tokens``, default
    128 as in the other backends); those outside the OpenAI API (top_k, min_p,
    repetition_penalty, regex, kv_*, ...) are sent as the extensions radixkv, vLLM and
    SGLang read; ``json_schema`` is sent as ``response_format`` to /chat/completions and
    as SGLang's ``json_schema`` field to /completions. ``select`` needs the
    logprobs of given text: over /completions with ``echo`` (OpenAI's legacy completions
    and vLLM return them, radixkv's /v1/completions does not), never over chat.
    Text is what the server returns; token ids stay on the server (``token_level`` False).
    """

    token_level = False

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 max_parallel: int = 64, extra_body: dict | None = None):  # fmt: skip
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="radixkv-openai")
        self.extra_body = dict(extra_body or {})
        self.eos_token_ids = frozenset()
        self.max_context = None
        try:
            r = self._http.get("/models")
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the OpenAI-compatible server at {self.base_url}: {e}") from None
        if model is None:
            models = _checked(r, "the server").get("data") or []
            if not models:
                raise BackendError(f"the server at {self.base_url} lists no models; pass model=...")
            model = models[0]["id"]
        self.model = model

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        raise BackendError("OpenAIBackend sends text: the OpenAI API has no tokenizer endpoint")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """A plain rendering for ``s.text()`` (``role: content`` lines); the server
        applies its own chat template to the messages it is sent."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant: " if add_generation_prompt else text

    def _call(self, path: str, body: dict) -> dict:
        import httpx

        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the OpenAI-compatible server at {self.base_url}: {e}") from None
        return _checked(r, "the server")

    def _body(self, prompt: str | list[dict], params: dict, stream: bool = False) -> tuple[str, dict]:
        chat = not isinstance(prompt, str)
        body = {**self.extra_body, "model": self.model, ("messages" if chat else "prompt"): prompt,
                "max_tokens": 128}  # fmt: skip
        for field, value in params.items():
            if field == "max_new_tokens":
                body["max_tokens"] = value
            elif field == "json_schema" and chat:  # the API's own way; /completions has none: SGLang's field
                schema = json.loads(value) if isinstance(value, str) else value
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            elif field == "prompt_logprobs_from":
                raise BackendError("OpenAIBackend cannot return prompt logprobs for token ids")
            else:
                body[field] = value
        if stream:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        return ("/chat/completions" if chat else "/completions"), body

    def generate(self, prompts: list, params: dict) -> list[CallResult]:
        """One request per prompt: a list of messages (chat) or a str (completion)."""
        futures = []
        for p in prompts:
            path, body = self._body(p, params)
            futures.append(self._pool.submit(self._call, path, body))
        return [_openai_result(f.result(), not isinstance(p, str)) for f, p in zip(futures, prompts)]

    def stream(self, prompt, params: dict) -> Iterator[Delta | CallResult]:
        import httpx

        path, body = self._body(prompt, params, stream=True)
        chat = not isinstance(prompt, str)
        t0 = time.perf_counter()
        text, finish, usage, ttft = [], None, {}, None
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    _checked(r, "the server")
                for line in r.iter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        error = event["error"]
                        raise BackendError(f"the server failed the stream{_on(error.get('param'))}: "
                                           f"{error.get('message')}", param=error.get("param"))  # fmt: skip
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        piece = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
                        finish = choice.get("finish_reason") or finish
                        if piece:
                            ttft = time.perf_counter() - t0 if ttft is None else ttft
                            text.append(piece)
                            yield Delta(piece)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the OpenAI-compatible server at {self.base_url}: {e}") from None
        details = usage.get("prompt_tokens_details") or {}
        yield CallResult("".join(text), [], usage.get("prompt_tokens", 0), details.get("cached_tokens") or 0, finish,
                         None, ttft, usage.get("completion_tokens", 0))  # fmt: skip

    def score_text(self, prompt: str, continuations: list[str]) -> list[TextScore]:
        """The logprobs of each continuation's tokens after ``prompt`` (from the token
        that holds its first character), from /completions with ``echo`` and
        ``logprobs``. With an empty prompt, the first token's logprob is None."""
        futures = []
        for c in continuations:
            body = {**self.extra_body, "model": self.model, "prompt": prompt + c, "max_tokens": 1,
                    "temperature": 0.0, "echo": True, "logprobs": 0}  # fmt: skip
            futures.append(self._pool.submit(self._call, "/completions", body))
        return [_echo_score(f.result(), prompt, c, self.base_url) for f, c in zip(futures, continuations)]

    def close(self) -> None:
        self._pool.shutdown()
        self._http.close()


def _openai_result(body: dict, chat: bool) -> CallResult:
    choice = body["choices"][0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return CallResult(text or "", [], usage.get("prompt_tokens", 0), details.get("cached_tokens") or 0,
                      choice.get("finish_reason"), None, None, usage.get("completion_tokens", 0))  # fmt: skip


def _echo_score(body: dict, prompt: str, continuation: str, url: str) -> TextScore:
    """The continuation's tokens in an echoed completion's logprobs: every token that
    overlaps ``[len(prompt), len(prompt + continuation))`` by its text offsets.

        text:    |------ prompt ------|--- continuation ---|gen|
        tokens:  [t0][t1]...     [tk-1][tk][tk+1] ...  [tm] [g]
                                        ^ first token that ends past the prompt
    """
    logprobs = body["choices"][0].get("logprobs") or {}
    offsets, tokens = logprobs.get("text_offset") or [], logprobs.get("tokens") or []
    lps = logprobs.get("token_logprobs") or []
    if not offsets or offsets[0] != 0 or len(tokens) != len(offsets) or len(lps) != len(offsets):
        raise BackendError(f"the server at {url} returned no logprobs for the prompt (/completions with echo=True "
                           f"and logprobs); select over the OpenAI API needs them (OpenAI's legacy completions, vLLM "
                           f"and radixkv serve return them)")
    lo, hi = len(prompt), len(prompt) + len(continuation)
    ends = [*offsets[1:], max(hi, offsets[-1] + len(tokens[-1]))]
    picked = [k for k in range(len(tokens)) if offsets[k] < hi and ends[k] > lo]
    if not picked:
        raise BackendError(f"the server's echoed tokens do not cover the choice {continuation!r}")
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    result = CallResult(body["choices"][0].get("text", ""), [], usage.get("prompt_tokens", 0),
                        details.get("cached_tokens") or 0, body["choices"][0].get("finish_reason"), None, None,
                        usage.get("completion_tokens", 0))  # fmt: skip
    return TextScore([tokens[k] for k in picked], [lps[k] for k in picked], result)


def _checked(r, who: str = "the runtime") -> dict:
    """The JSON body of a 200, else a BackendError with the server's message and the
    field it blamed: ``the runtime answered 400 on sampling_params.regex: ...``."""
    if r.status_code != 200:
        param = None
        try:
            error = r.json()["error"]
            message, param = error["message"], error.get("param")
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise BackendError(f"{who} answered {r.status_code}{_on(param)}: {message}", r.status_code, param)
    return r.json()


def _on(param: str | None) -> str:
    return f" on {param}" if param else ""


def _http_result(body: dict) -> CallResult:
    m = body["meta_info"]
    return CallResult(body["text"], body["output_ids"], m["prompt_tokens"], m["cached_tokens"], m["finish_reason"],
                      m.get("prompt_logprobs"), m.get("ttft"))  # fmt: skip
