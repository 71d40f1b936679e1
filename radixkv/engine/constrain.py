"""Constrained decoding on llguidance: regex, JSON schema, EBNF/Lark grammars, choices.

At every step a constrained request may only sample tokens that keep its output a
possible prefix of a sentence of its grammar; an end-of-sequence token only once the
output is complete. llguidance computes that token mask from a derivative-based lexer
and an Earley parser over the tokenizer's token trie: no backtracking, every step capped
by a fuel budget, the lexer's states (its memory) capped too.

Why llguidance rather than xgrammar (measured in benchmarks/bench_constrain.py and
benchmarks/peers/xgrammar_masks.py): it has no dependencies (xgrammar needs torch and
transformers at run time), it reads our ``tokenizers`` JSON as is, its limits are
explicit per matcher, it releases the GIL while it computes a mask (so masks overlap
the model's forward), and a mask costs 0.02-0.3 ms per step for the grammars in the
tests on this machine's CPU.

One grammar per request, named by the SamplingParams field that carries it:

    regex        a regular expression (Rust regex syntax), the whole output matches it
    json_schema  a JSON schema (JSON text); ``{"type": "object"}`` is any JSON object
    ebnf         a grammar in llguidance's Lark syntax or llama.cpp's GBNF; a rule may
                 embed a JSON schema (``%json {...}``), as tool calls do
    choices      the output is exactly one of these strings

Where the work happens:

    client thread / worker thread          engine thread, every step
    ---------------------------------      ------------------------------------
    check_grammar (in SamplingParams)      prefetch(constraints)   accelerator forward:
    Grammar.compile(spec) -> Constraint      masks computed on the mask thread while
      (validated grammars and a started      the device runs (llguidance drops the GIL)
       matcher are cached per spec; a      disallowed(constraints) after: the batch's
       new request deep-copies one)          masks as one bool tensor (computed here
                                             when not prefetched), and their errors
                                           Constraint.advance(token)

``Grammar.compile`` never runs on the server's event loop (the server calls it through
``asyncio.to_thread``) nor on the engine thread.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Sequence

import numpy as np
import torch

from radixkv.engine.config import cpu_count
from radixkv.errors import FieldError

MAX_PATTERN_CHARS = 1000
MAX_REPEAT = 4_000  # a{n}, (a{m}){n}: at most this many repeats, nested ones multiplied
MAX_GRAMMAR_CHARS = 100_000  # a json_schema or ebnf text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1000
CACHED_GRAMMARS = 32  # compiled specs kept (LRU; a matcher's lexer may hold tens of MB)
# llguidance's limits for one matcher. Fuel: ~50k units/ms building, ~14k/ms per step;
# states: 1-2 kB each. So a step costs at most ~15 ms and a matcher at most ~40 MB.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=50_000, max_lexer_states=20_000,
              max_grammar_size=50_000, verbose_errors=False)  # fmt: skip
KINDS = ("regex", "json_schema", "ebnf", "choices")


class GrammarSpec(NamedTuple):
    """What a request is constrained to: ``kind`` (one of KINDS, also the field that
    carries it) and its ``source`` (text; for choices a tuple of strings)."""

    kind: str
    source: str | tuple[str, ...]

    def llguidance(self) -> str:
        """The grammar in llguidance's own format."""
        import llguidance

        if self.kind == "choices":
            return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in self.source))
        if self.kind == "json_schema":
            return llguidance.grammar_from("json_schema", json.dumps(json_layout(json.loads(self.source))))
        return llguidance.grammar_from({"regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf"}[self.kind],
                                       self.source)  # fmt: skip


# JSON on one line, separators as Python's json.dumps writes them: a small model given
# free whitespace can spend its whole budget on newlines. A schema's own "x-guidance"
# (llguidance's options) wins.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_layout(schema):
    """``schema`` with radixkv's JSON layout (``JSON_LAYOUT``) unless it sets its own."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": JSON_LAYOUT}
    return schema


def check_regex(pattern: object, validate: bool = True) -> None:
    """The checks of a regex that need no tokenizer (type, length, repetition counts,
    syntax), in well under a millisecond; FieldError naming ``regex``."""
    if not isinstance(pattern, str) or not pattern:
        raise FieldError("regex", f"regex must be a non-empty str, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise FieldError("regex", f"regex must be at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
    largest = _largest_repeat(pattern)
    if largest > MAX_REPEAT:
        raise FieldError("regex", f"regex repeats at most {MAX_REPEAT} times ({{m,n}}), got {largest}")
    if validate:
        _validate(GrammarSpec("regex", pattern))


def check_grammar(kind: str, value: object, validate: bool = True) -> GrammarSpec:
    """The spec of a ``kind`` constraint from a request's value, checked without a
    tokenizer (type, size, syntax); FieldError naming ``kind``. ``json_schema`` takes
    JSON text or an already-parsed dict / bool; ``choices`` a list of strings."""
    if kind == "regex":
        check_regex(value, validate)
        return GrammarSpec("regex", value)
    if kind == "json_schema":
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            raise FieldError(kind, f"json_schema must be a JSON schema (JSON text or an object), got {value!r}")
        _check_size(kind, value)
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise FieldError(kind, f"json_schema is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise FieldError(kind, f"json_schema must be a JSON object, got {type(parsed).__name__}")
        spec = GrammarSpec(kind, value)
    elif kind == "ebnf":
        if not isinstance(value, str) or not value.strip():
            raise FieldError(kind, f"ebnf must be a non-empty grammar (Lark or GBNF), got {value!r}")
        _check_size(kind, value)
        spec = GrammarSpec(kind, value)
    elif kind == "choices":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise FieldError(kind, f"choices must be a non-empty list of str, got {value!r}")
        if len(value) > MAX_CHOICES:
            raise FieldError(kind, f"choices must have at most {MAX_CHOICES} entries, got {len(value)}")
        for i, c in enumerate(value):
            if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                raise FieldError(kind, f"choices[{i}] must be a str of 1 to {MAX_CHOICE_CHARS} characters, got {c!r}")
        spec = GrammarSpec(kind, tuple(value))
    else:
        raise FieldError("grammar", f"a grammar kind is one of {', '.join(KINDS)}, got {kind!r}")
    if validate:
        _validate(spec)
    return spec


def _check_size(kind: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise FieldError(kind, f"{kind} must be at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")


def _validate(spec: GrammarSpec) -> None:
    import llguidance

    try:
        grammar = spec.llguidance()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, None, limits=llguidance.LLParserLimits(**LIMITS)
        )
    except (ValueError, RuntimeError) as e:  # a converter's own error (GBNF, JSON)
        failed, messages = True, [str(e)]
    if failed:
        raise FieldError(spec.kind, f"{spec.kind} {_short(spec.source)} does not compile: "
                                    f"{' '.join(messages[0].split())[:300]}")  # fmt: skip


def _largest_repeat(pattern: str) -> int:
    """The most times any piece of ``pattern`` can repeat through counted repetitions
    (``{m}``, ``{m,}``, ``{m,n}``), nested ones multiplied: ``(a{10}){20}`` is 200. Counts
    outside escapes and character classes; 0 when there is none."""
    stack = [0]  # per open group: the largest repeat inside it so far
    last = 0  # the repeat of the atom or group just closed (what a quantifier applies to)
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, 1
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, last = True, 1
            if pattern[i + 1 : i + 2] == "]":  # "[]...]": a leading ] is literal
                i += 1
        elif c == "(":
            stack.append(0)
        elif c == ")" and len(stack) > 1:
            last = max(stack.pop(), 1)
            stack[-1] = max(stack[-1], last)
        elif c == "{":
            end = pattern.find("}", i)
            body = pattern[i + 1 : end] if end > 0 else ""
            parts = body.split(",")
            if len(parts) <= 2 and parts[0].isdigit() and all(p.isdigit() or p == "" for p in parts):
                last = max(last, 1) * max(int(p) for p in parts if p)
                stack[-1] = max(stack[-1], last)
                i = end
        else:
            last = 1
        i += 1
    return max(stack)


def _short(source) -> str:
    text = source if isinstance(source, str) else json.dumps(list(source))
    return repr(text if len(text) <= 80 else text[:77] + "...")


class Grammar:
    """Compiles constraints for one tokenizer. The llguidance tokenizer behind it is
    built on first use (~0.4 s for a 49k vocabulary) and shared; the last
    ``CACHED_GRAMMARS`` specs keep a started matcher that new requests copy (a copy
    takes microseconds; building one, milliseconds). Safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int, cached: int = CACHED_GRAMMARS):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._cached = cached
        self.hits = self.misses = 0

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now rather than in the first
        constrained request: it takes ~0.6 s for the embedded model's 49k tokens and holds
        the GIL for most of it, which would stall a server's event loop (``radixkv serve``
        calls this before it listens)."""
        self._ll_tokenizer()

    def _ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                tok = self._tokenizer
                eos = sorted(tok.eos_token_ids)
                source = tok.tokenizers_json()
                if source is None:
                    source = llguidance.TokenizerWrapper(_WrappedTokenizer(tok))
                self._ll = llguidance.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=eos)
            return self._ll

    def compile(self, spec: GrammarSpec | str) -> Constraint:
        """A fresh constraint for ``spec`` (a plain str is a regex), its first mask
        computed. Raises FieldError naming the spec's kind when the grammar is invalid
        or exceeds the limits."""
        import llguidance

        if isinstance(spec, str):
            spec = GrammarSpec("regex", spec)
        with self._lock:
            started = self._cache.get(spec)
            if started is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return Constraint(started.deep_copy(), self.vocab_size, spec.kind)
        # the cheap checks only: building the matcher validates the grammar (again, when
        # SamplingParams already did; a large schema's validation takes tens of ms)
        spec = check_grammar(spec.kind, spec.source, validate=False)
        ll = self._ll_tokenizer()
        try:
            matcher = llguidance.LLMatcher(ll, spec.llguidance(), limits=llguidance.LLParserLimits(**LIMITS),
                                           log_level=0)  # fmt: skip
        except (ValueError, RuntimeError) as e:  # a converter's own error (GBNF, JSON)
            raise FieldError(spec.kind, f"{spec.kind} {_short(spec.source)} does not compile: {e}") from None
        constraint = Constraint(matcher, self.vocab_size, spec.kind)
        constraint.allowed()  # builds the lexer's start: the costly part of a large grammar
        if constraint.error is not None:
            raise FieldError(spec.kind, f"{spec.kind} {_short(spec.source)} cannot be used: "
                                        f"{constraint.error.splitlines()[0]}")  # fmt: skip
        with self._lock:
            self.misses += 1
            self._cache[spec] = matcher.deep_copy()
            while len(self._cache) > self._cached:
                self._cache.popitem(last=False)
        return constraint


_mask_thread: ThreadPoolExecutor | None = None
_mask_thread_lock = threading.Lock()


def prefetch(constraints: Sequence[Constraint]) -> None:
    """Start computing the next masks of ``constraints`` on the mask thread (one for
    the process; llguidance releases the GIL while it works), so they are ready when
    the step's logits are: call right after launching a forward that runs on an
    accelerator, while this thread would only wait for it. (On a CPU-only machine the
    forward already uses every core; a second thread there only contends with it, so
    the engine computes masks inline: ``disallowed``.)"""
    global _mask_thread
    todo = [c for c in constraints if not c._ready and c._pending is None]
    if not todo:
        return
    with _mask_thread_lock:
        if _mask_thread is None:
            _mask_thread = ThreadPoolExecutor(1, thread_name_prefix="radixkv-masks")
    future = _mask_thread.submit(_compute_all, todo)
    for c in todo:
        c._pending = future


_llexecutor = None


def _executor():
    """llguidance's thread pool for a batch of masks (one thread per core)."""
    global _llexecutor
    with _mask_thread_lock:
        if _llexecutor is None:
            import llguidance

            _llexecutor = llguidance.LLExecutor(cpu_count())
        return _llexecutor


def _compute_all(constraints: list[Constraint]) -> None:
    for c in constraints:
        c._compute()


def disallowed(constraints: Sequence[Constraint], vocab: int) -> tuple[torch.Tensor, list[str | None], list[int]]:
    """One step's masks for a batch, vectorised: bool ``[len(constraints), vocab]``, True
    where a token may not come next (columns past the tokenizer's vocabulary too); per
    constraint the error that ends it (a grammar limit hit, or no token left), else
    None; and how many tokens each allows. Computes the masks not computed yet
    (``prefetch``)."""
    words = np.empty((len(constraints), constraints[0]._words.size), dtype=np.int32)
    todo = []  # (matcher, row) of masks not computed yet: llguidance fills them in parallel, GIL released
    for j, c in enumerate(constraints):
        c._wait()
        if c._ready:
            words[j] = c._words
        else:
            todo.append((c._m, j))
    if len(todo) > 1:
        _executor().unsafe_compute_mask_ptr(todo, words.ctypes.data, words.shape[1] * 4, len(constraints))
    elif todo:
        todo[0][0].unsafe_compute_mask_ptr(words[todo[0][1]].ctypes.data, words.shape[1] * 4)
    for _, j in todo:
        constraints[j]._words[:] = words[j]
        constraints[j]._ready = True
    width = min(vocab, constraints[0].vocab_size)
    bad = np.unpackbits((~words).view(np.uint8), axis=1, count=width, bitorder="little").view(bool)
    if width < vocab:
        bad = np.concatenate([bad, np.ones((len(constraints), vocab - width), dtype=bool)], axis=1)
    counts = np.bitwise_count(words.view(np.uint32)).sum(axis=1, dtype=np.int64).tolist()
    errors = [c.error or (None if n else "no token can continue") for c, n in zip(constraints, counts)]
    return torch.from_numpy(bad), errors, counts


class Constraint:
    """One sequence's position in its grammar. Not thread-safe: after ``compile`` only
    the engine thread uses it (and the mask thread, between ``prefetch`` and the next
    ``allowed``). ``kind`` names the request field its grammar came from."""

    def __init__(self, matcher, vocab_size: int, kind: str = "regex"):
        self._m = matcher
        self.vocab_size = vocab_size
        self.kind = kind
        self._words = np.empty((vocab_size + 31) // 32, dtype=np.int32)  # the mask's bits, token i at bit i
        self._ready = False  # _words holds the current position's mask
        self._mask: torch.Tensor | None = None  # allowed(), from _words
        self._pending: Future | None = None  # the mask thread is computing _words

    def copy(self) -> Constraint:
        """An independent constraint at the same position (for ``n`` > 1 samples)."""
        self._wait()
        return Constraint(self._m.deep_copy(), self.vocab_size, self.kind)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def _compute(self) -> None:
        if not self._ready:
            self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            self._ready = True

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens that may come next. Cached until ``advance``.
        In the error state nothing is allowed but end-of-sequence."""
        self._wait()
        self._compute()
        if self._mask is None:
            bits = np.unpackbits(self._words.view(np.uint8), count=self.vocab_size, bitorder="little")
            self._mask = torch.from_numpy(bits.view(bool))
        return self._mask

    def advance(self, token: int) -> None:
        """The sampled ``token`` joins the output; an invalid one puts the constraint in
        its error state (see ``error``)."""
        self._wait()
        self._m.consume_token(int(token))
        self._ready, self._mask = False, None

    @property
    def done(self) -> bool:
        """The grammar is finished: nothing may follow (after end-of-sequence, or when
        the output can no longer be extended)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the constraint failed (a limit hit, an invalid grammar or token), else None."""
        self._wait()
        return self._m.get_error() or None if self._m.is_error() else None


class _WrappedTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer it cannot load from
    JSON: token bytes, eos/bos ids and an encode call."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_tokens.values())

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)
