"""Programs: Python functions that build a prompt piece by piece and generate into it.

    @function
    def qa(s, question):
        s += system("You are terse.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=32, temperature=0))

    state = qa.run(question="What is a radix tree?", backend=EngineBackend())
    state["answer"], state.text(), state.messages(), state.cache_report()

A state is a sequence of segments, each a piece of text and its token ids. Text is
tokenized segment by segment and generated tokens are kept as generated, so every
request's prompt is a token-level extension of the state before it: the runtime's
radix tree serves all of it but the newest segment. Role markers come from the model's
chat template (rendered once per backend), so a chat program sends the tokens a chat
request with the same messages would. As in a chat request, text inside a message is
content: special-token text in it (``<|im_end|>``) is tokenized as plain text, never as a
role marker. Text added outside any message is the program's own prompt text, where
special-token text is the special token.

Each state runs its operations in order on its own worker thread: ``s += gen(...)``
returns at once, reading ``s["name"]`` or ``s.text()`` waits. That is what lets the
branches of ``s.fork(n)`` generate side by side.

SGLang programs port as written: ``with s.user():`` blocks, ``gen(regex=...,
json_schema=..., choices=...)``, ``select(choices_method=...)`` (``choices.py``),
``forks += expr`` to every branch, ``fn.run(*args, temperature=..., max_new_tokens=...)``
defaults, ``run_batch`` of dicts or tuples, ``s[name] = value``. With a text-level
backend (``OpenAIBackend``) segments carry no token ids: the finished messages (or the
text) are sent and the server tokenizes.

``fn.run(..., record_trace=PATH)``, ``run_batch(..., record_trace=PATH)`` and
``set_default_backend(backend, record_trace=PATH)`` write every request the program sends
(gens, selects' scoring calls, forks' prefixes) as a ``radixkv sim`` trace line
(``radixkv.cache.capture``): session = the program run's id, shared by its forks. The
first use of a path in a process starts the file; later runs append under the same clock.
Over ``OpenAIBackend`` the prompt ids are the server's: lines carry ``text`` or
``messages`` and the output as a count.

Cache advice (radixkv.cache.pins), when the backend takes hints (``EngineBackend`` and
``RuntimeEndpoint`` unless built with ``hints=False``): every state is a session
(``fn.run(..., session_id=...)``, else the run's own id; a fork's branches are
``<id>/<k>``), so each gen leaves its whole prefix protected for the program's next
step; ``s.fork(n)`` protects the fork point until its n branches are admitted; when the
program returns its sessions end and that memory is free again. Under memory pressure
the runtime gives advice up, the youngest program's first; outputs never change.
``s.pin(ttl=None)`` pins the state's prefix as it is at that point (a system prompt
shared by many runs, say); the ids are in ``s.pins`` (``backend.unpin(id)``).
"""

from __future__ import annotations

import inspect
import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from radixkv.cache.capture import MAX_SESSION_CHARS, TraceWriter
from radixkv.frontend.backends import Backend, BackendError, CallResult, Delta
from radixkv.frontend.choices import ChoicesSamplingMethod, token_length_normalized


class ProgramError(RuntimeError):
    """A program did something that cannot run (the message says what and where)."""


class UnknownVariableError(ProgramError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


# -- expressions: what ``s += ...`` accepts --------------------------------------------------


@dataclass(frozen=True)
class Gen:
    name: str | None
    params: dict  # SamplingParams fields


@dataclass(frozen=True)
class Select:
    name: str | None
    choices: tuple[str, ...]
    choices_method: Any = token_length_normalized  # a ChoicesSamplingMethod, or any callable like one


@dataclass(frozen=True)
class Role:
    role: str
    content: tuple  # str | Gen | Select pieces; empty with ``begin_only``/``end_only``
    begin: bool = True
    end: bool = True


GEN_PARAMS = {  # gen() keyword -> SamplingParams field
    "max_tokens": "max_new_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
    "seed": "seed", "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf", "min_tokens": "min_tokens",
    "kv_policy": "kv_policy",
    "kv_budget": "kv_budget", "kv_compress_at": "kv_compress_at", "kv_rerotate": "kv_rerotate",
}  # fmt: skip

# ``fn.run(...)`` / ``run_batch(...)`` keywords that set a default for every gen of the
# program (SamplingParams names, as SGLang's run); constraints stay per gen.
CONSTRAINTS = ("regex", "json_schema", "ebnf")  # per gen only, never a run's default
RUN_DEFAULTS = tuple(f for f in GEN_PARAMS.values() if f not in CONSTRAINTS)


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | Sequence[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        repetition_penalty: float | None = None, ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None, seed: int | None = None, regex: str | None = None,
        json_schema: str | dict | None = None, ebnf: str | None = None, min_tokens: int | None = None,
        kv_policy: str | None = None, kv_budget: int | float | None = None,
        kv_compress_at: int | None = None, kv_rerotate: bool | None = None,
        choices: Sequence[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None) -> Gen | Select:  # fmt: skip
    """Generate into the state; ``s[name]`` is the text. Unset options take the program's
    defaults (``fn.run(temperature=..., ...)``), else the runtime's (SamplingParams).
    ``regex`` constrains the output to a full match of the pattern (see
    radixkv.engine.constrain); ``json_schema`` (a dict, or a JSON string of one) to a JSON
    value the schema accepts; ``ebnf`` to a grammar (Lark or GBNF); at most one of them.
    ``min_tokens``: no end-of-sequence before that many tokens. With ``choices`` it is
    ``select(name, choices, choices_method=...)``, as in SGLang. ``kv_policy`` and
    ``kv_budget`` (and ``kv_compress_at``, prompt tokens of context) bound the KV this
    generation keeps (see radixkv.cache.compress; ``kv_rerotate``: positions within the
    cache, so a decode-time budget runs past the model's context); the compressed state
    is shared through the runtime's cache like any prefix."""
    given = dict(locals())
    if choices is not None:
        unused = [kw for kw in GEN_PARAMS if kw != "temperature" and given[kw] is not None]
        if unused:
            raise ProgramError(f"gen({name!r}, choices=...) is a select: {', '.join(unused)} do not apply to it")
        return select(name, choices, temperature=temperature or 0.0,
                      choices_method=choices_method or token_length_normalized)  # fmt: skip
    if choices_method is not None:
        raise ProgramError(f"gen({name!r}): choices_method needs choices=[...]")
    params = {ours: given[kw] for kw, ours in GEN_PARAMS.items() if given[kw] is not None}
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    constraints = [k for k in CONSTRAINTS if given[k] is not None]
    if len(constraints) > 1:
        raise ProgramError(f"gen({name!r}): {' and '.join(constraints)} are {len(constraints)} constraints; give one")
    if json_schema is not None:
        params["json_schema"] = _schema_text(name, json_schema)
    return Gen(name, params)


def _schema_text(name, schema) -> str:
    """The schema as the JSON string SamplingParams takes; a dict is serialized."""
    if isinstance(schema, dict):
        try:
            return json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ProgramError(f"gen({name!r}): json_schema is not serializable as JSON: {e}") from None
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise ProgramError(f"gen({name!r}): json_schema is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise ProgramError(f"gen({name!r}): json_schema must be a JSON object, got {type(parsed).__name__}")
        return schema
    raise ProgramError(f"gen({name!r}): json_schema must be a dict or a JSON string, not {type(schema).__name__}")


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Select:  # fmt: skip
    """Append the choice that ``choices_method`` picks from the log-probabilities of each
    choice's tokens after the state (default: the highest mean token logprob; see
    radixkv.frontend.choices); ``s[name]`` is the choice. Scoring is deterministic:
    ``temperature`` (SGLang's signature) must be 0."""
    if choices is None or isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ProgramError("select(choices=...) needs a non-empty list of non-empty strings")
    if temperature:
        raise ProgramError(f"select({name!r}): choices are scored from logprobs, deterministically; "
                           f"temperature must be 0, got {temperature!r}")  # fmt: skip
    if not callable(choices_method):
        raise ProgramError(f"select({name!r}): choices_method must be a choices method such as "
                           f"token_length_normalized, not {type(choices_method).__name__}")  # fmt: skip
    return Select(name, tuple(choices), choices_method)


def _role(role: str, content) -> Role:
    pieces = tuple(content) if isinstance(content, (list, tuple)) else (content,)
    for p in pieces:
        if not isinstance(p, (str, Gen, Select)):
            raise ProgramError(f"{role}(...) takes text, gen(...) or select(...), not {type(p).__name__}")
    return Role(role, pieces)


def system(content="") -> Role:
    return _role("system", content)


def user(content="") -> Role:
    return _role("user", content)


def assistant(content="") -> Role:
    return _role("assistant", content)


def system_begin() -> Role:
    return Role("system", (), True, False)


def system_end() -> Role:
    return Role("system", (), False, True)


def user_begin() -> Role:
    return Role("user", (), True, False)


def user_end() -> Role:
    return Role("user", (), False, True)


def assistant_begin() -> Role:
    return Role("assistant", (), True, False)


def assistant_end() -> Role:
    return Role("assistant", (), False, True)


# -- chat template markers --------------------------------------------------------------------

_MARK = "\u2063radixkv-content\u2063"


@dataclass(frozen=True)
class ChatMarkers:
    """The template's text around a message of each role. ``first[role]`` is the begin
    text when that role opens the conversation (it may carry a default system prompt or
    a BOS); ``begin``/``end`` hold for every later message."""

    first: dict[str, str]
    begin: dict[str, str]
    end: dict[str, str]

    @classmethod
    def from_backend(cls, backend: Backend) -> ChatMarkers:
        render = backend.render_chat
        first, begin, end = {}, {}, {}
        for role in ("system", "user"):
            text = render([{"role": role, "content": _MARK}], False)
            first[role], end[role] = text.split(_MARK)
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        before = render(base, False)
        for role in ("user", "assistant"):
            after = render([*base, {"role": role, "content": _MARK}], False)
            if not after.startswith(before):
                raise ProgramError("the chat template does not render a conversation incrementally; "
                                   "role markers cannot be derived from it")  # fmt: skip
            begin[role], end[role] = after[len(before) :].split(_MARK)
        generation = render(base, True)[len(before) :]
        if generation != begin["assistant"]:
            raise ProgramError(f"the chat template's generation prompt {generation!r} differs from its "
                               f"assistant message start {begin['assistant']!r}")  # fmt: skip
        if not first["user"].endswith(begin["user"]):
            raise ProgramError("the chat template opens a first user message differently from later ones; "
                               "role markers cannot be derived from it")  # fmt: skip
        first["assistant"] = first["user"][: len(first["user"]) - len(begin["user"])] + begin["assistant"]
        begin["system"] = first["system"]
        return cls(first, begin, end)


_markers_lock = threading.Lock()


def markers_for(backend: Backend) -> ChatMarkers:
    """The backend's chat markers, derived once and kept on the backend."""
    with _markers_lock:
        if getattr(backend, "_chat_markers", None) is None:
            backend._chat_markers = ChatMarkers.from_backend(backend)
        return backend._chat_markers


# -- program state -------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CallRecord:
    """One request a state sent: ``kind`` is gen, select or prefix (a fork's shared
    prefix, sent once so that the branches find it cached)."""

    kind: str
    name: str | None
    prompt_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seconds: float
    ttft: float | None = None  # submission to first token, as the backend measured it


@dataclass
class CacheReport:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class _SetVar:
    name: str
    value: Any


@dataclass(frozen=True)
class _Pin:
    ttl: float | None


class ProgramState:
    """The state ``s`` a program builds; see the module docstring."""

    def __init__(self, backend: Backend, stream: bool = False, _parent: ProgramState | None = None,
                 defaults: dict | None = None):  # fmt: skip
        self.backend = backend
        self.defaults: dict = dict(defaults or {})  # SamplingParams fields every gen starts from (fn.run(...))
        self._markers: ChatMarkers | None = None
        self._segments: list[Segment] = []
        self._messages: list[dict] = []
        self._open_role: str | None = None
        self._open_text: list[str] = []
        self._used_roles = False
        self._loose_text = False  # text outside any message (no chat request could carry it)
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, dict] = {}
        self.calls: list[CallRecord] = []
        self.children: list[ProgramState] = []
        self._stream_q: queue.Queue | None = queue.Queue() if stream else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixkv-program")
        self._pending: list = []
        self._error: BaseException | None = None
        self._computed = 0  # prompt tokens the runtime is known to hold (fork prefixes)
        self._finished = False  # the program returned: variables may still be set, nothing added
        self._trace: TraceWriter | None = None  # record_trace: every call becomes a trace line
        self._session: str | None = None  # the program run's id in the trace (forks share it)
        self._cache_session: str | None = None  # this state's session in the runtime's cache (hints)
        self.pins: list[str] = []  # ids of the pins s.pin() made
        # run_batch's first program: set once its first call's prompt is in the runtime's cache
        self._prefilled: threading.Event | None = None
        if _parent is not None:
            self._copy_from(_parent)

    # -- building ----------------------------------------------------------------------

    def __iadd__(self, expr) -> ProgramState:
        if not isinstance(expr, (str, Gen, Select, Role)):
            raise ProgramError(f"s += ... takes text, gen(...), select(...) or a role, not {type(expr).__name__}")
        self._submit(expr)
        return self

    def _submit(self, op) -> None:
        if self._finished:
            raise ProgramError("the program has finished: nothing more can be added to its state")
        self._pending.append(self._worker.submit(self._run_op, op))

    def __setitem__(self, name: str, value) -> None:
        """``s[name] = value`` sets a variable, in order with the operations before it
        (a later ``gen(name)`` overwrites it). It adds nothing to the prompt."""
        if not isinstance(name, str):
            raise ProgramError(f"s[name] = ... takes a str name, not {type(name).__name__}")
        if self._finished:
            self.variables[name] = value
        else:
            self._submit(_SetVar(name, value))

    def set_var(self, name: str, value) -> None:
        self[name] = value

    def pin(self, ttl: float | None = None) -> None:
        """Pin the state's prefix as it stands here (in order with the operations before
        it) in the runtime's cache: until ``backend.unpin(id)``, or ``ttl`` seconds. The
        id is appended to ``s.pins``. Needs a backend that pins (EngineBackend,
        RuntimeEndpoint); a runtime refuses pins past its max_pinned_share."""
        if ttl is not None and not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0):
            raise ProgramError(f"pin(ttl=...) needs seconds > 0 or None, got {ttl!r}")
        self._submit(_Pin(ttl))

    def get_var(self, name: str):
        return self[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.variables

    def system(self, expr=None):
        """``s.system(expr)`` adds a system message; ``with s.system():`` opens one that
        everything added inside the block goes into (as SGLang)."""
        return self._role_scope("system", expr)

    def user(self, expr=None):
        """``s.user(expr)``, or ``with s.user():`` (see ``system``)."""
        return self._role_scope("user", expr)

    def assistant(self, expr=None):
        """``s.assistant(expr)``, or ``with s.assistant():`` (see ``system``)."""
        return self._role_scope("assistant", expr)

    def _role_scope(self, role: str, expr):
        if expr is not None:
            self._submit(_role(role, expr))
            return None
        return self._message_block(role)

    @contextmanager
    def _message_block(self, role: str):
        self._submit(Role(role, (), True, False))
        yield self
        self._submit(Role(role, (), False, True))  # not after an exception: the message stays unfinished

    def _run_op(self, expr) -> None:
        if self._error is not None:
            return  # an earlier operation failed: the rest of the program does not run
        try:
            self._execute(expr)
        except BaseException as e:
            self._error = e

    def _execute(self, expr) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, _SetVar):
            self.variables[expr.name] = expr.value
        elif isinstance(expr, _Pin):
            if not self.backend.token_level:
                raise ProgramError(f"pin(): {type(self.backend).__name__} sends text; it cannot pin a prefix")
            with _naming("pin()"):
                self.pins.append(self.backend.pin(self._ids(), expr.ttl))
        else:
            self._role_op(expr)

    def _append(self, text: str, token_ids: Sequence[int] | None = None, marker: bool = False) -> None:
        if not text and not token_ids:
            return
        if token_ids is None:
            token_ids = self._tokenize(text, add_special_tokens=not self._segments)
        self._segments.append(Segment(text, tuple(token_ids)))
        if self._open_role is not None:
            self._open_text.append(text)
        elif not marker:
            self._loose_text = True
        if self._stream_q is not None and text:
            self._stream_q.put(text)

    def _tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of text the program adds: message content (a message is open) with its
        special-token text as plain text, else prompt text and markers with it special.
        A text-level backend (``token_level`` False) has none."""
        if not self.backend.token_level:
            return []
        if self._open_role is None:
            return self.backend.tokenize(text, add_special_tokens)
        return self.backend.tokenize(text, add_special_tokens, split_special_tokens=True)

    def _role_op(self, r: Role) -> None:
        if self._markers is None:
            self._markers = markers_for(self.backend)
        m = self._markers
        if r.begin:
            if self._open_role is not None:
                raise ProgramError(f"{r.role}(...) while the {self._open_role} message is still open")
            if r.role == "system" and self._used_roles:
                raise ProgramError("system(...) must be the first message of a program")
            self._append((m.begin if self._used_roles else m.first)[r.role], marker=True)
            self._used_roles = True
            self._open_role, self._open_text = r.role, []
        elif self._open_role != r.role:
            raise ProgramError(f"{r.role}_end() without an open {r.role} message")
        for piece in r.content:
            self._execute(piece)
        if r.end:
            content = "".join(self._open_text)
            self._open_role = None
            self._messages.append({"role": r.role, "content": content})
            self._append(m.end[r.role], marker=True)

    def _ids(self) -> list[int]:
        return [t for seg in self._segments for t in seg.token_ids]

    def _check_can_generate(self, what: str) -> None:
        if self._used_roles and self._open_role is None:
            last = self._messages[-1]["role"] if self._messages else "a"
            raise ProgramError(f"{what} after the {last} message was closed: generate inside a message, "
                               f"e.g. s += assistant({what.split('(')[0]}(...))")  # fmt: skip

    def _text_prompt(self, what: str) -> str | list[dict]:
        """What a text-level backend is sent: the finished messages (a chat request) once
        the program uses roles, else the program's text (a completion request)."""
        if not self._used_roles:
            text = "".join(seg.text for seg in self._segments)
            if not text:
                raise ProgramError(f"{what} on an empty state: add some text first")
            return text
        name = type(self.backend).__name__
        if self._loose_text:
            raise ProgramError(f"{what}: the program added text outside any message, which a chat completions "
                               f"request ({name}) cannot carry; put it inside a message")  # fmt: skip
        if self._open_role != "assistant" or self._open_text:
            raise ProgramError(f"{what}: over chat completions ({name}) a gen must be the first thing in an "
                               f"assistant message, e.g. s += assistant(gen(...)): the API cannot continue a "
                               f"message that already has text")  # fmt: skip
        return [dict(m) for m in self._messages]

    def _gen(self, g: Gen) -> None:
        what = f"gen({g.name!r})"
        self._check_can_generate(what)
        params = {**self.defaults, **g.params}
        if self.backend.token_level:
            prompt = self._ids()
            if not prompt:
                raise ProgramError(f"{what} on an empty state: add some text first")
        else:
            prompt = self._text_prompt(what)
        t0 = time.perf_counter()
        advice = self._advice()
        with _naming(what):
            # streamed for the program's stream, or to tell run_batch at the first token that the prompt is cached
            if self._stream_q is not None or (self._prefilled is not None and _streams(self.backend)):
                result = None
                for item in self.backend.stream(prompt, params, **advice):
                    if isinstance(item, Delta):
                        self._mark_prefilled()
                        if item.text and self._stream_q is not None:
                            self._stream_q.put(item.text)
                    else:
                        result = item
            else:
                (result,) = self.backend.generate([prompt], params, **advice)
        self._record("gen", g.name, prompt, result, time.perf_counter() - t0, params.get("priority", 0))
        ids = list(result.token_ids)
        if not self.backend.token_level:
            ids = []
        elif result.finish_reason == "stop":
            if ids and ids[-1] in self.backend.eos_token_ids | set(params.get("stop_token_ids", ())):
                ids.pop()  # the end-of-turn token: the role's end marker writes it back
            else:  # a stop string cut the text inside the ids
                ids = self._tokenize(result.text)
        self._segments.append(Segment(result.text, tuple(ids)))
        if self._open_role is not None:
            self._open_text.append(result.text)
        else:
            self._loose_text = True
        if self.backend.token_level:
            self._computed = len(prompt)
        if g.name is not None:
            self.variables[g.name] = result.text
            self.meta[g.name] = {"finish_reason": result.finish_reason, "token_ids": list(result.token_ids),
                                 "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
                                 "completion_tokens": result.generated}  # fmt: skip

    # -- select ----------------------------------------------------------------------------

    def _select(self, sel: Select) -> None:
        what = f"select({sel.name!r})"
        self._check_can_generate(what)
        method = sel.choices_method
        unconditional = bool(getattr(method, "requires_unconditional_logprobs", False))
        with _naming(what):
            if self.backend.token_level:
                keys, conditional, uncond = self._score_choices(sel, unconditional)
            else:
                keys, conditional, uncond = self._score_choices_text(sel, unconditional, what)
        conditional = _tie_shared_prefixes(keys, conditional)
        ids = [k if self.backend.token_level else [None] * len(k) for k in keys]
        inputs = [[(lp, t, None) for lp, t in zip(row, i)] for row, i in zip(conditional, ids)]
        uncond_inputs = None
        if uncond is not None:
            uncond = _tie_shared_prefixes(keys, uncond)
            uncond_inputs = [[(lp, t, None) for lp, t in zip(row, i)] for row, i in zip(uncond, ids)]
        decision = method(choices=list(sel.choices),
                          normalized_prompt_logprobs=[sum(row) / len(row) for row in conditional],
                          input_token_logprobs=inputs, output_token_logprobs=[[] for _ in sel.choices],
                          unconditional_token_logprobs=uncond_inputs)  # fmt: skip
        picked = getattr(decision, "decision", None)
        if picked not in sel.choices:
            raise ProgramError(f"{what}: the choices method {method!r} returned {picked!r}, not one of the choices")
        best = sel.choices.index(picked)
        self._segments.append(Segment(picked, tuple(keys[best]) if self.backend.token_level else ()))
        if self._open_role is not None:
            self._open_text.append(picked)
        else:
            self._loose_text = True
        if self._stream_q is not None:
            self._stream_q.put(picked)
        if sel.name is not None:
            self.variables[sel.name] = picked
            meta = dict(getattr(decision, "meta_info", None) or {})
            self.meta[sel.name] = {"choices": list(sel.choices), "logprobs": [sum(row) for row in conditional],
                                   "choices_method": getattr(method, "name", repr(method)), **meta}  # fmt: skip

    def _score_choices(self, sel: Select, unconditional: bool):
        """Token-level backends: each choice's token ids and the logprobs of those tokens
        after the state (and, if asked, with nothing before them)."""
        what = f"select({sel.name!r})"
        prompt = self._ids()
        if not prompt:
            raise ProgramError(f"{what} on an empty state: add some text first")
        options = [self._tokenize(c) for c in sel.choices]
        start = len(prompt)
        params = {"max_new_tokens": 1, "temperature": 0.0, "prompt_logprobs_from": start}
        t0 = time.perf_counter()
        # the first choice computes the shared prompt; the rest then find it cached
        results = self.backend.generate([prompt + options[0]], params)
        results += self.backend.generate([prompt + o for o in options[1:]], params) if len(options) > 1 else []
        seconds = (time.perf_counter() - t0) / len(options)
        conditional = []
        for o, r in zip(options, results):
            lps = (r.prompt_logprobs or [])[start : start + len(o)]
            if len(lps) != len(o) or any(lp is None for lp in lps):
                raise BackendError("the runtime returned no prompt logprobs for a choice")
            conditional.append(list(lps))
            self._record("select", sel.name, prompt + o, r, seconds)
        uncond = None
        if unconditional:  # each choice alone: its first token has no context, so no logprob
            t0 = time.perf_counter()
            params = {"max_new_tokens": 1, "temperature": 0.0, "prompt_logprobs_from": 0}
            alone = self.backend.generate([list(o) for o in options], params)
            seconds = (time.perf_counter() - t0) / len(options)
            uncond = []
            for o, r in zip(options, alone):
                lps = (r.prompt_logprobs or [])[: len(o)]
                if len(lps) != len(o) or any(lp is None for lp in lps[1:]):
                    raise BackendError("the runtime returned no prompt logprobs for a choice on its own")
                uncond.append([None, *lps[1:]])
                self._record("select", sel.name, o, r, seconds)
        return options, conditional, uncond

    def _score_choices_text(self, sel: Select, unconditional: bool, what: str):
        """Text-level backends (completions only): the backend scores each choice's text
        after the program's text; tokens are the server's, known by their text."""
        if self._used_roles:
            raise ProgramError(f"{what}: select over chat completions ({type(self.backend).__name__}) is not "
                               f"supported: every choices method needs the logprobs of given text, which the chat "
                               f"API does not return. Constrain a gen instead, e.g. assistant(gen({sel.name!r}, "
                               f"regex='(yes|no)')), where the server supports regex")  # fmt: skip
        prompt = self._text_prompt(what)
        t0 = time.perf_counter()
        scored = self.backend.score_text(prompt, list(sel.choices))
        seconds = (time.perf_counter() - t0) / len(sel.choices)
        keys, conditional = [], []
        for choice, sc in zip(sel.choices, scored):
            if not sc.logprobs or any(lp is None for lp in sc.logprobs):
                raise BackendError(f"the server returned no logprobs for the choice {choice!r}")
            keys.append(list(sc.tokens))
            conditional.append(list(sc.logprobs))
            self._record("select", sel.name, (), sc.result, seconds, sent=prompt + choice)
        uncond = None
        if unconditional:
            t0 = time.perf_counter()
            alone = self.backend.score_text("", list(sel.choices))
            seconds = (time.perf_counter() - t0) / len(sel.choices)
            uncond = []
            for choice, key, sc in zip(sel.choices, keys, alone):
                if list(sc.tokens) != key:
                    raise BackendError(f"the server tokenizes the choice {choice!r} differently on its own "
                                       f"({sc.tokens}) than after the prompt ({key}); unconditional_likelihood_"
                                       f"normalized needs the same tokens")  # fmt: skip
                uncond.append([None, *sc.logprobs[1:]])
                self._record("select", sel.name, (), sc.result, seconds, sent=choice)
        return keys, conditional, uncond

    def _mark_prefilled(self) -> None:
        """Tell run_batch (once) that a call of this program has its prompt computed."""
        if self._prefilled is not None:
            self._prefilled.set()
            self._prefilled = None

    def _record(self, kind, name, prompt, r: CallResult, seconds, priority: int = 0, sent=None) -> None:
        """Keep the call (``calls``) and, with record_trace, queue its trace line. ``sent``:
        what a text-level backend was sent when ``prompt`` does not say it."""
        self._mark_prefilled()
        ids = tuple(prompt) if self.backend.token_level else ()
        self.calls.append(CallRecord(kind, name, ids, r.prompt_tokens, r.cached_tokens, r.generated, seconds,
                                     r.ttft))  # fmt: skip
        if self._trace is None:
            return
        common = {"salt": _salt(self.backend), "arrival": time.perf_counter() - seconds, "priority": priority or 0,
                  "session": self._session, "cached_tokens": r.cached_tokens}  # fmt: skip
        if self.backend.token_level:
            self._trace.record(ids, list(r.token_ids), **common)
        else:  # the server tokenized: what was sent, and the output as a count
            sent = prompt if sent is None else sent
            self._trace.record(None, r.generated, **common,
                               **({"messages": sent} if isinstance(sent, list) else {"text": sent}))  # fmt: skip

    # -- forks -------------------------------------------------------------------------------

    def fork(self, size: int = 1) -> ForkGroup:
        """``size`` states that start from everything this one holds. The shared prefix
        is sent to the runtime once first, so every branch finds it cached."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ProgramError(f"fork(n) needs an int n >= 1, got {size!r}")
        self.sync()
        prompt = self._ids()
        advice = self._advice()
        if self.backend.token_level and len(prompt) > self._computed + 1:
            t0 = time.perf_counter()
            with _naming("fork"):  # the shared prefix, protected (with hints) until the branches come
                (r,) = self.backend.generate([prompt], {"max_new_tokens": 1, "temperature": 0.0}, **advice,
                                             **({"hint_uses": size} if advice else {}))  # fmt: skip
            self._record("prefix", None, prompt, r, time.perf_counter() - t0)
            self._computed = len(prompt)
        elif advice and prompt:
            with _naming("fork"):
                self.backend.hint(prompt, uses=size, session_id=self._cache_session)
        children = [ProgramState(self.backend, _parent=self) for _ in range(size)]  # text_iter shows the parent
        if self._cache_session is not None:
            for k, child in enumerate(children, len(self.children)):
                child._cache_session = f"{self._cache_session}/{k}"
        self.children += children
        return ForkGroup(children, self)

    def _copy_from(self, parent: ProgramState) -> None:
        self.defaults = dict(parent.defaults)
        self._markers = parent._markers
        self._segments = list(parent._segments)
        self._messages = [dict(m) for m in parent._messages]
        self._open_role, self._open_text = parent._open_role, list(parent._open_text)
        self._used_roles = parent._used_roles
        self._loose_text = parent._loose_text
        self.variables = dict(parent.variables)
        self._computed = parent._computed
        self._trace, self._session = parent._trace, parent._session

    # -- reading -----------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait for every operation submitted so far; raise the first failure."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        if self._error is not None:
            error = self._error
            if isinstance(error, (ProgramError, BackendError)):
                raise error
            raise ProgramError(f"the program failed: {type(error).__name__}: {error}") from error

    def __getitem__(self, name: str):
        self.sync()
        if name not in self.variables:
            known = ", ".join(sorted(self.variables)) or "none yet"
            raise UnknownVariableError(f"no variable {name!r} in this state (defined: {known})")
        return self.variables[name]

    def get_meta_info(self, name: str) -> dict:
        self[name]
        return self.meta.get(name, {})

    def text(self) -> str:
        self.sync()
        return "".join(seg.text for seg in self._segments)

    def token_ids(self) -> list[int]:
        self.sync()
        if not self.backend.token_level:
            raise ProgramError(f"token_ids(): {type(self.backend).__name__} sends text; the server's token ids "
                               f"are not known here")  # fmt: skip
        return self._ids()

    def messages(self) -> list[dict]:
        """The finished messages, as a chat request would send them."""
        self.sync()
        return [dict(m) for m in self._messages]

    def text_iter(self) -> Iterator[str]:
        """With ``run(..., stream=True)``: text pieces as they are added or generated."""
        if self._stream_q is None:
            raise ProgramError("text_iter() needs run(..., stream=True)")
        while (piece := self._stream_q.get()) is not None:
            if isinstance(piece, BaseException):
                raise piece
            yield piece

    def all_calls(self) -> list[CallRecord]:
        """This state's calls and its forks' (recursively), in that order."""
        return [*self.calls, *(c for child in self.children for c in child.all_calls())]

    def cache_report(self) -> CacheReport:
        report = CacheReport()
        for c in self.all_calls():
            report.calls += 1
            report.prompt_tokens += c.prompt_tokens
            report.cached_tokens += c.cached_tokens
        return report

    def _advice(self) -> dict:
        """The cache advice a request of this state carries (its session), if any."""
        return {"session_id": self._cache_session} if self._cache_session is not None else {}

    def _finish(self) -> None:
        """Wait for everything, forks included, and stop the worker threads; then end the
        state's session in the runtime's cache (its forks end theirs)."""
        try:
            for child in self.children:
                child._finish()
            self.sync()
        finally:
            self._finished = True
            self._worker.shutdown(wait=False)
            if self._cache_session is not None:
                try:
                    self.backend.end_session(self._cache_session)
                except (BackendError, RuntimeError):  # clean-up only: the advice times out on its own
                    pass


@contextmanager
def _naming(what: str):
    """Failures of a backend call name the operation: ``gen('answer'): the runtime
    answered 400 on sampling_params.regex: ...``. A bad value the in-process engine
    refuses (its SamplingParams check) becomes a ProgramError."""
    try:
        yield
    except BackendError as e:
        raise BackendError(f"{what}: {e}", status=e.status, param=e.param) from e
    except (ValueError, TypeError) as e:
        raise ProgramError(f"{what}: {e}") from e


def _tie_shared_prefixes(keys: list[list], rows: list[list]) -> list[list]:
    """Choices whose first k tokens are the same share those tokens' logprobs: they are
    the same conditional probabilities, computed in different requests, which may differ
    in the last bits. The first choice's values stand for all (ties stay exact ties)."""
    seen: dict[tuple, Any] = {}
    out = []
    for key, row in zip(keys, rows):
        new = []
        for j, lp in enumerate(row):
            new.append(seen.setdefault(tuple(key[: j + 1]), lp))
        out.append(new)
    return out


class ForkGroup:
    """The states ``s.fork(n)`` returns. Iterate or index it for the branches;
    ``forks += expr`` appends ``expr`` to every branch (a list or tuple of n
    expressions: one to each branch; a function: ``expr(i)`` to branch i), as SGLang;
    ``forks[i] += expr`` appends to branch i. ``join()`` waits for all of them and gives
    the parent each variable the branches set (and the parent had not), as a list with
    one value per branch (None where a branch did not set it)."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = list(states)
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def __setitem__(self, i: int, value) -> None:
        if value is not self.states[i]:  # ``forks[i] += expr`` assigns the same state back
            raise ProgramError("a fork group's branches cannot be replaced; forks[i] += expr adds to branch i")

    def __iadd__(self, expr) -> ForkGroup:
        if isinstance(expr, (list, tuple)):
            if len(expr) != len(self.states):
                raise ProgramError(f"forks += [...] needs one expression per branch: {len(self.states)} branches, "
                                   f"{len(expr)} expressions")  # fmt: skip
            pieces = list(expr)
        elif callable(expr):
            pieces = [expr(i) for i in range(len(self.states))]
        else:
            pieces = [expr] * len(self.states)
        for piece in pieces:  # check every piece before any branch gets one
            if not isinstance(piece, (str, Gen, Select, Role)):
                raise ProgramError(f"forks += ... takes text, gen(...), select(...) or a role, "
                                   f"not {type(piece).__name__}")  # fmt: skip
        for state, piece in zip(self.states, pieces):
            state += piece
        return self

    def __repr__(self) -> str:
        return f"ForkGroup({len(self.states)} branches)"

    def join(self) -> list[ProgramState]:
        for s in self.states:
            s.sync()
        names = {n for s in self.states for n in s.variables if n not in self.parent.variables}
        for name in sorted(names):
            self.parent.variables[name] = [s.variables.get(name) for s in self.states]
        return list(self.states)


# -- functions ----------------------------------------------------------------------------------

_default_backend: Backend | None = None
_default_trace: TraceWriter | None = None
_writers: dict[str, TraceWriter] = {}
_writers_lock = threading.Lock()


def set_default_backend(backend: Backend | None, record_trace: str | TraceWriter | None = None) -> None:
    """The backend of runs that pass none; with ``record_trace`` (a path or a
    TraceWriter) those runs record their calls there unless they pass their own."""
    global _default_backend, _default_trace
    _default_backend = backend
    _default_trace = None if record_trace is None else trace_writer(record_trace)


def trace_writer(record_trace: str | TraceWriter) -> TraceWriter:
    """The writer of a path: opened (the file started) on its first use in this process,
    shared afterwards. A TraceWriter is taken as it is."""
    if isinstance(record_trace, TraceWriter):
        return record_trace
    import os

    key = os.path.abspath(os.fspath(record_trace))
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = TraceWriter(key)
        return writer


def _salt(backend: Backend) -> str | None:
    """The cache salt a backend sends with every request, if any."""
    for attr in ("namespace", "cache_salt"):  # EngineBackend, RuntimeEndpoint
        value = getattr(backend, attr, None)
        if isinstance(value, str):
            return value
    salt = (getattr(backend, "extra_body", None) or {}).get("cache_salt")  # OpenAIBackend
    return salt if isinstance(salt, str) else None


def _run_trace(backend: Backend | None, record_trace) -> TraceWriter | None:
    if record_trace is not None:
        return trace_writer(record_trace)
    return _default_trace if backend is None or backend is _default_backend else None


def _start_trace(s: ProgramState, trace: TraceWriter | None, name: str) -> None:
    if trace is not None:
        s._trace, s._session = trace, f"{name}-{uuid.uuid4().hex[:12]}"


MAX_RUN_SESSION = MAX_SESSION_CHARS - 56  # a run's session id: its forks' sessions add "/<k>" per level


def _start_session(s: ProgramState, session_id: str | None, name: str) -> None:
    """The run's session in the runtime's cache, when its backend takes hints."""
    if session_id is not None and not (isinstance(session_id, str) and 0 < len(session_id) <= MAX_RUN_SESSION):
        raise ProgramError(f"run(session_id=...) needs a string of 1 to {MAX_RUN_SESSION} characters, got "
                           f"{session_id!r:.60}")  # fmt: skip
    if getattr(s.backend, "hints", False):
        s._cache_session = session_id or f"{name}-{uuid.uuid4().hex[:12]}"


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise ProgramError("no backend: pass backend=... or call set_default_backend(...)")
    return chosen


class ProgramFunction:
    """A program: ``fn.run(*args, **kwargs)``, ``fn.run_batch([kwargs or args, ...])``."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._signature = inspect.signature(fn)
        params = list(self._signature.parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise ProgramError(f"@function {fn.__name__}: the first parameter must be the state (s)")
        self._own = {p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @staticmethod
    def _defaults(given: dict) -> dict:
        """The sampling defaults in ``given`` (RUN_DEFAULTS names; None: unset)."""
        defaults = {k: v for k, v in given.items() if v is not None}
        if isinstance(defaults.get("stop"), str):
            defaults["stop"] = [defaults["stop"]]
        return defaults

    def _split(self, kwargs: dict) -> tuple[dict, dict]:
        """(defaults, the program's own keywords): a keyword that names a sampling field
        and no parameter of the program is a default for every gen."""
        given = {k: kwargs[k] for k in kwargs if k in RUN_DEFAULTS and k not in self._own}
        rest = {k: v for k, v in kwargs.items() if k not in given}
        return self._defaults(given), rest

    def _bind(self, args: tuple, kwargs: dict) -> None:
        try:
            self._signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise ProgramError(f"{self.__name__}(...): {e}") from None

    def run(self, *args, backend: Backend | None = None, stream: bool = False,
            record_trace: str | TraceWriter | None = None, session_id: str | None = None, **kwargs) -> ProgramState:
        """Run the program to the end and return its state. Keywords named like
        SamplingParams fields (``max_new_tokens``, ``temperature``, ``top_p``, ``stop``,
        ... but not a parameter of the program) are defaults for every gen that does not
        set them. With ``stream=True`` it runs in the background and returns at once:
        read ``state.text_iter()``. ``record_trace``: a path (or TraceWriter) that gets a
        trace line per call (module docstring). ``session_id``: the run's session in the
        runtime's cache (default: the run's own id; used when the backend takes hints)."""
        defaults, kwargs = self._split(kwargs)
        self._bind(args, kwargs)
        s = ProgramState(_backend(backend), stream=stream, defaults=defaults)
        _start_trace(s, _run_trace(backend, record_trace), self.__name__)
        _start_session(s, session_id, self.__name__)
        if not stream:
            self._execute(s, args, kwargs)
            return s

        def background():
            try:
                self._execute(s, args, kwargs)
            except BaseException as e:  # surfaced by text_iter
                s._stream_q.put(e)
            s._stream_q.put(None)

        threading.Thread(target=background, name=f"radixkv-{self.__name__}", daemon=True).start()
        return s

    def _execute(self, s: ProgramState, args: tuple, kwargs: dict) -> None:
        try:
            self.fn(s, *args, **kwargs)
        finally:
            s._finish()
            if s._trace is not None:
                s._trace.flush()  # the file holds the run's lines when run returns

    def run_batch(self, batch_kwargs: Sequence[dict | tuple | list], *, backend: Backend | None = None,
                  num_threads: int | str = 16, progress_bar: bool = False,
                  record_trace: str | TraceWriter | None = None, **defaults) -> list[ProgramState]:  # fmt: skip
        """Run the program once per item, ``num_threads`` at a time ("auto": 16); states
        in order. An item is a dict of keyword arguments or a tuple (or list) of
        positional ones. Other keywords (``temperature=``, ``max_new_tokens=``, ...) are
        defaults for every gen, as in ``run``. The first program runs alone until its first
        call's prompt is computed (its first streamed token, or the call's end where the
        backend does not stream), so that what all of them share (a system prompt, few-shot
        examples) is cached before the rest start; then the others join it. A failing
        program raises after the others finish."""
        unknown = sorted(set(defaults) - set(RUN_DEFAULTS))
        if unknown:
            raise ProgramError(f"run_batch(...) got unknown keywords {', '.join(unknown)}; the program's own "
                               f"arguments go in the items")  # fmt: skip
        defaults = self._defaults(defaults)
        if num_threads == "auto":
            num_threads = 16
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ProgramError(f"run_batch(num_threads=...) needs an int >= 1 or 'auto', got {num_threads!r}")
        calls = []
        for i, item in enumerate(batch_kwargs):
            if isinstance(item, dict):
                args, kwargs = (), dict(item)
            elif isinstance(item, (tuple, list)):
                args, kwargs = tuple(item), {}
            else:
                raise ProgramError(f"run_batch item {i} must be a dict of keyword arguments or a tuple of positional "
                                   f"ones, not {type(item).__name__}")  # fmt: skip
            try:
                self._bind(args, kwargs)
            except ProgramError as e:
                raise ProgramError(f"run_batch item {i}: {e}") from None
            calls.append((args, kwargs))
        chosen = _backend(backend)
        trace = _run_trace(backend, record_trace)  # each run is its own session
        states: list[ProgramState | None] = [None] * len(calls)
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(calls), desc=self.__name__)

        def one(i: int, prefilled: threading.Event | None = None) -> None:
            s = ProgramState(chosen, defaults=defaults)
            s._prefilled = prefilled
            _start_trace(s, trace, self.__name__)
            _start_session(s, None, self.__name__)
            states[i] = s
            try:
                self._execute(s, *calls[i])
            finally:
                if prefilled is not None:  # a program that ended (or failed) before any call
                    prefilled.set()
                if bar is not None:
                    bar.update(1)

        errors = []
        with ThreadPoolExecutor(num_threads) as pool:
            futures = []
            if calls:
                prefilled = threading.Event()
                futures.append(pool.submit(one, 0, prefilled))
                prefilled.wait()
            futures += [pool.submit(one, i) for i in range(1, len(calls))]
            for f in futures:
                try:
                    f.result()
                except Exception as e:
                    errors.append(e)
        if bar is not None:
            bar.close()
        if errors:
            raise errors[0]
        return states


def _streams(backend: Backend) -> bool:
    """Whether ``backend`` implements ``stream`` (the base class only declares it)."""
    return type(backend).stream is not Backend.stream


def function(fn: Callable) -> ProgramFunction:
    """Decorator: ``@function def program(s, ...)``."""
    return ProgramFunction(fn)
