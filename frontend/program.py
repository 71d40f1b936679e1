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
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from radixkv.frontend.backends import Backend, BackendError, CallResult, Delta


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
    "seed": "seed", "regex": "regex", "kv_policy": "kv_policy", "kv_budget": "kv_budget",
    "kv_compress_at": "kv_compress_at", "kv_rerotate": "kv_rerotate",
}  # fmt: skip


def gen(name: str | None = None, max_tokens: int = 128, stop: str | Sequence[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        repetition_penalty: float | None = None, ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None, seed: int | None = None, regex: str | None = None,
        kv_policy: str | None = None, kv_budget: int | float | None = None,
        kv_compress_at: int | None = None, kv_rerotate: bool | None = None) -> Gen:  # fmt: skip
    """Generate into the state; ``s[name]`` is the text. Unset options keep the
    runtime's defaults (SamplingParams). ``regex`` constrains the output to a full
    match of the pattern (see radixkv.engine.constrain). ``kv_policy`` and ``kv_budget``
    (and ``kv_compress_at``, prompt tokens of context) bound the KV this generation
    keeps (see radixkv.cache.compress; ``kv_rerotate``: positions within the cache, so
    a decode-time budget runs past the model's context); the compressed state is shared through the
    runtime's cache like any prefix."""
    given = dict(locals())
    params = {ours: given[kw] for kw, ours in GEN_PARAMS.items() if given[kw] is not None}
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return Gen(name, params)


def select(name: str | None, choices: Sequence[str]) -> Select:
    """Append the choice the model finds most likely (highest total log-probability of
    its tokens after the state); ``s[name]`` is the choice."""
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ProgramError("select(choices=...) needs a non-empty list of non-empty strings")
    return Select(name, tuple(choices))


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


class ProgramState:
    """The state ``s`` a program builds; see the module docstring."""

    def __init__(self, backend: Backend, stream: bool = False, _parent: ProgramState | None = None):
        self.backend = backend
        self._markers: ChatMarkers | None = None
        self._segments: list[Segment] = []
        self._messages: list[dict] = []
        self._open_role: str | None = None
        self._open_text: list[str] = []
        self._used_roles = False
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, dict] = {}
        self.calls: list[CallRecord] = []
        self.children: list[ProgramState] = []
        self._stream_q: queue.Queue | None = queue.Queue() if stream else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixkv-program")
        self._pending: list = []
        self._error: BaseException | None = None
        self._computed = 0  # prompt tokens the runtime is known to hold (fork prefixes)
        if _parent is not None:
            self._copy_from(_parent)

    # -- building ----------------------------------------------------------------------

    def __iadd__(self, expr) -> ProgramState:
        if not isinstance(expr, (str, Gen, Select, Role)):
            raise ProgramError(f"s += ... takes text, gen(...), select(...) or a role, not {type(expr).__name__}")
        self._pending.append(self._worker.submit(self._run_op, expr))
        return self

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
        else:
            self._role_op(expr)

    def _append(self, text: str, token_ids: Sequence[int] | None = None) -> None:
        if not text and not token_ids:
            return
        if token_ids is None:
            token_ids = self._tokenize(text, add_special_tokens=not self._segments)
        self._segments.append(Segment(text, tuple(token_ids)))
        if self._open_role is not None:
            self._open_text.append(text)
        if self._stream_q is not None and text:
            self._stream_q.put(text)

    def _tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of text the program adds: message content (a message is open) with its
        special-token text as plain text, else prompt text and markers with it special."""
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
            self._append((m.begin if self._used_roles else m.first)[r.role])
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
            self._append(m.end[r.role])

    def _ids(self) -> list[int]:
        return [t for seg in self._segments for t in seg.token_ids]

    def _check_can_generate(self, what: str) -> None:
        if self._used_roles and self._open_role is None:
            last = self._messages[-1]["role"] if self._messages else "a"
            raise ProgramError(f"{what} after the {last} message was closed: generate inside a message, "
                               f"e.g. s += assistant({what.split('(')[0]}(...))")  # fmt: skip

    def _gen(self, g: Gen) -> None:
        self._check_can_generate(f"gen({g.name!r})")
        prompt = self._ids()
        if not prompt:
            raise ProgramError(f"gen({g.name!r}) on an empty state: add some text first")
        t0 = time.perf_counter()
        if self._stream_q is not None:
            result = None
            for item in self.backend.stream(prompt, g.params):
                if isinstance(item, Delta):
                    if item.text:
                        self._stream_q.put(item.text)
                else:
                    result = item
        else:
            (result,) = self.backend.generate([prompt], g.params)
        self._record("gen", g.name, prompt, result, time.perf_counter() - t0)
        ids = list(result.token_ids)
        if result.finish_reason == "stop":
            if ids and ids[-1] in self.backend.eos_token_ids | set(g.params.get("stop_token_ids", ())):
                ids.pop()  # the end-of-turn token: the role's end marker writes it back
            else:  # a stop string cut the text inside the ids
                ids = self._tokenize(result.text)
        self._segments.append(Segment(result.text, tuple(ids)))
        if self._open_role is not None:
            self._open_text.append(result.text)
        self._computed = len(prompt)
        if g.name is not None:
            self.variables[g.name] = result.text
            self.meta[g.name] = {"finish_reason": result.finish_reason, "token_ids": list(result.token_ids)}

    def _select(self, sel: Select) -> None:
        self._check_can_generate(f"select({sel.name!r})")
        prompt = self._ids()
        if not prompt:
            raise ProgramError(f"select({sel.name!r}) on an empty state: add some text first")
        options = [self._tokenize(c) for c in sel.choices]
        start = len(prompt)
        params = {"max_new_tokens": 1, "temperature": 0.0, "prompt_logprobs_from": start}
        t0 = time.perf_counter()
        # the first choice computes the shared prompt; the rest then find it cached
        results = self.backend.generate([prompt + options[0]], params)
        results += self.backend.generate([prompt + o for o in options[1:]], params) if len(options) > 1 else []
        seconds = time.perf_counter() - t0
        scores = []
        for o, r in zip(options, results):
            lps = r.prompt_logprobs[start : start + len(o)]
            if len(lps) != len(o) or any(lp is None for lp in lps):
                raise BackendError("the runtime returned no prompt logprobs for a choice")
            scores.append(sum(lps))
            self._record("select", sel.name, prompt + o, r, seconds / len(options))
        best = max(range(len(options)), key=scores.__getitem__)
        self._segments.append(Segment(sel.choices[best], tuple(options[best])))
        if self._open_role is not None:
            self._open_text.append(sel.choices[best])
        if self._stream_q is not None:
            self._stream_q.put(sel.choices[best])
        if sel.name is not None:
            self.variables[sel.name] = sel.choices[best]
            self.meta[sel.name] = {"choices": list(sel.choices), "logprobs": scores}

    def _record(self, kind, name, prompt, r: CallResult, seconds) -> None:
        self.calls.append(CallRecord(kind, name, tuple(prompt), r.prompt_tokens, r.cached_tokens,
                                     r.generated, seconds, r.ttft))  # fmt: skip

    # -- forks -------------------------------------------------------------------------------

    def fork(self, n: int) -> ForkGroup:
        """``n`` states that start from everything this one holds. The shared prefix is
        sent to the runtime once first, so every branch finds it cached."""
        if not isinstance(n, int) or n < 1:
            raise ProgramError(f"fork(n) needs an int n >= 1, got {n!r}")
        self.sync()
        prompt = self._ids()
        if len(prompt) > self._computed + 1:
            t0 = time.perf_counter()
            (r,) = self.backend.generate([prompt], {"max_new_tokens": 1, "temperature": 0.0})
            self._record("prefix", None, prompt, r, time.perf_counter() - t0)
            self._computed = len(prompt)
        children = [ProgramState(self.backend, _parent=self) for _ in range(n)]  # text_iter shows the parent
        self.children += children
        return ForkGroup(children, self)

    def _copy_from(self, parent: ProgramState) -> None:
        self._markers = parent._markers
        self._segments = list(parent._segments)
        self._messages = [dict(m) for m in parent._messages]
        self._open_role, self._open_text = parent._open_role, list(parent._open_text)
        self._used_roles = parent._used_roles
        self.variables = dict(parent.variables)
        self._computed = parent._computed

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

    def _finish(self) -> None:
        """Wait for everything, forks included, and stop the worker threads."""
        try:
            for child in self.children:
                child._finish()
            self.sync()
        finally:
            self._worker.shutdown(wait=False)


class ForkGroup(list):
    """The states ``s.fork(n)`` returns; ``join()`` waits for all of them and gives the
    parent each variable the branches set, as a list (one value per branch)."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        super().__init__(states)
        self.parent = parent

    def join(self) -> list[ProgramState]:
        for s in self:
            s.sync()
        names = {n for s in self for n in s.variables if n not in self.parent.variables}
        for name in sorted(names):
            self.parent.variables[name] = [s.variables.get(name) for s in self]
        return list(self)


# -- functions ----------------------------------------------------------------------------------

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    _default_backend = backend


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise ProgramError("no backend: pass backend=... or call set_default_backend(...)")
    return chosen


class ProgramFunction:
    """A program: ``fn.run(**kwargs)``, ``fn.run_batch([kwargs, ...])``."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def run(self, *, backend: Backend | None = None, stream: bool = False, **kwargs) -> ProgramState:
        """Run the program to the end and return its state. With ``stream=True`` it runs
        in the background and returns at once: read ``state.text_iter()``."""
        s = ProgramState(_backend(backend), stream=stream)
        if not stream:
            self._execute(s, kwargs)
            return s

        def background():
            try:
                self._execute(s, kwargs)
            except BaseException as e:  # surfaced by text_iter
                s._stream_q.put(e)
            s._stream_q.put(None)

        threading.Thread(target=background, name=f"radixkv-{self.__name__}", daemon=True).start()
        return s

    def _execute(self, s: ProgramState, kwargs: dict) -> None:
        try:
            self.fn(s, **kwargs)
        finally:
            s._finish()

    def run_batch(self, batch_kwargs: list[dict], *, backend: Backend | None = None, num_threads: int = 16,
                  progress_bar: bool = False) -> list[ProgramState]:  # fmt: skip
        """Run the program once per kwargs dict, ``num_threads`` at a time; states in
        order. The first runs alone, so that what all of them share (a system prompt,
        few-shot examples) is cached before the rest start. A failing program raises
        after the others finish."""
        chosen = _backend(backend)
        states: list[ProgramState | None] = [None] * len(batch_kwargs)
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.__name__)

        def one(i: int) -> None:
            s = ProgramState(chosen)
            states[i] = s
            try:
                self._execute(s, batch_kwargs[i])
            finally:
                if bar is not None:
                    bar.update(1)

        errors = []
        if batch_kwargs:
            try:
                one(0)
            except Exception as e:
                errors.append(e)
        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            for f in [pool.submit(one, i) for i in range(1, len(batch_kwargs))]:
                try:
                    f.result()
                except Exception as e:
                    errors.append(e)
        if bar is not None:
            bar.close()
        if errors:
            raise errors[0]
        return states


def function(fn: Callable) -> ProgramFunction:
    """Decorator: ``@function def program(s, ...)``."""
    return ProgramFunction(fn)
