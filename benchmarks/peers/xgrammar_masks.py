"""xgrammar against llguidance: compile time and per-step mask time on this CPU, for
every case of ``benchmarks/constrain_cases.py`` (regex, JSON schema, any JSON object).

Same protocol as ``bench_constrain.py``: the case's text is tokenized with the embedded
SmolLM2 tokenizer (49,152 tokens, ids from radixkv's own ``encode``); compile = the
grammar compiled for the tokenizer, a matcher made and its first mask computed; then for
each token: check that the current mask allows it, accept it, and time the next mask.
Reported per case and engine: the median compile time over ``--repeat`` runs, and the
median and max of every step of every run. Runs are interleaved: each repeat runs every
case on both engines, the engines' order alternating from one repeat to the next.

The mask each engine computes is its raw bitmask, 32 tokens a word, what a sampler
applies (xgrammar: ``GrammarMatcher.fill_next_token_bitmask`` into the int32 tensor of
``allocate_token_bitmask``; llguidance: ``LLMatcher.unsafe_compute_mask_ptr`` into an
int32 array). radixkv's ``Constraint.allowed()`` (what ``bench_constrain.py`` times) also
unpacks that bitmask into a bool tensor. The masks of the two engines are compared at
every step of the first repeat (``mask_diff``).

The engines, as a server would set them up:
- llguidance: ``LLTokenizer`` from the tokenizer's ``tokenizers`` JSON with the eos ids
  {0, 2}, matchers under radixkv's own limits (``radixkv.engine.constrain.LIMITS``);
  JSON schemas through ``LLMatcher.grammar_from_json_schema``, any JSON object as the
  schema ``{"type": "object"}``, the layout (``--json-layout``: ``fixed``, radixkv's,
  or ``flexible``, the engines' default) as ``constrain_cases.JSON_LAYOUTS`` says.
- xgrammar: ``TokenizerInfo`` over the same vocabulary (byte-level, as
  ``TokenizerInfo.from_huggingface`` detects it, stop tokens 0 and 2), a
  ``GrammarCompiler`` with its cache off (every repeat compiles) and ``--threads``
  compile threads; ``compile_regex``, ``compile_json_schema`` (strict mode, its
  default; the layout's whitespace options), any JSON object as
  ``compile_json_schema({"type": "object"})``. xgrammar treats a token as special
  (never allowed) only when its decoded text is empty, so the 15 special tokens that
  are not stop tokens (``<|im_start|>``, ``<repo_name>``, ...) would be allowed as their
  literal text ("<|im_start|>" matches ``[^\\n]*``); they are given as "" here so that
  both engines forbid them (``--xgrammar-literal-specials`` keeps xgrammar's mapping).

Where the masks differ (``mask_diff``), xgrammar allows more: where the grammar forces
the next bytes, llguidance allows only the token that starts their canonical
tokenization (after ``{"`` of ``{"id": ...`` it allows ``id`` but not ``i``; in
``a{4000}`` only the longest run of a's), xgrammar every token that fits; and inside JSON
strings xgrammar allows a raw DEL (0x7f), which JSON permits and llguidance excludes.

The tokenizer comes from radixkv (the embedded GGUF), which this venv does not install:
the script runs itself once in the project's venv (``--dump-tokenizer``) to write the
tokenizers JSON, the eos ids, radixkv's llguidance limits and every case's token ids to
``benchmarks/out/smollm2_tokenizer.json``, and reads that file afterwards (it rewrites it
when the cases' texts change).

    bash benchmarks/peers/setup_xgrammar.sh        # .peers/xgrammar-venv
    .peers/xgrammar-venv/bin/python benchmarks/peers/xgrammar_masks.py [--repeat 5]
        [--kinds all|regex|json_schema|json_object ...] [--engines xgrammar llguidance]
        [--json-layout fixed|flexible] [--threads 1] [--json benchmarks/out/xgrammar_masks.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.constrain_cases import JSON_LAYOUTS, KINDS, Case, llguidance_schema, select  # noqa: E402

VOCAB_SIZE = 49152  # the SmolLM2 lm_head's width: the mask size
TOKENIZER_FILE = ROOT / "benchmarks/out/smollm2_tokenizer.json"
MAIN_PYTHON = Path(os.environ.get("RADIXKV_PYTHON", ROOT / ".venv/bin/python"))


# --- the tokenizer, from the project's venv -------------------------------------------


def dump_tokenizer(path: Path) -> None:
    """(In the project's venv.) Write the embedded tokenizer's JSON, its eos ids, radixkv's
    llguidance limits and each case's token ids (radixkv's ``encode``) to ``path``."""
    from benchmarks.constrain_cases import CASES
    from radixkv.engine.constrain import LIMITS
    from radixkv.model import resolve_model
    from radixkv.model.tokenizer import Tokenizer

    source = resolve_model()
    tok = Tokenizer.load(source)
    data = {
        "model": str(source.path),
        "vocab_size": tok.vocab_size,
        "eos_token_ids": sorted(tok.eos_token_ids),
        "special_tokens": dict(tok.special_tokens),
        "llguidance_limits": LIMITS,
        "cases": {c.name: {"text": c.text, "ids": tok.encode(c.text, add_special_tokens=False)} for c in CASES},
        "tokenizers_json": tok.tokenizers_json(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    print(f"wrote {path}")


def load_tokenizer(path: Path, cases: list[Case]) -> dict:
    """The dump at ``path``, written first (by the project's venv) when missing or when a
    case's text differs from the one it was tokenized from."""

    def fresh(data):
        return all(data["cases"].get(c.name, {}).get("text") == c.text for c in cases)

    if path.exists():
        data = json.loads(path.read_text())
        if fresh(data):
            return data
    if not MAIN_PYTHON.exists():
        raise SystemExit(f"{path} is missing and {MAIN_PYTHON} (the project's venv, to write it) does not exist")
    subprocess.run([str(MAIN_PYTHON), __file__, "--dump-tokenizer", str(path)], check=True, cwd=ROOT)
    data = json.loads(path.read_text())
    if not fresh(data):
        raise SystemExit(f"{path}: the cases' texts still differ after rewriting it")
    return data


# --- the two engines ------------------------------------------------------------------


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: dict, threads: int, literal_specials: bool, layout: str):
        import torch
        import transformers
        import xgrammar as xgr
        from tokenizers import Tokenizer as HFTokenizer

        self.xgr, self.torch = xgr, torch
        self.json_options = JSON_LAYOUTS[layout][1]
        eos = tok["eos_token_ids"]
        # what xgrammar detects from the tokenizer (vocab type, prefix space)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok["tokenizers_json"]))
        detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE, stop_token_ids=eos)
        spec = json.loads(tok["tokenizers_json"])
        encoded = [""] * VOCAB_SIZE
        for piece, i in spec["model"]["vocab"].items():
            encoded[i] = piece
        for added in spec["added_tokens"]:
            encoded[added["id"]] = added["content"]
        self.blanked = []
        if not literal_specials:
            self.blanked = sorted(a["id"] for a in spec["added_tokens"] if a["special"] and a["id"] not in eos)
            for i in self.blanked:
                encoded[i] = ""
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=VOCAB_SIZE, stop_token_ids=eos,
                                      add_prefix_space=detected.add_prefix_space)  # fmt: skip
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.describe = {
            "vocab_type": detected.vocab_type.name,
            "add_prefix_space": detected.add_prefix_space,
            "stop_token_ids": list(self.info.stop_token_ids),
            "special_token_ids": list(self.info.special_token_ids),
            "special_token_ids_from_huggingface": list(detected.special_token_ids),
            "blanked_specials": self.blanked,
            "compile_threads": threads,
        }
        self.words = xgr.allocate_token_bitmask(1, VOCAB_SIZE)

    def compile(self, case: Case):
        if case.kind == "regex":
            grammar = self.compiler.compile_regex(case.grammar)
        elif case.kind == "json_schema":
            grammar = self.compiler.compile_json_schema(json.dumps(case.grammar), **self.json_options)
        else:
            grammar = self.compiler.compile_json_schema(json.dumps({"type": "object"}), **self.json_options)
        m = self.xgr.GrammarMatcher(grammar)
        self.mask(m)
        return m

    def mask(self, m) -> None:
        m.fill_next_token_bitmask(self.words)

    def allows(self, token: int) -> bool:
        return bool((int(self.words[0, token >> 5]) >> (token & 31)) & 1)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def bits(self) -> bytes:
        return self.words.numpy().tobytes()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: dict, layout: str):
        import llguidance
        import numpy as np

        self.ll, self.layout = llguidance, layout
        t0 = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok["tokenizers_json"], n_vocab=VOCAB_SIZE, eos_token=tok["eos_token_ids"])
        self.setup_s = time.perf_counter() - t0
        self.limits = tok["llguidance_limits"]
        self.describe = {"special_token_ids": [i for i in range(VOCAB_SIZE) if self.tokenizer.is_special_token(i)],
                         "limits": self.limits}  # fmt: skip
        self.words = np.zeros((VOCAB_SIZE + 31) // 32, dtype=np.int32)

    def compile(self, case: Case):
        M = self.ll.LLMatcher
        if case.kind == "regex":
            grammar = M.grammar_from_regex(case.grammar)
        else:
            grammar = M.grammar_from_json_schema(llguidance_schema(case, self.layout))
        m = M(self.tokenizer, grammar, limits=self.ll.LLParserLimits(**self.limits), log_level=0)
        self.mask(m)
        if m.is_error():
            raise RuntimeError(f"llguidance refused {case.name!r}: {m.get_error()}")
        return m

    def mask(self, m) -> None:
        m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)

    def allows(self, token: int) -> bool:
        return bool((int(self.words[token >> 5]) >> (token & 31)) & 1)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def bits(self) -> bytes:
        return self.words.tobytes()


def run_once(engine, case: Case, ids: list[int], keep_masks: bool):
    """One compile and one pass over ``ids``: (compile s, step seconds, tokens accepted,
    the masks after each token when ``keep_masks``)."""
    t0 = time.perf_counter()
    m = engine.compile(case)
    compile_s = time.perf_counter() - t0
    steps, masks = [], [engine.bits()] if keep_masks else None
    accepted = 0
    for t in ids:
        if not engine.allows(t) or not engine.accept(m, t):
            break
        accepted += 1
        t0 = time.perf_counter()
        engine.mask(m)
        steps.append(time.perf_counter() - t0)
        if keep_masks:
            masks.append(engine.bits())
    return compile_s, steps, accepted, masks


def differing_tokens(a: bytes, b: bytes) -> list[int]:
    out = []
    for w, (x, y) in enumerate(zip(memoryview(a).cast("I"), memoryview(b).cast("I"))):
        d = x ^ y
        while d:
            low = d & -d
            tok = w * 32 + low.bit_length() - 1
            if tok < VOCAB_SIZE:
                out.append(tok)
            d ^= low
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks/out/xgrammar_masks.json"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=["all"], choices=["all", *KINDS])
    ap.add_argument("--engines", nargs="+", default=["xgrammar", "llguidance"], choices=["xgrammar", "llguidance"])
    ap.add_argument("--json-layout", default="fixed", choices=list(JSON_LAYOUTS), help="whitespace of the JSON cases")
    ap.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads (llguidance compiles on one)")
    ap.add_argument("--xgrammar-literal-specials", action="store_true",
                    help="keep xgrammar's own mapping of special tokens (their literal text)")  # fmt: skip
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER_FILE)
    ap.add_argument("--dump-tokenizer", type=Path, metavar="PATH", help="(project venv) write the tokenizer dump and exit")
    args = ap.parse_args()
    if args.dump_tokenizer:
        dump_tokenizer(args.dump_tokenizer)
        return 0
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")

    cases = select("all" if "all" in args.kinds else args.kinds)
    tok = load_tokenizer(args.tokenizer, cases)
    if tok["vocab_size"] != VOCAB_SIZE:
        raise SystemExit(f"the tokenizer has {tok['vocab_size']} tokens, this script is for {VOCAB_SIZE}")
    engines = []
    for name in args.engines:
        if name == "xgrammar":
            engines.append(XGrammar(tok, args.threads, args.xgrammar_literal_specials, args.json_layout))
        else:
            engines.append(LLGuidance(tok, args.json_layout))
    ids = {c.name: tok["cases"][c.name]["ids"] for c in cases}

    compiles = {(c.name, e.name): [] for c in cases for e in engines}
    steps = {(c.name, e.name): [] for c in cases for e in engines}
    accepted = {(c.name, e.name): [] for c in cases for e in engines}
    masks = {}
    for r in range(args.repeat):
        order = engines if r % 2 == 0 else engines[::-1]
        for c in cases:
            for e in order:
                cs, st, acc, mk = run_once(e, c, ids[c.name], keep_masks=r == 0)
                compiles[c.name, e.name].append(cs)
                steps[c.name, e.name].extend(st)
                accepted[c.name, e.name].append(acc)
                if mk is not None:
                    masks[c.name, e.name] = mk

    rows, problems = [], []
    for c in cases:
        diff = None
        if len(engines) == 2:
            a, b = (masks[c.name, e.name] for e in engines)
            diff_steps = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            diff = {"steps": len(diff_steps), "compared": min(len(a), len(b))}
            only = {e.name: 0 for e in engines}  # tokens one engine allows and the other does not, over the steps
            for i in diff_steps:
                zero = bytes(len(a[i]))
                ab = differing_tokens(bytes(p & ~q & 0xFF for p, q in zip(a[i], b[i])), zero)
                ba = differing_tokens(bytes(q & ~p & 0xFF for p, q in zip(a[i], b[i])), zero)
                only[engines[0].name] += len(ab)
                only[engines[1].name] += len(ba)
            diff["allowed_by_one_only"] = only
            if diff_steps:
                i = diff_steps[0]
                toks = differing_tokens(a[i], b[i])
                diff.update(first_step=i, first_tokens=toks[:8], first_count=len(toks))
        for e in engines:
            n_acc = min(accepted[c.name, e.name])
            if c.kind != "regex" and n_acc < len(ids[c.name]):
                problems.append(f"{e.name} rejected {c.name!r} at token {n_acc} of {len(ids[c.name])}")
            st = steps[c.name, e.name] or [0.0]
            rows.append({"case": c.name, "kind": c.kind, "engine": e.name,
                         "pattern": c.grammar if c.kind == "regex" else json.dumps(llguidance_schema(c, args.json_layout)),
                         "tokens": len(ids[c.name]), "steps": n_acc,
                         "compile_ms": statistics.median(compiles[c.name, e.name]) * 1e3,
                         "step_ms_median": statistics.median(st) * 1e3, "step_ms_max": max(st) * 1e3,
                         "mask_diff": diff})  # fmt: skip

    versions = {p: importlib.metadata.version(p) for p in ("xgrammar", "llguidance", "apache-tvm-ffi", "torch")}
    for e in engines:
        print(f"{e.name}: tokenizer set up in {e.setup_s * 1e3:.0f} ms")
    print(f"versions: {versions}; xgrammar compile threads {args.threads}; JSON layout {args.json_layout}; "
          f"median of {args.repeat}, interleaved")
    print(f"{'case':<30}{'engine':<12}{'tokens':>7}{'compile ms':>12}{'step ms (median)':>18}{'step ms (max)':>15}  masks differ (tokens allowed by this engine only)")
    for r in rows:
        d = r["mask_diff"]
        dd = "" if d is None else f"{d['steps']}/{d['compared']} steps, {r['engine']} only: {d['allowed_by_one_only'][r['engine']]}"
        print(f"{r['case']:<30}{r['engine']:<12}{r['tokens']:>7}{r['compile_ms']:>12.2f}{r['step_ms_median']:>18.3f}{r['step_ms_max']:>15.3f}  {dd}")  # fmt: skip
    for p in problems:
        print("PROBLEM:", p)
    meta = {"date": date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "repeat": args.repeat, "json_layout": args.json_layout, "versions": versions, "engines": {e.name: e.describe for e in engines},
            "tokenizer_setup_ms": {e.name: e.setup_s * 1e3 for e in engines}}  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
