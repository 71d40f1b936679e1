"""Constrained decoding cost: what a constraint adds to each decode step.

Parts (``--parts``, default all):

- ``steps``: for each case of ``benchmarks/constrain_cases.py``, compile time (the
  llguidance matcher and its first mask, what runs off the engine thread; no compile
  cache, so every repeat pays for a new grammar) and the per-step mask time
  (``Constraint.allowed`` after each token), over a fixed token sequence the case
  accepts. Regex and JSON cases go through ``Grammar.compile`` as a request's ``regex``
  / ``json_schema`` do. Hostile patterns included. ``peers/xgrammar_masks.py`` runs the
  same cases on xgrammar.
- ``batch``: the issue's target, in the engine: 16 requests decoding together
  (greedy, ``ignore_eos`` and ``min_tokens``: 48 tokens each), unconstrained and then each constrained to
  a grammar that stays open for the whole run (free-text regex, a JSON schema with one
  long string, the tool-call grammar of two tools in ``auto`` mode); the overhead per
  step is the difference of the decode time divided by the steps. Runs interleaved.
- ``before``: the hand-written matcher that llguidance replaced (commit ca87493's
  ``constrain.py``, read from git): its per-step mask time for one request on the
  free-text regex; a batch of 16 costs 16 times that on the engine thread.

    .venv/bin/python benchmarks/bench_constrain.py [--parts steps batch before]
        [--kinds all|regex|json_schema|json_object ...] [--json-layout fixed|flexible]
        [--repeat 5] [--json benchmarks/out/bench_constrain.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.constrain_cases import JSON_LAYOUTS, KINDS, Case, llguidance_schema, select  # noqa: E402
from radixkv.engine.constrain import Constraint, Grammar, GrammarSpec  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402
from radixkv.model.tokenizer import Tokenizer  # noqa: E402

def compile_case(grammar: Grammar, case: Case, layout: str) -> Constraint:
    """A case's constraint as a request's field would compile it."""
    if case.kind == "regex":
        return grammar.compile(case.grammar)
    return grammar.compile(GrammarSpec("json_schema", json.dumps(llguidance_schema(case, layout))))


def part_steps(tok, args) -> list[dict]:
    cases = select("all" if "all" in args.kinds else args.kinds)
    grammar = Grammar(tok, tok.vocab_size, cached=0)  # every repeat pays what a new grammar costs
    t0 = time.perf_counter()
    grammar.compile("a")  # builds the llguidance tokenizer once
    setup = time.perf_counter() - t0
    rows = []
    for case in cases:
        ids = tok.encode(case.text, add_special_tokens=False)
        compiles, steps = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            c = compile_case(grammar, case, args.json_layout)
            compiles.append(time.perf_counter() - t0)
            for t in ids:
                if not bool(c.allowed()[t]):
                    break
                c.advance(t)
                t0 = time.perf_counter()
                c.allowed()
                steps.append(time.perf_counter() - t0)
        pattern = case.grammar if case.kind == "regex" else json.dumps(llguidance_schema(case, args.json_layout))
        rows.append({"part": "steps", "case": case.name, "kind": case.kind, "engine": "llguidance", "pattern": pattern,
                     "tokens": len(ids), "compile_ms": statistics.median(compiles) * 1e3,
                     "step_ms_median": statistics.median(steps) * 1e3, "step_ms_max": max(steps) * 1e3})  # fmt: skip
    print(f"llguidance tokenizer for {tok.vocab_size} tokens built in {setup * 1e3:.0f} ms; median of {args.repeat}")
    print(f"{'case':<30}{'tokens':>7}{'compile ms':>12}{'step ms (median)':>18}{'step ms (max)':>15}")
    for r in rows:
        print(f"{r['case']:<30}{r['tokens']:>7}{r['compile_ms']:>12.2f}{r['step_ms_median']:>18.3f}{r['step_ms_max']:>15.3f}")
    return rows


BATCH, BATCH_TOKENS = 16, 48
TOPICS = ["rivers", "volcanoes", "bread", "chess", "owls", "glass", "trains", "tea", "maps", "bees", "salt", "kites",
          "clocks", "moss", "ships", "paper"]  # fmt: skip


def batch_grammars() -> dict[str, dict]:
    from radixkv.server.tools import tool_grammar, tool_spec

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "add", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
    return {
        "regex free text": {"regex": r"[^\n]{0,1000}"},
        "json_schema long string": {"json_schema": json.dumps({"type": "object", "properties": {
            "essay": {"type": "string", "minLength": 1000}}, "required": ["essay"]})},
        "tools auto (lazy grammar)": {"ebnf": tool_grammar(tool_spec(tools, "auto", True))},
    }


def part_batch(args) -> list[dict]:
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling import SamplingParams

    from radixkv.engine.output import OutputProcessor

    # The engine thread's time in output processing (logits processors with the masks,
    # then per token: the constraint's advance, stop checks, detokenization), per run:
    # the overhead a constraint adds is its difference, free of the forward's noise.
    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    OutputProcessor.process = timed(OutputProcessor.process)
    OutputProcessor.append = timed(OutputProcessor.append)
    prompts = [f"Write a long essay about {t}." for t in TOPICS[:BATCH]]
    base = dict(max_new_tokens=BATCH_TOKENS, min_tokens=BATCH_TOKENS, temperature=0, ignore_eos=True)
    variants = {"unconstrained": {}, **batch_grammars()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    inside: dict[str, list[float]] = {k: [] for k in variants}
    with Engine(attention_backend=args.attention_backend) as engine:
        for name, extra in variants.items():  # warm-up: the llguidance tokenizer, grammars cached
            engine.generate(prompts, SamplingParams(**base, **extra))
        for _ in range(args.repeat):
            for name, extra in variants.items():
                params = SamplingParams(**base, **extra)
                spent[0] = 0.0
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params)
                times[name].append(time.perf_counter() - t0)
                inside[name].append(spent[0])
                assert all(len(o.outputs[0].token_ids) == BATCH_TOKENS for o in outs), name
        engine.pool.check_integrity()
    plain = statistics.median(times["unconstrained"])
    plain_in = statistics.median(inside["unconstrained"])
    rows = []
    print(f"\nbatch {BATCH} x {BATCH_TOKENS} tokens (greedy, every request {BATCH_TOKENS} tokens), median of "
          f"{args.repeat}, interleaved; output processing = the engine thread's time in it")  # fmt: skip
    print(f"{'variant':<28}{'run s':>8}{'ms/step':>9}{'e2e overhead':>14}{'output ms/step':>16}{'overhead ms/step':>18}")
    for name, ts in times.items():
        run, spent_in = statistics.median(ts), statistics.median(inside[name])
        over = (run - plain) / BATCH_TOKENS * 1e3
        over_in = (spent_in - plain_in) / BATCH_TOKENS * 1e3
        rows.append({"part": "batch", "variant": name, "batch": BATCH, "tokens": BATCH_TOKENS, "run_s": run,
                     "ms_per_step": run / BATCH_TOKENS * 1e3, "e2e_overhead_ms_per_step": over,
                     "output_ms_per_step": spent_in / BATCH_TOKENS * 1e3, "overhead_ms_per_step": over_in,
                     "runs": ts, "output_s": inside[name]})  # fmt: skip
        print(f"{name:<28}{run:>8.2f}{run / BATCH_TOKENS * 1e3:>9.1f}{over:>14.2f}{spent_in / BATCH_TOKENS * 1e3:>16.2f}"
              f"{over_in:>18.2f}")
    return rows


def part_before(tok, args) -> list[dict]:
    """The hand-written matcher (before llguidance), from git, on the free-text regex."""
    import importlib.util
    import subprocess
    import tempfile

    src = subprocess.run(["git", "show", "ca87493:radixkv/engine/constrain.py"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("handwritten_constrain", f.name)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    pattern = old.compile_pattern(r"[^\n]{0,1000}")
    vocab = old.TokenTexts(tok, tok.vocab_size)
    text, steps = "", []
    for piece in ["The", " capital", " of", " France", " is", " Paris", "."]:
        t0 = time.perf_counter()
        old.allowed_tokens(pattern, text, vocab)
        steps.append(time.perf_counter() - t0)
        text += piece
    step = statistics.median(steps)
    print(f"\nhand-written matcher (ca87493), free-text regex: {step * 1e3:.1f} ms a step for one request, "
          f"{step * BATCH * 1e3:.0f} ms for a batch of {BATCH}")
    return [{"part": "before", "case": "free text", "step_ms_median": step * 1e3, "batch_ms": step * BATCH * 1e3,
             "steps": [x * 1e3 for x in steps]}]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_constrain.json")
    ap.add_argument("--parts", nargs="+", default=["steps", "batch", "before"], choices=["steps", "batch", "before"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=["all"], choices=["all", *KINDS])
    ap.add_argument("--json-layout", default="fixed", choices=list(JSON_LAYOUTS), help="whitespace of the JSON cases")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    tok = Tokenizer.load(resolve_model())
    rows = []
    if "steps" in args.parts:
        rows += part_steps(tok, args)
    if "batch" in args.parts:
        rows += part_batch(args)
    if "before" in args.parts:
        rows += part_before(tok, args)
    write_result(args.json, rows, repeat=args.repeat, json_layout=args.json_layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
