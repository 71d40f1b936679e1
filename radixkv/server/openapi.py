"""``GET /openapi.json``: an OpenAPI 3.1 document of the server's routes, generated from
the msgspec Structs of ``protocol`` (``msgspec.json.schema_components``), so a field
added to a request Struct appears in the document without more work.

``ROUTES`` says, per (method, path), what each route takes and answers; ``document``
lists every route the server dispatches, and a route missing from ``ROUTES`` still
appears (without schemas) so the document never lies by omission. The test suite
checks that each served route has its entry.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import msgspec

from radixkv.server import protocol as P

REF = "#/components/schemas/{name}"


class RouteDoc(NamedTuple):
    """What one route takes and answers. ``request``: the JSON body's type (None: no
    body); ``response``: the 200 JSON body's type (``str``: a text body, see
    ``content_type``); ``stream``: the type of each SSE ``data:`` event when the request
    sets ``stream``; ``query``/``path``: parameters as (name, description). A tuple of
    types is any of them (msgspec refuses a Union of untagged Structs)."""

    summary: str
    request: Any = None
    response: Any = None
    stream: Any = None
    content_type: str = "application/json"
    query: tuple[tuple[str, str], ...] = ()
    path: tuple[tuple[str, str], ...] = ()


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/completions"): RouteDoc(
        "OpenAI completions", P.CompletionRequest, P.CompletionResponse, P.CompletionResponse),
    ("POST", "/v1/chat/completions"): RouteDoc(
        "OpenAI chat completions (the model's chat template)", P.ChatCompletionRequest, P.ChatCompletionResponse,
        P.ChatCompletionChunk),
    ("GET", "/v1/models"): RouteDoc("The served model", response=P.ModelList),
    ("GET", "/v1/models/{model}"): RouteDoc(
        "The served model's card (404 for any other id)", response=P.ModelCard,
        path=(("model", "the model id (percent-encoded when it holds a '/')"),)),
    ("POST", "/generate"): RouteDoc(
        "Native generation: text or input_ids, SamplingParams by name (a list when n > 1)", P.GenerateRequest,
        Union[P.GenerateResponse, list[P.GenerateResponse]], (P.GenerateChunk, P.GenerateResponse)),
    ("POST", "/flush_cache"): RouteDoc(
        "Empty the prefix cache (409 while requests run)", response=P.FlushResponse,
        query=(("tiers", "memory (default: pool and host tier), device, host, store or all"),)),
    ("POST", "/pin"): RouteDoc(
        "Keep a prompt's pages cached: pinned, for a ttl, or as a hint (400 past --max-pinned-share)", P.PinRequest,
        P.PinResponse),
    ("POST", "/unpin"): RouteDoc(
        "Release a pin or hint by id (404 when unknown), or every entry of a session", P.UnpinRequest,
        P.UnpinResponse),
    ("GET", "/metrics"): RouteDoc("Prometheus text format", response=str, content_type="text/plain"),
    ("GET", "/health"): RouteDoc("200 while the engine thread lives (never needs the key)", response=P.HealthResponse),
    ("GET", "/stats"): RouteDoc("Engine.stats()", response=dict[str, Any]),
    ("GET", "/debug/integrity"): RouteDoc("Pool and tree invariants (500 if broken)", response=P.IntegrityResponse),
    ("GET", "/debug/kv_blocks"): RouteDoc("With --kv-events: block hashes the cache holds per medium (GPU, CPU)",
                                          response=dict[str, Any]),
    ("GET", "/model_info"): RouteDoc("Context length, vocabulary, EOS ids, page size", response=P.ModelInfo),
    ("GET", "/server_info"): RouteDoc(
        "SGLang's server info: the model, its served name, the limits (what sglang-router reads)",
        response=P.ServerInfo),
    ("POST", "/tokenize"): RouteDoc(
        "Text, a prompt or chat messages -> token ids (radixkv's and vLLM's bodies)", P.TokenizeRequest,
        P.TokenizeResponse),
    ("POST", "/detokenize"): RouteDoc("Token ids -> text (vLLM's body)", P.DetokenizeRequest, P.DetokenizeResponse),
    ("POST", "/render_chat"): RouteDoc(
        "Messages -> the chat template's text and the prompt's token ids", P.RenderChatRequest, P.RenderChatResponse),
    ("GET", "/openapi.json"): RouteDoc("This document", response=dict[str, Any]),
}  # fmt: skip

UNAUTHENTICATED = {"/health"}  # routes that never need the API key


def document(routes, title: str, version: str, api_key: bool) -> dict:
    """The OpenAPI 3.1 document of ``routes`` ((method, path) pairs, a path parameter
    written ``{name}``). ``api_key``: the server wants ``Authorization: Bearer KEY``."""
    docs = [(method, path, ROUTES.get((method, path))) for method, path in routes]
    types = [P.ErrorResponse]
    for _, _, doc in docs:
        if doc is not None:
            for t in (doc.request, doc.response, doc.stream):
                types += list(t) if isinstance(t, tuple) else [] if t is None or t is str else [t]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    by_type = dict(zip(map(repr, types), schemas))

    def schema(t) -> dict:
        return {"anyOf": [by_type[repr(x)] for x in t]} if isinstance(t, tuple) else by_type[repr(t)]

    error = {"description": "an error: {\"error\": {message, type, param, code}}",
             "content": {"application/json": {"schema": schema(P.ErrorResponse)}}}  # fmt: skip
    paths: dict[str, dict] = {}
    for method, path, doc in docs:
        op: dict[str, Any] = {"operationId": _operation_id(method, path)}
        if doc is None:
            op["summary"] = "(not described)"
            op["responses"] = {"200": {"description": "OK"}, "default": error}
        else:
            op["summary"] = doc.summary
            params = [{"name": n, "in": "path", "required": True, "description": d, "schema": {"type": "string"}}
                      for n, d in doc.path]  # fmt: skip
            params += [{"name": n, "in": "query", "required": False, "description": d, "schema": {"type": "string"}}
                       for n, d in doc.query]  # fmt: skip
            if params:
                op["parameters"] = params
            if doc.request is not None:
                op["requestBody"] = {"required": True,
                                     "content": {"application/json": {"schema": schema(doc.request)}}}  # fmt: skip
            ok: dict[str, Any] = {"description": "OK", "content": {}}
            if doc.response is str:
                ok["content"][doc.content_type] = {"schema": {"type": "string"}}
            elif doc.response is not None:
                ok["content"]["application/json"] = {"schema": schema(doc.response)}
            if doc.stream is not None:
                ok["description"] = "OK; with \"stream\": true, server-sent events whose data is the schema given, " \
                                    "then data: [DONE]"  # fmt: skip
                ok["content"]["text/event-stream"] = {"schema": schema(doc.stream)}
            op["responses"] = {"200": ok, "default": error}
        if api_key and path in UNAUTHENTICATED:
            op["security"] = []
        paths.setdefault(path, {})[method.lower()] = op
    out: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        out["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        out["security"] = [{"bearerAuth": []}]
    return out


def _operation_id(method: str, path: str) -> str:
    words = "".join(c if c.isalnum() else "_" for c in path).strip("_")
    return f"{method.lower()}_{'_'.join(w for w in words.split('_') if w)}"

