"""Long-context test data shared by radixkv's benchmarks and the peers (kvpress, HF
transformers): pure Python, no torch or transformers import, so any venv can use it.

Everything is built as text first and only then tokenized by the caller's tokenizer
(``count_tokens`` is any ``str -> int``), so every system sees the same prompts.

- ``licence_text()``: long natural text from the licence files every Debian image ships
  (/usr/share/common-licenses): GPL-3 first, then GFDL-1.3, then the other files in
  name order (symlinks skipped: GPL -> GPL-3 etc.), each stripped of trailing
  whitespace, joined with one blank line. (bench_kvquant.py tokenizes GPL-3 and
  GFDL-1.3 separately and concatenates the ids; tokenizing the joined text differs only
  at the file boundary, beyond GPL-3's ~7.6k tokens for SmolLM2.)
- ``passkey_parts()`` / ``passkey_prompt()``: the passkey-retrieval test of Landmark
  Attention (Mohtashami & Jaggi 2023) and LongLoRA: a 5-digit key in repeated filler
  sentences at a given depth, followed by the question.

    import sys; sys.path.insert(0, "benchmarks")
    from longctx_data import licence_text, passkey_prompt, passkey_keys
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

LICENCE_DIR = Path("/usr/share/common-licenses")
LICENCE_FIRST = ("GPL-3", "GFDL-1.3")

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize them. I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = "The pass key is"


def licence_files(directory: Path = LICENCE_DIR) -> list[Path]:
    """The licence files in reading order: GPL-3, GFDL-1.3, then the rest by name."""
    first = [directory / name for name in LICENCE_FIRST if (directory / name).is_file()]
    rest = sorted(
        p for p in directory.iterdir() if p.is_file() and not p.is_symlink() and p.name not in LICENCE_FIRST
    )
    return first + rest


def licence_text(directory: Path = LICENCE_DIR) -> str:
    """The licence texts concatenated, one blank line between files."""
    return "\n\n".join(p.read_text().rstrip() for p in licence_files(directory))


def passkey_keys(n: int, seed: int = 0) -> list[int]:
    """``n`` distinct 5-digit keys (10000..99999), reproducible from ``seed``."""
    return random.Random(seed).sample(range(10000, 100000), n)


def _haystack(n_filler: int, depth: float, key: int) -> str:
    before = round(n_filler * depth)
    parts = [PASSKEY_INTRO] + [PASSKEY_FILLER] * before + [PASSKEY_NEEDLE.format(key=key)]
    parts += [PASSKEY_FILLER] * (n_filler - before)
    return " ".join(parts)


def passkey_parts(length_tokens_approx: int, depth: float, key: int, count_tokens: Callable[[str], int]) -> dict:
    """The pieces of a passkey prompt of about ``length_tokens_approx`` tokens (plain
    form, ``passkey_prompt``), the needle after ``depth`` (0..1) of the filler sentences.

    Returns {"haystack", "question", "answer_prefix", "key", "n_filler", "depth"}:
    plain text is ``haystack + "\\n" + question + " " + answer_prefix``; a chat form puts
    ``haystack + "\\n" + question`` in the user turn and starts the assistant turn with
    ``answer_prefix``. The filler count is solved from the token counts of the pieces,
    then corrected once against the whole prompt's count (tokenizers merge across the
    joins), so the plain prompt is within one filler unit (~25 tokens) of the target.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    tail = "\n" + PASSKEY_QUESTION + " " + PASSKEY_ANSWER_PREFIX
    fixed = count_tokens(_haystack(0, depth, key) + tail)
    unit = max(1, count_tokens(" ".join([PASSKEY_FILLER] * 8)) / 8)
    n = max(0, round((length_tokens_approx - fixed) / unit))
    for _ in range(2):  # correct for the joins' tokenization
        total = count_tokens(_haystack(n, depth, key) + tail)
        n = max(0, n + round((length_tokens_approx - total) / unit))
    while n > 0 and count_tokens(_haystack(n, depth, key) + tail) > length_tokens_approx:
        n -= 1  # never above the target (it may be a hard context limit)
    return {
        "haystack": _haystack(n, depth, key),
        "question": PASSKEY_QUESTION,
        "answer_prefix": PASSKEY_ANSWER_PREFIX,
        "key": key,
        "n_filler": n,
        "depth": depth,
    }


def passkey_prompt(length_tokens_approx: int, depth: float, key: int, count_tokens: Callable[[str], int]) -> str:
    """The plain-text passkey prompt (at most ``length_tokens_approx`` tokens by
    ``count_tokens``), ending in "The pass key is"; the answer is the key's digits."""
    p = passkey_parts(length_tokens_approx, depth, key, count_tokens)
    return p["haystack"] + "\n" + p["question"] + " " + p["answer_prefix"]


def passkey_correct(generated: str, key: int) -> bool:
    """Whether a generation retrieved the key: its first 5-digit run equals the key."""
    digits = "".join(ch if ch.isdigit() else " " for ch in generated).split()
    return bool(digits) and digits[0] == str(key)
