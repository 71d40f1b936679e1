"""Regex-constrained decoding: at every step, only tokens that keep the generated text
a possible prefix of a full match stay samplable; an end-of-sequence token only once the
text is a full match.

The check is ``regex``'s partial full-match over the text so far plus each token's text,
for every token of the vocabulary (one pass of C calls, ~50-100 ms per step for a 49k
vocabulary on one CPU core): meant for short structured outputs (numbers, choices,
dates, identifiers), not for long free text. A token whose text is not whole characters
on its own (a piece of a multi-byte character) is never allowed, so patterns over
non-ASCII text may find no path.
"""

from __future__ import annotations

import regex
import torch

MAX_PATTERN_CHARS = 1000


def compile_pattern(pattern: object):
    """The compiled pattern; ValueError naming ``regex`` when it is not a valid one."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"regex must be a non-empty str, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"regex must be at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"regex {pattern!r} does not compile: {e}") from None


class TokenTexts:
    """Each token id's text alone, decoded once per tokenizer (the vocabulary walk is
    what a constrained step costs; decoding it again every step would double it)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.texts = [tokenizer.decode([i]) for i in range(vocab_size)]
        self.eos = frozenset(t for t in tokenizer.eos_token_ids if t < vocab_size)


def allowed_tokens(pattern, text: str, vocab: TokenTexts) -> torch.Tensor:
    """Bool [V]: the tokens that may follow ``text`` under ``pattern``."""
    full = pattern.fullmatch
    ok = [bool(t) and "\ufffd" not in t and full(text + t, partial=True) is not None for t in vocab.texts]
    if full(text) is not None:  # a complete match may end here
        for t in vocab.eos:
            ok[t] = True
    return torch.tensor(ok, dtype=torch.bool)
