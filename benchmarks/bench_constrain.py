"""Constrained decoding cost: what a regex constraint adds to each decode step.

For each pattern: compile time (``Grammar.compile``: the llguidance matcher and its first
mask, what runs off the engine thread) and the per-step mask time (``Constraint.allowed``
after each token, what runs on the engine thread), over a fixed token sequence that the
pattern accepts (or until it stops accepting). Hostile patterns are included: the ones
the hostile test of the server used against the old backtracking matcher, and the
largest a request may send. The embedded SmolLM2 tokenizer (49,152 tokens).

    .venv/bin/python benchmarks/bench_constrain.py [--json benchmarks/out/bench_constrain.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from radixkv.engine.constrain import Grammar  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402
from radixkv.model.tokenizer import Tokenizer  # noqa: E402

CASES = [  # (name, pattern, text the steps feed)
    ("date", r"2024-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", "2024-11-22"),
    ("email", r"[a-z]{1,20}@[a-z]{1,20}\.(com|org|net)", "someone@example.org"),
    ("json object", r'\{"name": "[A-Za-z ]{1,40}", "age": [0-9]{1,3}\}', '{"name": "Ada Lovelace", "age": 36}'),
    ("free text", r"[^\n]{0,400}", "The capital of France is Paris, and the capital of Italy is Rome."),
    ("backtracking (a|a)+c", r"(a|a)+c", "a" * 60 + "c"),
    ("nested (x+x+)+y", r"(x+x+)+y", "x" * 60 + "y"),
    ("largest repeat a{4000}", r"a{4000}", "a" * 200),
    ("nested repeats (a{40}){100}", r"(a{40}){100}", "a" * 200),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_constrain.json")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.load(resolve_model())
    grammar = Grammar(tok, tok.vocab_size)
    t0 = time.perf_counter()
    grammar.compile("a")  # builds the llguidance tokenizer once
    setup = time.perf_counter() - t0
    rows = []
    for name, pattern, text in CASES:
        ids = tok.encode(text, add_special_tokens=False)
        compiles, steps = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            c = grammar.compile(pattern)
            compiles.append(time.perf_counter() - t0)
            for t in ids:
                if not bool(c.allowed()[t]):
                    break
                c.advance(t)
                t0 = time.perf_counter()
                c.allowed()
                steps.append(time.perf_counter() - t0)
        rows.append({"case": name, "pattern": pattern, "tokens": len(ids), "compile_ms": statistics.median(compiles) * 1e3,
                     "step_ms_median": statistics.median(steps) * 1e3, "step_ms_max": max(steps) * 1e3})  # fmt: skip
    print(f"llguidance tokenizer for {tok.vocab_size} tokens built in {setup * 1e3:.0f} ms; median of {args.repeat}")
    print(f"{'case':<30}{'tokens':>7}{'compile ms':>12}{'step ms (median)':>18}{'step ms (max)':>15}")
    for r in rows:
        print(f"{r['case']:<30}{r['tokens']:>7}{r['compile_ms']:>12.2f}{r['step_ms_median']:>18.3f}{r['step_ms_max']:>15.3f}")
    write_result(args.json, rows, tokenizer_setup_ms=setup * 1e3, repeat=args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
