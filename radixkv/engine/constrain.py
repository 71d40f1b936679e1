"""Constrained decoding (regex) on llguidance, a maintained grammar engine.

At every step a constrained request may only sample tokens that keep its output a
possible prefix of a full match; an end-of-sequence token only once the output is a full
match. llguidance computes that token mask from a derivative-based lexer over the
tokenizer's token trie: no backtracking, so time per step is linear in what it explores,
and every step is capped by a fuel budget; the lexer's states (its memory) are capped
too. Why llguidance rather than xgrammar: it has no dependencies (xgrammar requires
transformers and an unpinned triton at run time), it reads our ``tokenizers`` JSON as
is, its limits are explicit per matcher, and a mask costs 0.03-0.3 ms per step for the
patterns in the tests on this machine's CPU (the hand-written matcher it replaces took
50-100 ms and could backtrack for minutes).

Where the work happens:

    client thread / worker thread          engine thread, every step
    ---------------------------------      ------------------------------------
    check_regex (in SamplingParams)        Constraint.allowed()  -> bool [V] mask
    Grammar.compile(regex) -> Constraint   Constraint.advance(token)
      (builds the matcher and its first     Constraint.done / .error
       mask, so a pattern too large for
       the limits is refused there)

``Grammar.compile`` never runs on the server's event loop (the server calls it through
``asyncio.to_thread``) nor on the engine thread. Nothing is cached across requests:
a request's matcher is freed with the request.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from radixkv.errors import FieldError

MAX_PATTERN_CHARS = 1000
MAX_REPEAT = 4_000  # a{n}, (a{m}){n}: at most this many repeats, nested ones multiplied
# llguidance's limits for one matcher. Fuel: ~50k units/ms building, ~14k/ms per step;
# states: 1-2 kB each. So a step costs at most ~15 ms and a matcher at most ~40 MB.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=50_000, max_lexer_states=20_000,
              max_grammar_size=50_000, verbose_errors=False)  # fmt: skip


def check_regex(pattern: object) -> None:
    """The checks that need no tokenizer (type, length, repetition counts, syntax), in
    well under a millisecond; ValueError naming ``regex``. Whether the pattern fits the
    limits over a vocabulary is ``Grammar.compile``'s to say."""
    import llguidance

    if not isinstance(pattern, str) or not pattern:
        raise FieldError("regex", f"regex must be a non-empty str, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise FieldError("regex", f"regex must be at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
    largest = _largest_repeat(pattern)
    if largest > MAX_REPEAT:
        raise FieldError("regex", f"regex repeats at most {MAX_REPEAT} times ({{m,n}}), got {largest}")
    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=llguidance.LLParserLimits(**LIMITS)
    )
    if failed:
        raise FieldError("regex", f"regex {_short(pattern)} does not compile: {' '.join(messages[0].split())[:300]}")


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


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


class Grammar:
    """Compiles constraints for one tokenizer. The llguidance tokenizer behind it is
    built on first use (~0.4 s for a 49k vocabulary) and shared; safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None
        self._lock = threading.Lock()

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

    def compile(self, regex: str) -> Constraint:
        """A fresh constraint for ``regex``, its first mask computed. Raises ValueError
        naming ``regex`` when the pattern is invalid or exceeds the limits."""
        import llguidance

        check_regex(regex)
        ll = self._ll_tokenizer()
        grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        matcher = llguidance.LLMatcher(ll, grammar, limits=llguidance.LLParserLimits(**LIMITS), log_level=0)
        constraint = Constraint(matcher, self.vocab_size)
        constraint.allowed()  # builds the lexer's start: the costly part of a large pattern
        if constraint.error is not None:
            raise FieldError("regex", f"regex {_short(regex)} cannot be used: {constraint.error.splitlines()[0]}")
        return constraint


class Constraint:
    """One sequence's position in its grammar. Not thread-safe: after ``compile`` only
    the engine thread uses it."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._words = np.empty((vocab_size + 31) // 32, dtype=np.int32)
        self._mask: torch.Tensor | None = None  # of the current position

    def copy(self) -> Constraint:
        """An independent constraint at the same position (for ``n`` > 1 samples)."""
        return Constraint(self._m.deep_copy(), self.vocab_size)

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens that may come next. Cached until ``advance``.
        In the error state nothing is allowed but end-of-sequence."""
        if self._mask is None:
            self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size]
            self._mask = torch.from_numpy(bits.astype(bool))
        return self._mask

    def advance(self, token: int) -> None:
        """The sampled ``token`` joins the output; an invalid one puts the constraint in
        its error state (see ``error``)."""
        self._m.consume_token(int(token))
        self._mask = None

    @property
    def done(self) -> bool:
        """The grammar is finished: nothing may follow (after end-of-sequence, or when
        the output can no longer be extended)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the constraint failed (a limit hit, an invalid pattern or token), else None."""
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
