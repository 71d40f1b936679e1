"""Chat templates: a conversation rendered to the prompt text a model was trained on.

A template is Jinja source shipped with the model (GGUF ``tokenizer.chat_template``,
``chat_template.jinja`` or ``tokenizer_config.json``). Templates come from model files,
so they run in jinja2's immutable sandbox. Rendering follows transformers'
``apply_chat_template(tokenize=False)``: same environment options, globals, ``tojson``
and variables, so a prompt here is the same text (and the same cached prefix) that a
transformers user gets.

Rendering gives text, and tokenizing that text would turn special-token text that a
message holds (``<|im_end|><|im_start|>system``) into real role markers.
`ChatTemplate.encode` gives the prompt's token ids with the template's own markers as
special tokens and everything that came from the messages and tools as plain text; a
conversation without special-token text in it gets exactly ``tokenizer.encode(render(...))``.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixkv.errors import ModelLoadError

# Where a message's reasoning may arrive; templates read it as ``reasoning_content``
# (most) or ``thinking`` (gpt-oss).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class EscapedChat(NamedTuple):
    """A rendered conversation and where in its text special-token text that came from
    the messages or tools lies (sorted ``(start, end)`` character ranges)."""

    text: str
    literal_spans: tuple[tuple[int, int], ...]


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``, e.g. "roles must
    alternate") or failed on it (e.g. content of a type it cannot handle)."""


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training-time
    masks in transformers; rendering keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Plain json.dumps: jinja's own filter escapes <, >, & and ' for HTML, which would
    # change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _new_dict(*args, **kwargs):
    # Replaces the `dict` type itself, whose class attributes a template has no use for.
    return dict(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_new_dict)
    return env


class ChatTemplate:
    """A compiled chat template.

    ``special_tokens`` are the named tokens the template sees as variables
    (``bos_token``, ``eos_token``, ...); `from_tokenizer` passes the tokenizer's.
    Raises ModelLoadError if ``source`` is not a string or not valid Jinja.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(source, str):
            raise ModelLoadError(f"a chat template is Jinja source text, got {type(source).__name__}")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatTemplate:
        """The template that came with a `Tokenizer`'s model, with its named special
        tokens. Raises ModelLoadError if the model has no chat template."""
        if tokenizer.chat_template is None:
            raise ModelLoadError(
                f"{tokenizer.source} has no chat template; pass one with ChatTemplate(source) "
                "or send a plain prompt instead of chat messages"
            )
        return cls(tokenizer.chat_template, tokenizer.special_tokens_map)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for ``messages``.

        Each message is a dict with a string ``role`` and a ``content`` that is a string or
        a list of content parts (it may be left out or None only when the message has
        ``tool_calls``). Keys whose value is None are dropped, as transformers drops them;
        a reasoning text under ``reasoning`` or ``thinking`` is also passed as
        ``reasoning_content`` (and as ``thinking``). ``add_generation_prompt`` appends the
        opening of an assistant turn. ``tools`` are JSON-schema dicts. ``extra`` variables
        reach the template too and override the special tokens of the same name.

        Raises ValueError naming the message index and field for malformed messages or
        tools, and ChatTemplateError (a ValueError) when the template rejects the
        conversation or fails on it.
        """
        chat = [_template_message(m) for m in _checked_messages(messages)]
        variables = {
            **self.special_tokens,
            "messages": chat,
            "tools": _checked_tools(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **extra,
        }
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None

    def render_escaped(self, messages: Sequence[Mapping[str, Any]], special_tokens: Iterable[str],
                       add_generation_prompt: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                       **extra: Any) -> EscapedChat:  # fmt: skip
        """`render`'s text, and where in it the ``special_tokens`` texts that the messages
        and tools hold ended up.

        Every string in the messages and tools (not keys, not ``extra``) has its special-token
        text swapped for a placeholder that no template treats as a token, the template
        renders that, and the placeholders go back to the token text, their places noted.
        So a template that trims, slices or dumps content with ``tojson`` still renders the
        same text, and the template's own markers are never taken for content. When no
        string holds special-token text this is plainly `render`. Raises as `render`.
        """
        tokens = sorted({t for t in special_tokens if t}, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        strings = list(_strings([messages, tools]))
        if pattern is None or not any(pattern.search(x) for x in strings):
            return EscapedChat(self.render(messages, add_generation_prompt, tools, **extra), ())
        nonce = "rkv" + secrets.token_hex(8)  # hex digits: placeholders are "rkv<nonce><k>z"
        while any(nonce in x for x in strings):
            nonce = "rkv" + secrets.token_hex(8)
        number = {t: k for k, t in enumerate(tokens)}

        def escape(value):
            if isinstance(value, str):
                return pattern.sub(lambda m: f"{nonce}{number[m.group()]}z", value)
            if isinstance(value, Mapping):
                return {key: escape(v) for key, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(escape(v) for v in value)
            return value

        rendered = self.render(escape(messages), add_generation_prompt, escape(tools), **extra)
        parts, spans, at, size = [], [], 0, 0
        for m in re.finditer(re.escape(nonce) + r"(\d+)z", rendered):
            token = tokens[int(m.group(1))] if int(m.group(1)) < len(tokens) else m.group()
            parts += [rendered[at : m.start()], token]
            size += m.start() - at
            spans.append((size, size + len(token)))
            size, at = size + len(token), m.end()
        parts.append(rendered[at:])
        return EscapedChat("".join(parts), tuple(spans))

    def encode(self, tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None, special_tokens_in_content: bool = False,
               **extra: Any) -> list[int]:  # fmt: skip
        """The prompt's token ids with a `Tokenizer`: the template's markers are special
        tokens, special-token text in the messages and tools is plain text (the tokenizer's
        special tokens, as ``split_special_tokens`` splits them). Without such text this is
        exactly ``tokenizer.encode(render(...))``. ``special_tokens_in_content`` opts in to
        that for every conversation: special-token text in messages becomes tokens too (for
        callers who write markers into content on purpose). Raises as `render`.
        """
        if special_tokens_in_content:
            return tokenizer.encode(self.render(messages, add_generation_prompt, tools, **extra))
        chat = self.render_escaped(messages, tokenizer.special_tokens, add_generation_prompt, tools, **extra)
        if not chat.literal_spans:
            return tokenizer.encode(chat.text)
        return tokenizer.encode_literal(chat.text, chat.literal_spans)


def _checked_messages(messages) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}]['role'] must be a string, got {role!r}")
        content = message.get("content")
        if content is None and message.get("tool_calls"):
            continue
        if not isinstance(content, (str, list)):
            raise ValueError(
                f"messages[{i}]['content'] must be a string or a list of content parts, got {type(content).__name__}"
            )
    return messages


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``message`` without None values and with reasoning under both names.
    Key order matters to templates that dump a message with ``tojson``: ``thinking`` comes
    first, ``reasoning_content`` last unless the message had it, as in transformers."""
    kept = {key: value for key, value in message.items() if value is not None}
    reasoning = next((kept[key] for key in _REASONING_FIELDS if key in kept), None)
    if reasoning is None:
        return kept
    out = {"thinking": reasoning}
    out.update(kept)
    out["reasoning_content"] = reasoning
    return out


def _strings(value) -> Iterable[str]:
    """Every string in nested dicts, lists and tuples (dict values, not keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _checked_tools(tools) -> list[Mapping[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")
    return list(tools)
