"""Constrained decoding cost: what a constraint adds to each decode step.

For each case of ``benchmarks/constrain_cases.py``: compile time (the llguidance matcher
and its first mask, what runs off the engine thread) and the per-step mask time
(``Constraint.allowed`` after each token, what runs on the engine thread), over a fixed
token sequence that the case accepts (or until it stops accepting). Regex cases go
through ``Grammar.compile``, as a request's ``regex`` does; hostile patterns are
included: the ones the hostile test of the server used against the old backtracking
matcher, and the largest a request may send. JSON cases (a schema, any JSON object) have
no request field yet: they run through llguidance directly, the way ``Grammar.compile``
would (validated, a matcher under the same limits, its first mask), into the same
``Constraint``. The embedded SmolLM2 tokenizer (49,152 tokens).
``benchmarks/peers/xgrammar_masks.py`` runs the same cases on xgrammar.

    .venv/bin/python benchmarks/bench_constrain.py [--kinds all|regex|json_schema|json_object ...]
        [--json-layout fixed|flexible] [--repeat 5] [--json benchmarks/out/bench_constrain.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.constrain_cases import JSON_LAYOUTS, KINDS, Case, llguidance_schema, select  # noqa: E402
from radixkv.engine.constrain import LIMITS, Constraint, Grammar  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402
from radixkv.model.tokenizer import Tokenizer  # noqa: E402

def compile_json(grammar: Grammar, tok, case: Case, layout: str) -> Constraint:
    """A constraint for a JSON case in ``layout`` (``constrain_cases.JSON_LAYOUTS``),
    built as ``Grammar.compile`` builds a regex's: validated under ``LIMITS``, a matcher
    on the grammar's llguidance tokenizer, its first mask computed."""
    import llguidance

    g = llguidance.LLMatcher.grammar_from_json_schema(llguidance_schema(case, layout))
    limits = llguidance.LLParserLimits(**LIMITS)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g, None, limits=limits)
    if failed:
        raise ValueError(f"{case.name}: {messages[0]}")
    matcher = llguidance.LLMatcher(grammar._ll_tokenizer(), g, limits=limits, log_level=0)
    constraint = Constraint(matcher, tok.vocab_size)
    constraint.allowed()
    if constraint.error is not None:
        raise ValueError(f"{case.name}: {constraint.error}")
    return constraint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_constrain.json")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=["all"], choices=["all", *KINDS])
    ap.add_argument("--json-layout", default="fixed", choices=list(JSON_LAYOUTS), help="whitespace of the JSON cases")
    args = ap.parse_args()
    cases = select("all" if "all" in args.kinds else args.kinds)
    tok = Tokenizer.load(resolve_model())
    # no compile cache (where Grammar has one): every repeat pays what a new grammar costs
    uncached = {"cached": 0} if "cached" in inspect.signature(Grammar).parameters else {}
    grammar = Grammar(tok, tok.vocab_size, **uncached)
    t0 = time.perf_counter()
    grammar.compile("a")  # builds the llguidance tokenizer once
    setup = time.perf_counter() - t0
    rows = []
    for case in cases:
        ids = tok.encode(case.text, add_special_tokens=False)
        compiles, steps = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            c = grammar.compile(case.grammar) if case.kind == "regex" else compile_json(grammar, tok, case, args.json_layout)
            compiles.append(time.perf_counter() - t0)
            for t in ids:
                if not bool(c.allowed()[t]):
                    break
                c.advance(t)
                t0 = time.perf_counter()
                c.allowed()
                steps.append(time.perf_counter() - t0)
        pattern = case.grammar if case.kind == "regex" else json.dumps(llguidance_schema(case, args.json_layout))
        rows.append({"case": case.name, "kind": case.kind, "engine": "llguidance", "pattern": pattern, "tokens": len(ids), "compile_ms": statistics.median(compiles) * 1e3,
                     "step_ms_median": statistics.median(steps) * 1e3, "step_ms_max": max(steps) * 1e3})  # fmt: skip
    print(f"llguidance tokenizer for {tok.vocab_size} tokens built in {setup * 1e3:.0f} ms; median of {args.repeat}")
    print(f"{'case':<30}{'tokens':>7}{'compile ms':>12}{'step ms (median)':>18}{'step ms (max)':>15}")
    for r in rows:
        print(f"{r['case']:<30}{r['tokens']:>7}{r['compile_ms']:>12.2f}{r['step_ms_median']:>18.3f}{r['step_ms_max']:>15.3f}")
    write_result(args.json, rows, tokenizer_setup_ms=setup * 1e3, repeat=args.repeat, json_layout=args.json_layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
