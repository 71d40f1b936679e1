"""Tool calling and structured output for the OpenAI chat API.

A chat request's ``tools`` reach the model in one of two ways:

* ``hermes``: the model's chat template renders ``tools`` itself and tells the model to
  answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2/3
  and the templates that copied them: the template's source contains ``<tool_call>``).
* ``generic``, every other template (the embedded SmolLM2 has no tool format): radixkv
  renders the tools into the system message, in the same ``<tool_call>`` format, with
  the tools' JSON schemas, and earlier turns' calls and results into plain messages
  (an assistant's ``tool_calls`` as its ``<tool_call>`` blocks, a ``tool`` message as a
  user message holding ``<tool_response>...</tool_response>``). So tool calling works
  with every model.

Either way the output is constrained (``tool_grammar``): a call is a JSON object
``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}`` inside
``<tool_call>\\n...\\n</tool_call>``. ``tool_choice``:

    "none"              no tools in the prompt, no constraint
    "auto" (default)    free text; once the model writes "<tool_call>" the call that
                        follows must be valid (a lazy grammar: text, calls, text)
    "required"          one call or more, nothing else
    {"type": "function", "function": {"name": N}}   exactly a call of N

``parallel_tool_calls`` false allows at most one call. The output is parsed back into
OpenAI ``tool_calls`` (``parse_tool_calls``), also while streaming (``ToolStream``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from radixkv.engine.constrain import JSON_LAYOUT
from radixkv.server.protocol import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

GENERIC_PROMPT = """You may call functions to help with the user's request. The functions, as JSON schemas:
{tools}
To call a function, answer with one block per call, in this format:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
A function's result comes back in a <tool_response> block."""


@dataclass(frozen=True)
class ToolSpec:
    """What a chat request asked of tools, checked: the functions (OpenAI's
    ``{"name", "description", "parameters"}``), the choice ("none", "auto", "required"
    or a function's name) and whether several calls may come in one answer."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool
    named: bool = False  # choice names one function

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"


def tool_spec(tools: list | None, tool_choice, parallel_tool_calls: bool | None) -> ToolSpec | None:
    """The request's tools, checked (a 400 naming ``tools`` / ``tool_choice``), or None."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "tools must be a non-empty list of functions", "tools")
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must have at most {MAX_TOOLS} entries, got {len(tools)}", "tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        fn = tool["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ApiError(400, f"{where}.function has unknown field(s): {', '.join(sorted(unknown))}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(400, f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ . -, got {name!r}",
                           f"{where}.function.name")  # fmt: skip
        if name in names:
            raise ApiError(400, f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        if "description" in fn and not isinstance(fn["description"], str):
            raise ApiError(400, f"{where}.function.description must be a string", f"{where}.function.description")
        functions.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    choice, named = tool_choice if tool_choice is not None else "auto", False
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', "tool_choice")  # fmt: skip
        if name not in names:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among tools", "tool_choice")
        functions = [f for f in functions if f["name"] == name]
        choice, named = "required", True
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}',
                       "tool_choice")  # fmt: skip
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolSpec(tuple(functions), choice, parallel and not named, named)


def tool_format(template_source: str | None) -> str:
    """``hermes`` when the chat template writes tool calls as ``<tool_call>`` blocks,
    else ``generic`` (radixkv renders the tools)."""
    return "hermes" if template_source and OPEN in template_source and "tools" in template_source else "generic"


def generic_messages(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    """``messages`` for a template without a tool format: the tools in the system
    message (when ``spec`` is active), earlier calls and results as plain text."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *blocks]))})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if spec is not None and spec.active:
        tools = "\n".join(json.dumps({"name": f["name"], "description": f["description"],
                                      "parameters": f["parameters"]}) for f in spec.functions)  # fmt: skip
        text = GENERIC_PROMPT.format(tools=tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_block(call) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n{CLOSE}"


def tool_grammar(spec: ToolSpec) -> str:
    """The Lark grammar (llguidance's dialect, for SamplingParams.ebnf) of an answer
    under ``spec``: calls alone ("required", a named function) or free text with
    calls in it ("auto")."""
    alts = []
    rules = []
    for i, f in enumerate(spec.functions):
        schema = {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_LAYOUT}  # fmt: skip
        rules.append(f"fn_{i}: %json {json.dumps(schema)}")
        alts.append(f"fn_{i}")
    body = f'"\\n" ({" | ".join(alts)}) "\\n{CLOSE}"'
    if spec.choice == "auto":
        many = "*" if spec.parallel else "?"
        head = ["%llguidance {}", f"start: (call){many} TEXT", f'call_open[lazy]: TEXT "{OPEN}"', f"call: call_open {body}",
                r"TEXT: /(.|\n)*/"]  # fmt: skip
    else:
        more = ' ("\\n" call)*' if spec.parallel else ""
        head = [f"start: call{more}", f'call: "{OPEN}" {body}']
    return "\n".join(head + rules) + "\n"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The text outside ``<tool_call>`` blocks (None when empty) and the calls, as
    OpenAI ``tool_calls`` (arguments as JSON text). A block that is not a JSON call
    stays text."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        call = _as_call(m.group(1))
        if call is None:
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    rest = text[last:]
    if calls and OPEN in rest:  # a block the length limit cut short
        rest = rest[: rest.index(OPEN)]
    kept.append(rest)
    content = "".join(kept).strip() if calls else text
    return content or None, calls


def _as_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}  # fmt: skip


class ToolStream:
    """Splits streamed text into content deltas and whole tool calls: text that may
    begin a ``<tool_call>`` block is held back until the block closes (then it is a
    call) or turns out to be text."""

    def __init__(self):
        self._buf = ""
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """``(content, calls)`` safe to send after ``text``; ``final`` flushes the rest."""
        self._buf += text
        content, calls = [], []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, OPEN)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            end = self._buf.find(CLOSE, start)
            if end < 0:
                content.append(self._buf[:start])
                self._buf = self._buf[start:]
                if final:  # a block the length limit cut short: text, unless calls came before it
                    if not (self.calls or calls):
                        content.append(self._buf)
                    self._buf = ""
                break
            content.append(self._buf[:start])
            call = _as_call(self._buf[start + len(OPEN) : end].strip())
            if call is None:
                content.append(self._buf[start : end + len(CLOSE)])
            else:
                calls.append(call)
            self._buf = self._buf[end + len(CLOSE) :]
        text = "".join(content)
        if self.calls or calls:  # between and after calls, whitespace is layout, not content
            text = text.strip()
        self.calls += len(calls)
        return text, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
