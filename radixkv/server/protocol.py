"""Request and response bodies of the HTTP API, as msgspec Structs.

Requests are decoded with ``msgspec.json.decode(body, type=...)``: a wrong type names
the field (``$.max_tokens``). Value ranges are checked once, by ``SamplingParams``;
``sampling_params`` turns its error back into the API's field name. Responses follow
the OpenAI API (``/v1/...``) and SGLang's native ``/generate``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
from msgspec import Struct

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


class StreamOptions(Struct):
    include_usage: bool = False


class _Sampling(Struct, kw_only=True):
    """Fields every OpenAI-style request shares, with vLLM's and SGLang's extensions
    (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, cache_salt, regex), and
    radixkv's long-context policy (kv_policy, kv_budget, kv_compress_at, kv_rerotate)."""

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
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    regex: str | None = None  # constrained decoding (SGLang's field name)
    kv_policy: str | None = None  # long-context eviction (radixkv.cache.compress)
    kv_budget: Union[int, float, None] = None  # tokens kept, or a ratio in (0, 1)
    kv_compress_at: int | None = None  # prompt tokens compressed once after their prefill
    kv_rerotate: bool | None = None  # positions within the cache: the request may run past the context


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Union[str, list[Any]]  # a string, token ids, or a list of either (checked in ``prompts``)
    max_tokens: int | None = 16
    logprobs: int | None = None  # how many top tokens per position (0: only the chosen one)
    echo: bool = False


class TextPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    # Special-token text in messages (``<|im_end|>``) is plain text by default; True makes
    # it real special tokens (role markers), as the rendered template's text tokenizes.
    special_tokens_in_content: bool = False


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
    if req.regex is not None:
        fields["regex"] = req.regex
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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
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


class AssistantMessage(Struct):
    content: str
    role: Literal["assistant"] = "assistant"


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


class GenerateRequest(Struct, forbid_unknown_fields=True):
    """SGLang-style: ``text`` or ``input_ids``, and SamplingParams' own fields by name."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = {}
    stream: bool = False
    cache_salt: str | None = None


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
    text: str
    add_special_tokens: bool = False
    split_special_tokens: bool = False  # special-token text in ``text`` as plain text (transformers' name)


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


def encode(obj) -> bytes:
    return msgspec.json.encode(obj)
