"""Request and response bodies of the HTTP API, as msgspec Structs.

Requests are decoded with ``msgspec.json.decode(body, type=...)``: a wrong type names
the field (``$.max_tokens``). Value ranges are checked once, by ``SamplingParams``;
``sampling_params`` turns its error back into the API's field name. Responses follow
the OpenAI API (``/v1/...``) and SGLang's native ``/generate``.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

import msgspec
from msgspec import Struct

from radixkv.cache.pins import MAX_TTL
from radixkv.engine.request import check_session_id
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import FieldError
from radixkv.validate import is_int

MAX_SALT_CHARS = 256  # a cache salt (body cache_salt or X-Cache-Salt header)

# -- errors ----------------------------------------------------------------------------


class ApiError(Exception):
    """An error the client gets as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorDetail


# -- OpenAI requests ---------------------------------------------------------------------


class CacheControlParam(Struct, forbid_unknown_fields=True):
    """Prompt caching's marker (Anthropic's shape): ``{"type": "ephemeral", "ttl": "5m"}``.
    On a chat message (or one of its text parts) the prompt through the end of that
    message stays cached for ``ttl``; at the top of a request, the whole prompt. ``ttl``:
    "5m" (the default), "1h", any "<n>s|m|h", or seconds as a number."""

    type: str
    ttl: Union[str, int, float, None] = None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # radixkv's chunks carry no obfuscation padding: only False is honoured


class _Sampling(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields every OpenAI-style request shares, with vLLM's and SGLang's extensions
    (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
    cache_salt, regex, json_schema, ebnf, priority), and radixkv's long-context policy
    (kv_policy, kv_budget, kv_compress_at, kv_rerotate). An unknown field is a 400
    naming it; a field the OpenAI API defines that radixkv cannot honour is a 400 too
    (``unsupported``), never silently dropped."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None  # an end-user label: in the request log line
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    min_tokens: int = 0  # no EOS / stop token ids before this many tokens (vLLM)
    priority: int = 0  # higher first: scheduling, preemption, and the priority eviction policy
    regex: str | None = None  # constrained decoding (SGLang's field names)
    json_schema: Union[str, dict[str, Any], None] = None
    ebnf: str | None = None
    kv_policy: str | None = None  # long-context eviction (radixkv.cache.compress)
    kv_budget: Union[int, float, None] = None  # tokens kept, or a ratio in (0, 1)
    kv_compress_at: int | None = None  # prompt tokens compressed once after their prefill
    kv_rerotate: bool | None = None  # positions within the cache: the request may run past the context
    # radixkv.cache.pins: a TTL for the whole prompt (chat messages take their own), and the
    # session whose next request this one's prefix stays protected for
    cache_control: CacheControlParam | None = None
    session_id: str | None = None
    # SGLang's own fields, which sglang-router writes into every request it forwards (at
    # these values): honoured at them, any other a 400 (``check_sglang``)
    no_stop_trim: bool = False
    return_hidden_states: bool = False


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Union[str, list[Any]]  # a string, token ids, or a list of either (checked in ``prompts``)
    max_tokens: int | None = 16
    logprobs: int | None = None  # how many top tokens per position (0: only the chosen one)
    echo: bool = False
    best_of: int | None = None  # sample this many, answer the n of highest mean token logprob
    suffix: str | None = None  # unsupported: a 400 unless null


class ResponseFormat(Struct, forbid_unknown_fields=True):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: str
    json_schema: dict[str, Any] | None = None


class TextPart(Struct):
    type: str
    text: str | None = None
    cache_control: CacheControlParam | None = None  # as on its message: through the end of the message


class ChatMessage(Struct):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    cache_control: CacheControlParam | None = None  # the prompt through this message stays cached for its ttl


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Special-token text in messages (``<|im_end|>``) is plain text by default; True makes
    # it real special tokens (role markers), as the rendered template's text tokenizes.
    special_tokens_in_content: bool = False
    # Accepted with their only meaning here: radixkv caches every prompt (prompt_cache_key
    # has nothing to route), safety_identifier labels the request like ``user``, the one
    # service tier is "auto"/"default", nothing is stored (store must be false).
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None  # ["text"] only
    # Defined by the OpenAI API, not honoured by radixkv: a 400 naming them unless null.
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # SGLang's chat fields that sglang-router forwards: continue_final_message as in
    # ``check_sglang``; without a reasoning parser there is nothing to separate, so either
    # value of the reasoning switches is what radixkv does (as in SGLang without one)
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True


UNSUPPORTED = {  # field -> why a non-null value is refused
    "audio": "audio output is not supported (text models only)",
    "functions": "functions is deprecated and not supported: use tools",
    "function_call": "function_call is deprecated and not supported: use tool_choice",
    "metadata": "metadata is for stored completions; radixkv stores none",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported (the model does not reason in a separate channel)",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
}


def check_unsupported(req) -> None:
    """A 400 naming the first field the OpenAI API defines that radixkv cannot honour."""
    for name, why in UNSUPPORTED.items():
        if getattr(req, name, None) is not None:
            raise ApiError(400, why, name)
    if getattr(req, "store", None):
        raise ApiError(400, "store: radixkv does not store completions", "store")
    tier = getattr(req, "service_tier", None)
    if tier not in (None, "auto", "default"):
        raise ApiError(400, f'service_tier must be "auto" or "default", got {tier!r}', "service_tier")
    modalities = getattr(req, "modalities", None)
    if modalities is not None and list(modalities) != ["text"]:
        raise ApiError(400, f'modalities must be ["text"], got {modalities!r}', "modalities")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise ApiError(400, "stream_options.include_obfuscation is not supported", "stream_options.include_obfuscation")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options needs stream: true", "stream_options")
    check_sglang(req)


SGLANG_FIXED = {  # SGLang's request field -> (the value radixkv honours, why another is refused)
    "no_stop_trim": (False, "no_stop_trim is not supported: a stop string is always cut from the output"),
    "continue_final_message": (False, "continue_final_message is not supported"),
    "return_hidden_states": (False, "return_hidden_states is not supported"),
    "return_text_in_logprobs": (False, "return_text_in_logprobs is not supported"),
    "return_bytes": (False, "return_bytes is not supported"),
    "return_entropy": (False, "return_entropy is not supported"),
    "background": (False, "background is not supported"),
    "no_logs": (False, "no_logs is not supported"),
}


def check_sglang(req) -> None:
    """A 400 naming the first of SGLang's fields (``SGLANG_FIXED``) set to a value radixkv
    does not honour. sglang-router re-encodes each request it forwards with them all."""
    for name, (value, why) in SGLANG_FIXED.items():
        if getattr(req, name, value) != value:
            raise ApiError(400, why, name)


ROLES = ("system", "user", "assistant", "tool", "developer")


def chat_messages(req: ChatCompletionRequest | RenderChatRequest) -> list[dict]:
    """The messages as the chat template wants them: text content only."""
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}",
                           f"messages[{i}].role")  # fmt: skip
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")  # fmt: skip
            content = "".join(p.text for p in content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


MAX_CACHE_BREAKPOINTS = 4  # cache_control markers one request may carry (as Anthropic's API)
_TTL_UNITS = {"s": 1, "m": 60, "h": 3600}


def cache_ttl(cc: CacheControlParam, param: str) -> float:
    """The seconds a ``cache_control`` marker keeps its prefix; a 400 naming ``param``
    (``messages[2].cache_control``) for a type other than "ephemeral" or a bad ttl."""
    if cc.type != "ephemeral":
        raise ApiError(400, f'{param}.type must be "ephemeral", got {cc.type!r}', f"{param}.type")
    ttl = cc.ttl if cc.ttl is not None else "5m"
    seconds = None
    if isinstance(ttl, str):
        m = re.fullmatch(r"(\d+)([smh])", ttl.strip())
        seconds = int(m[1]) * _TTL_UNITS[m[2]] if m else None
    elif not isinstance(ttl, bool):
        seconds = float(ttl)
    if seconds is None or not 0 < seconds <= MAX_TTL:
        raise ApiError(400, f'{param}.ttl must be "5m", "1h", "<n>s|m|h" or seconds, more than 0 and at most '
                            f"{MAX_TTL:g}, got {ttl!r}", f"{param}.ttl")  # fmt: skip
    return float(seconds)


def check_session(session_id: str | None) -> str | None:
    """``session_id`` as the engine takes it (``check_session_id``); a 400 naming it."""
    try:
        return check_session_id(session_id)
    except FieldError as e:
        raise ApiError(400, str(e), e.field) from None


def prompts(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts, each a string or token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(is_int(t) for t in p):
        return [p]
    if p and all(isinstance(x, str) or (isinstance(x, list) and all(type(t) is int for t in x)) for x in p):
        return list(p)
    raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list of either", "prompt")


# -- SamplingParams from a request ----------------------------------------------------------

OPENAI_NAMES = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}  # ours -> the API's, where they differ


def sampling_params(fields: dict, names: dict[str, str] | None = None, prefix: str = "") -> SamplingParams:
    """``SamplingParams(**fields)``; a bad value becomes a 400 naming the API's field:
    ``names`` maps our field names to the API's, ``prefix`` goes before them."""
    names = names or {}
    try:
        return SamplingParams(**fields)
    except TypeError as e:  # an unknown keyword
        field = str(e).rsplit("'", 2)[-2] if "'" in str(e) else None
        raise ApiError(400, f"unknown sampling parameter {field!r}" if field else str(e),
                       prefix + (field or ""))  # fmt: skip
    except FieldError as e:  # the field is data; the message starts with our name for it
        theirs = names.get(e.field, e.field)
        message = str(e)
        if message.startswith(e.field):
            message = theirs + message[len(e.field) :]
        raise ApiError(400, message, prefix + theirs) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def openai_fields(req: _Sampling) -> dict:
    """The SamplingParams fields the shared OpenAI fields give (max tokens and logprobs
    are the caller's)."""
    fields = {
        "n": req.n,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids,
        "skip_special_tokens": req.skip_special_tokens,
    }
    if req.temperature is not None:
        fields["temperature"] = req.temperature
    if req.top_p is not None:
        fields["top_p"] = req.top_p
    if req.stop is not None:
        fields["stop"] = req.stop
    for name in ("regex", "json_schema", "ebnf", "logit_bias"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    fields["min_tokens"] = req.min_tokens
    fields["priority"] = req.priority
    for name in ("kv_policy", "kv_budget", "kv_compress_at", "kv_rerotate"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    return fields


# -- OpenAI responses ----------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, PromptTokensDetails(cached_tokens))


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(Struct, omit_defaults=True):
    content: str | None
    role: Literal["assistant"]  # no default: omit_defaults must not drop it
    tool_calls: list[ToolCall] | None = None


class DeltaToolCall(Struct):
    """A whole call in one streamed delta (OpenAI clients also accept the arguments in
    pieces; radixkv sends each call once its block is complete)."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "radixkv"
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


# -- native /generate ------------------------------------------------------------------------


class PinOption(Struct, forbid_unknown_fields=True):
    """``/generate``'s ``pin``: the whole pages of the first ``tokens`` prompt tokens (all
    of them when null) stay cached, for ``ttl`` seconds (null: until /unpin)."""

    ttl: float | None = None
    tokens: int | None = None


class HintOption(Struct, forbid_unknown_fields=True):
    """``/generate``'s ``hint``: the prompt stays protected (advice) until ``uses``
    requests continue it, or ``ttl`` seconds (null: the server's hint_ttl) pass; what a
    program's fork sends with its shared prefix."""

    uses: int = 1
    ttl: float | None = None


class GenerateRequest(Struct, forbid_unknown_fields=True):
    """SGLang-style: ``text`` or ``input_ids``, and SamplingParams' own fields by name;
    ``pin`` (true, or {ttl, tokens}) keeps the prompt cached after the request (the answer's
    ``meta_info.pin`` has its id), ``hint`` protects it for the requests that continue it,
    ``session_id`` keeps the request's whole prefix for the session's next request. The
    fields after ``session_id`` are SGLang's, which sglang-router sends in every request
    it forwards: ``model`` is checked when not null, ``log_metrics`` changes nothing
    (metrics count every request), the rest as in ``check_sglang``."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = {}
    stream: bool = False
    cache_salt: str | None = None
    pin: Union[bool, PinOption] = False
    hint: HintOption | None = None
    session_id: str | None = None
    model: str | None = None
    log_metrics: bool = True
    return_text_in_logprobs: bool = False
    return_hidden_states: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    background: bool = False
    no_logs: bool = False


class PinRequest(Struct, forbid_unknown_fields=True):
    """``/pin``: ``text`` or ``input_ids``; computes what is not cached, then pins its
    whole pages (``ttl`` seconds, null: until /unpin). With ``hint``: computes nothing and
    protects what is cached until ``uses`` requests continue it or ``ttl`` (default the
    server's hint_ttl) passes, as advice; ``session_id`` owns the hint."""

    text: str | None = None
    input_ids: list[int] | None = None
    ttl: float | None = None
    hint: bool = False
    uses: int = 1
    session_id: str | None = None
    cache_salt: str | None = None


class PinResponse(Struct):
    """The entry: ``id`` for /unpin (null: a hint found nothing cached), ``kind`` pin |
    ttl | hint | session, the ``tokens`` and ``pages`` it keeps, ``expires_in`` seconds
    (null: never)."""

    id: str | None
    kind: str | None
    tokens: int
    pages: int
    expires_in: float | None = None
    uses: int | None = None


class UnpinRequest(Struct, forbid_unknown_fields=True):
    """``/unpin``: one entry by ``id``, or every entry of ``session_id``."""

    id: str | None = None
    session_id: str | None = None


class UnpinResponse(Struct):
    unpinned: int  # entries released (0: none by that id or session)


class GenerateMeta(Struct):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    output_token_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    e2e_latency: float | None = None
    ttft: float | None = None
    pin: PinResponse | None = None  # with "pin": the entry it made


class GenerateResponse(Struct):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class GenerateChunk(Struct):
    """One streamed piece of a native request: new text and ids since the last one."""

    text: str
    output_ids: list[int]
    index: int
    finish_reason: str | None = None


# -- helpers for program frontends ----------------------------------------------------------


class TokenizeRequest(Struct, forbid_unknown_fields=True):
    """Exactly one of ``text`` (radixkv's own), ``prompt`` (vLLM's name for it) or
    ``messages`` (rendered by the chat template, as /render_chat and chat requests do)."""

    text: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None  # checked when given, as in vLLM
    # what the tokenizer adds around a sequence (a bos token); None: True for ``prompt``
    # (vLLM's default), False for ``text`` and ``messages`` (the template has its markers)
    add_special_tokens: bool | None = None
    split_special_tokens: bool = False  # special-token text in ``text`` as plain text (transformers' name)
    add_generation_prompt: bool = True  # messages only, as the rest below
    tools: list[dict[str, Any]] | None = None
    special_tokens_in_content: bool = False
    return_token_strs: bool = False  # vLLM: also each token's own string (``token_strs``)


class RenderChatRequest(Struct, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    special_tokens_in_content: bool = False  # as in ChatCompletionRequest; for the response's ``tokens``


class ModelInfo(Struct):
    model: str
    max_context: int
    vocab_size: int
    eos_token_ids: list[int]
    page_size: int


class ServerInfo(Struct):
    """SGLang's ``/server_info`` (its field names), what sglang-router reads when it adds
    a worker: the model (``--model``) and the name it is served under, and the limits."""

    model_path: str
    served_model_name: str
    version: str
    context_length: int  # tokens a sequence may span
    max_total_tokens: int  # tokens the KV pool holds
    max_running_requests: int
    page_size: int


# -- tokenizer routes, small answers, OpenAPI ------------------------------------------------
# The answers of the helper and control routes as Structs, so /openapi.json can describe
# every route from this module.


class TokenizeResponse(Struct):
    """radixkv's ``tokens``, with vLLM's ``count``, ``max_model_len`` and ``token_strs``."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, forbid_unknown_fields=True):
    """vLLM's body: token ids to text (special tokens included)."""

    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


class RenderChatResponse(Struct):
    text: str
    tokens: list[int]


class HealthResponse(Struct):
    status: str = "ok"


class FlushResponse(Struct):
    flushed: bool


class IntegrityResponse(Struct):
    ok: bool


def encode(obj) -> bytes:
    return msgspec.json.encode(obj)
