"""Where programs run: an in-process Engine, or a `radixkv serve` process over HTTP.

A backend is the frontend's whole view of the runtime: tokenize text, render a chat,
generate for token-id prompts (with prompt logprobs when ``select`` scores choices),
stream, and say which token ids end a sequence. Prompts go in as token ids, so what
the runtime caches is exactly what the program built.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator


class BackendError(RuntimeError):
    """The runtime could not be reached or refused a request."""


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


class Backend:
    """What a program needs from the runtime. ``params`` are SamplingParams fields by name."""

    eos_token_ids: frozenset[int]
    max_context: int

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

    def close(self) -> None:
        pass


class EngineBackend(Backend):
    """An in-process ``radixkv.Engine``: ``EngineBackend(engine)`` or
    ``EngineBackend(**engine_settings)`` (then the backend owns and closes it)."""

    def __init__(self, engine=None, namespace: str | None = None, **settings):
        from radixkv.engine.engine import Engine

        self._owned = engine is None
        self.engine = Engine(**settings) if engine is None else engine
        self.namespace = namespace
        self.eos_token_ids = self.engine.eos_token_ids
        self.max_context = self.engine.max_context

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return self.engine.encode(text, add_special_tokens, split_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.engine.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def generate(self, prompts: list[list[int]], params: dict) -> list[CallResult]:
        from radixkv.engine.sampling import SamplingParams

        outs = self.engine.generate(prompts, SamplingParams(**params), namespace=self.namespace)
        return [_engine_result(o) for o in outs]

    def stream(self, prompt: list[int], params: dict) -> Iterator[Delta | CallResult]:
        from radixkv.engine.sampling import SamplingParams

        sp = SamplingParams(**params)
        loop = asyncio.new_event_loop()  # this thread's own loop: the engine posts chunks to it

        async def opened():
            return self.engine.open_stream(prompt, sp, self.namespace)

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

    def close(self) -> None:
        if self._owned:
            self.engine.close()


def _engine_result(out) -> CallResult:
    if out.error is not None:
        raise BackendError(f"generation failed: {out.error}")
    ttft = out.metrics.ttft if out.metrics is not None else None
    return CallResult(out.text, out.token_ids, out.prompt_tokens, out.cached_tokens, out.finish_reason,
                      out.prompt_logprobs, ttft)  # fmt: skip


class RuntimeEndpoint(Backend):
    """A running ``radixkv serve``: ``RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)``.

    Checks the server at construction (raises BackendError if it cannot be reached).
    ``cache_salt`` puts every request of this backend in its own cache namespace.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, cache_salt: str | None = None,
                 max_parallel: int = 64):  # fmt: skip
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="radixkv-endpoint")
        self.cache_salt = cache_salt
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
        body = {"text": text, "add_special_tokens": add_special_tokens}
        if split_special_tokens:  # only then: a server from before the field still answers the rest
            body["split_special_tokens"] = True
        return self._call("POST", "/tokenize", body)["tokens"]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return self._call("POST", "/render_chat", body)["text"]

    def _body(self, prompt: list[int], params: dict, stream: bool = False) -> dict:
        body = {"input_ids": prompt, "sampling_params": params, "stream": stream}
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body

    def generate(self, prompts: list[list[int]], params: dict) -> list[CallResult]:
        futures = [self._pool.submit(self._call, "POST", "/generate", self._body(p, params)) for p in prompts]
        results = []
        for f in futures:
            body = f.result()
            for b in body if isinstance(body, list) else [body]:
                results.append(_http_result(b))
        return results

    def stream(self, prompt: list[int], params: dict) -> Iterator[Delta | CallResult]:
        import httpx

        try:
            with self._http.stream("POST", "/generate", json=self._body(prompt, params, stream=True)) as r:
                if r.status_code != 200:
                    r.read()
                    _checked(r)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise BackendError(event["error"]["message"])
                    if "meta_info" in event:
                        yield _http_result(event)
                    else:
                        yield Delta(event["text"], event["output_ids"])
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the radixkv runtime at {self.url}: {e}") from None

    def close(self) -> None:
        self._pool.shutdown()
        self._http.close()


def _checked(r) -> dict:
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise BackendError(f"the runtime answered {r.status_code}: {message}")
    return r.json()


def _http_result(body: dict) -> CallResult:
    m = body["meta_info"]
    return CallResult(body["text"], body["output_ids"], m["prompt_tokens"], m["cached_tokens"], m["finish_reason"],
                      m.get("prompt_logprobs"), m.get("ttft"))  # fmt: skip
