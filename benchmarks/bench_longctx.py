"""Long-context KV eviction: what each policy keeps of a long context, what sharing a
compressed context buys, and a chat that runs in bounded memory.

Part ``ppl`` (quality): perplexity of a 256-token continuation read after the first C
tokens of long natural text (``longctx_data.licence_text()``: GPL-3, GFDL-1.3, then the
other Debian licence texts; no BOS, as bench_kvquant.py) were compressed once after
their prefill (``kv_compress_at=C``) to a kept fraction of 50 / 25 / 12.5%, for every
policy, page-level (pages of 16) and token-level (pages of 1: every token its own page,
all layers and heads together), against the full cache. All 256 continuation tokens
are scored (token 0 is predicted from the context's last logits, computed before the
compression, so it is the same for every policy); ``ppl`` = exp(mean NLL). The peer in
the same run: kvpress (``benchmarks/peers/kvpress_ppl.py`` in ``.peers/kvpress-venv``,
the same GGUF through transformers) with the same policies and fractions, token-level
per layer and KV head as kvpress does it (its table: ``--peer``).

Part ``passkey``: a 5-digit key hidden at 10 / 50 / 90% depth of a haystack of about
L tokens (``longctx_data.passkey_prompt``), greedy, the full cache first, then each
policy keeping 25% of the haystack (compressed at the haystack's end, the question
after it).

Part ``askmany``: compress once, ask many. A 4k-token document (GPL-3's first 4096
tokens), 16 questions after it, snapkv at 25% (``--askmany-policy``): TTFT of each
question (the first computes the document and compresses it; the others read its
view), the view's pages against the document's, and every answer against a standalone
run (an engine without a prefix cache: the same compression, nothing shared).

Part ``rerotate`` (not in the default parts): perplexity of 12k tokens of licence text
read in buckets of 1024, ``streaming`` at a 2048-token budget with ``kv_rerotate``
(positions within the cache, so it reads past the trained context of 8192), against
the full cache and ``streaming`` at original positions on the first 8191 tokens.

Part ``chat``: a 30-turn chat (each turn: a licence paragraph to summarize, 40 output
tokens, ignore_eos; each prompt extends the last by its answer, token for token) under
``streaming`` at a 2048-token budget on a pool smaller than the conversation: per turn
the prompt, the tokens served from the cache, the pages in use, the views.

The cost of the scores' bookkeeping in a decode step is ``benchmarks/bench_mass.py``'s.

    .venv/bin/python benchmarks/bench_longctx.py [--parts ppl passkey askmany chat]
        [--contexts 1536 4096 8192] [--kept 0.5 0.25 0.125] [--peer] [--json benchmarks/out/bench_longctx.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from longctx_data import licence_text, passkey_correct, passkey_keys, passkey_parts  # noqa: E402

from radixkv import Engine, SamplingParams  # noqa: E402

POLICIES = ["window", "streaming", "snapkv", "h2o", "keydiff"]
MAX_POSITIONS = 8192
QUESTIONS = [
    "What is the name of this licence?", "Who publishes this licence?", "What does copyleft mean here?",
    "May I sell copies of the program?", "What is the source code of a work?", "What must I give to recipients?",
    "Can I change the licence text?", "What is a covered work?", "What does propagate mean?",
    "Is there a warranty?", "What happens if I violate the licence?", "What is a User Product?",
    "What are Installation Information?", "How do I apply these terms to a new program?",
    "What is an aggregate?", "Which version of the licence applies?",
]  # fmt: skip


def text_ids(engine: Engine) -> list[int]:
    return engine.encode(licence_text(), add_special_tokens=False)


# -- part ppl ---------------------------------------------------------------------------------


def continuation_nll(engine: Engine, ids: list[int], context: int, n: int, policy: str | None, kept: float) -> dict:
    """NLL of ``ids[context:context + n]`` after ``ids[:context]``, compressed by ``policy``."""
    prompt = ids[: context + n]
    kw = {} if policy is None else dict(kv_policy=policy, kv_budget=kept, kv_compress_at=context)
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs_from=context, **kw)
    t0 = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    wall = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(out.error)
    lps = out.prompt_logprobs[context:]  # one per prompt position; those before context are not computed
    assert len(lps) == n and None not in lps, (len(lps), n)
    nll = -sum(lps) / n
    rest = -sum(lps[1:]) / (n - 1)
    return {"nll": nll, "ppl": math.exp(nll), "nll_rest": rest, "ppl_rest": math.exp(rest), "wall_s": wall}


def part_ppl(args) -> list[dict]:
    rows = []
    engines = {ps: Engine(kv_cache_tokens=MAX_POSITIONS + 512, page_size=ps, chunked_prefill_size=1024)
               for ps in (16, 1)}  # fmt: skip
    try:
        ids = text_ids(engines[16])
        for requested in args.contexts:
            context = min(requested, MAX_POSITIONS - args.continuation - 1) // 16 * 16  # the prompt < the context
            if len(ids) < context + args.continuation:
                raise SystemExit(f"the licence texts hold {len(ids)} tokens, fewer than {context + args.continuation}")
            for ps, engine in engines.items():
                engine.flush_cache()
                level = "page" if ps > 1 else "token"
                full = continuation_nll(engine, ids, context, args.continuation, None, 1.0)
                rows.append({"context": context, "level": level, "policy": "none", "kept": 1.0, **full})
                print(f"{context:5d} {level:5s} none      1.000 ppl {full['ppl']:.4f}", flush=True)
                for kept in args.kept:
                    for policy in args.policies:
                        r = continuation_nll(engine, ids, context, args.continuation, policy, kept)
                        r["delta_ppl"] = r["ppl"] - full["ppl"]
                        rows.append({"context": context, "level": level, "policy": policy, "kept": kept, **r})
                        print(f"{context:5d} {level:5s} {policy:9s} {kept:.3f} ppl {r['ppl']:.4f} "
                              f"({r['delta_ppl']:+.4f}) {r['wall_s']:.1f}s", flush=True)  # fmt: skip
                engine.check_integrity()
    finally:
        for e in engines.values():
            e.close()
    return rows


def run_peer(args) -> list[dict]:
    python = ROOT / ".peers/kvpress-venv/bin/python"
    if not python.exists():
        print("kvpress peer missing: bash benchmarks/peers/setup_kvpress.sh", flush=True)
        return []
    out = ROOT / "benchmarks/out/kvpress_ppl.json"
    presses = ["none"] + args.policies
    cmd = [str(python), str(ROOT / "benchmarks/peers/kvpress_ppl.py"), "--contexts", *map(str, args.contexts),
           "--continuation", str(args.continuation), "--kept", *map(str, args.kept), "--presses", *presses,
           "--out", str(out), "--threads", str(args.threads)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["rows"]


def ppl_table(rows: list[dict], peer: list[dict]) -> str:
    """Per context and kept fraction: each policy's ppl change, page-level, token-level
    and kvpress's, and the targets' margins."""
    lines = ["| context | kept | policy | page-level Δppl | token-level Δppl | kvpress Δppl |", "|---|---|---|---|---|---|"]
    by = {(r["context"], r["level"], r["policy"], r["kept"]): r for r in rows}
    peer_by = {}
    for r in peer:
        if r.get("ppl") is not None:
            peer_by[(r["context"], r["press"], r.get("kept_fraction") or 1.0)] = r
    for context in sorted({r["context"] for r in rows}):
        peer_full = peer_by.get((context, "none", 1.0))
        for kept in sorted({r["kept"] for r in rows if r["policy"] != "none"}, reverse=True):
            for policy in POLICIES:
                page, token = by.get((context, "page", policy, kept)), by.get((context, "token", policy, kept))
                if page is None:
                    continue
                p = peer_by.get((context, policy, kept))
                peer_delta = f"{p['ppl'] - peer_full['ppl']:+.3f}" if p and peer_full else "-"
                token_delta = "-" if token is None else f"{token['delta_ppl']:+.3f}"
                lines.append(f"| {context} | {kept:g} | {policy} | {page['delta_ppl']:+.3f} | {token_delta} | {peer_delta} |")
    return "\n".join(lines)


def ppl_targets(rows: list[dict], peer: list[dict]) -> list[dict]:
    """Best page-level policy vs best token-level (ours) and vs kvpress's same policy,
    per context at 50% and 25% kept (margins 1 and 3.5 points of ppl change)."""
    out = []
    peer_by = {(r["context"], r["press"], r.get("kept_fraction") or 1.0): r for r in peer if r.get("ppl") is not None}
    for context in sorted({r["context"] for r in rows}):
        for kept, margin in ((0.5, 1.0), (0.25, 3.5)):
            page = [r for r in rows if r["context"] == context and r["level"] == "page" and r["kept"] == kept]
            token = [r for r in rows if r["context"] == context and r["level"] == "token" and r["kept"] == kept]
            if not page or not token:
                continue
            best_page = min(page, key=lambda r: r["delta_ppl"])
            best_token = min(token, key=lambda r: r["delta_ppl"])
            row = {"context": context, "kept": kept, "margin": margin, "best_page": best_page["policy"],
                   "best_page_delta": best_page["delta_ppl"], "best_token": best_token["policy"],
                   "best_token_delta": best_token["delta_ppl"],
                   "vs_token_ok": best_page["delta_ppl"] - best_token["delta_ppl"] <= margin}  # fmt: skip
            full = peer_by.get((context, "none", 1.0))
            same = peer_by.get((context, best_page["policy"], kept))
            if full and same:
                row["kvpress_same_delta"] = same["ppl"] - full["ppl"]
                row["vs_kvpress_ok"] = best_page["delta_ppl"] - row["kvpress_same_delta"] <= margin
            out.append(row)
    return out


# -- part passkey -----------------------------------------------------------------------------


def part_passkey(args) -> list[dict]:
    rows = []
    with Engine(kv_cache_tokens=MAX_POSITIONS + 512, page_size=16) as engine:
        count = lambda s: len(engine.encode(s, add_special_tokens=False))  # noqa: E731
        keys = passkey_keys(args.passkey_keys, seed=1)
        for length in args.passkey_lengths:
            for depth in (0.1, 0.5, 0.9):
                for key in keys:
                    parts = passkey_parts(length, depth, key, count)
                    context = engine.encode(parts["haystack"] + "\n", add_special_tokens=False)
                    prompt = context + engine.encode(parts["question"] + " " + parts["answer_prefix"],
                                                     add_special_tokens=False)  # fmt: skip
                    for policy in ["none"] + args.policies:
                        kw = {} if policy == "none" else dict(kv_policy=policy, kv_budget=args.passkey_kept,
                                                              kv_compress_at=len(context))  # fmt: skip
                        out = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0, **kw))[0]
                        ok = passkey_correct(out.text, key)
                        rows.append({"length": length, "tokens": len(prompt), "depth": depth, "key": key,
                                     "policy": policy, "correct": ok, "text": out.text})  # fmt: skip
                print(f"passkey {length} depth {depth}: " + " ".join(
                    f"{p}={sum(r['correct'] for r in rows if r['length'] == length and r['depth'] == depth and r['policy'] == p)}/{len(keys)}"
                    for p in ["none"] + args.policies), flush=True)  # fmt: skip
                engine.flush_cache()
        engine.check_integrity()
    return rows


# -- part askmany -----------------------------------------------------------------------------


def part_askmany(args) -> dict:
    kw = dict(kv_policy=args.askmany_policy, kv_budget=0.25)
    with Engine(kv_cache_tokens=MAX_POSITIONS, page_size=16) as engine:
        doc = engine.encode(open("/usr/share/common-licenses/GPL-3").read(), add_special_tokens=False)[:4096]
        prompts = [doc + engine.encode(f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False) for q in QUESTIONS]
        params = SamplingParams(max_new_tokens=16, temperature=0, kv_compress_at=len(doc), **kw)
        answers, ttft, cached = [], [], []
        for p in prompts:
            out = engine.generate([p], params)[0]
            answers.append(out.token_ids)
            ttft.append(out.metrics.ttft)
            cached.append(out.cached_tokens)
        stats = engine.stats()
        engine.check_integrity()
        views = list(engine.loop.kv.views)
        view_pages = [len(v.pages) for v in views if v.point == len(doc)]
    with Engine(kv_cache_tokens=MAX_POSITIONS, page_size=16, enable_prefix_cache=False) as alone:
        same = [alone.generate([p], params)[0].token_ids == a for p, a in zip(prompts, answers)]
    rest = ttft[1:]
    return {
        "policy": args.askmany_policy, "doc_tokens": len(doc), "doc_pages": len(doc) // 16,
        "view_pages": view_pages, "ttft_s": ttft, "cached_tokens": cached,
        "ttft_first_s": ttft[0], "ttft_rest_mean_s": statistics.mean(rest), "ttft_rest_max_s": max(rest),
        "rest_share_of_first_max": max(rest) / ttft[0], "identical_to_standalone": same,
        "views": stats["views"], "pool": stats["pool"],
    }  # fmt: skip


# -- part chat --------------------------------------------------------------------------------


def part_chat(args) -> dict:
    sp = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, kv_policy="streaming",
                        kv_budget=args.chat_budget)  # fmt: skip
    paras = [p for p in licence_text().split("\n\n") if len(p) > 200]
    turns = []
    with Engine(kv_cache_tokens=args.chat_pool, page_size=16) as engine:
        ids = engine.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
        end = engine.encode("<|im_end|>\n", add_special_tokens=False)
        for turn in range(args.chat_turns):
            msg = f"<|im_start|>user\nSummarize this paragraph:\n{paras[turn][:500]}<|im_end|>\n<|im_start|>assistant\n"
            ids = ids + engine.encode(msg, add_special_tokens=False)
            out = engine.generate([ids], sp)[0]
            stats = engine.stats()
            engine.check_integrity()
            last = max(engine.loop.kv.views, key=lambda v: v.point, default=None)
            turns.append({"turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": out.cached_tokens,
                          "cached_share": out.cached_tokens / len(ids), "ttft_s": out.metrics.ttft,
                          "pool_used_pages": stats["pool"]["pages"] - stats["pool"]["free"],
                          "state_pages": None if last is None else
                          len(last.pages) + -(-(len(ids) + len(out.token_ids) - last.point) // 16),
                          "views": stats["views"]["views"], "view_pages": stats["views"]["pages"]})  # fmt: skip
            t = turns[-1]
            print(f"turn {turn + 1:2d}: prompt {t['prompt_tokens']} cached {t['cached_share']:.3f} "
                  f"state pages {t['state_pages']} pool used {t['pool_used_pages']}/{stats['pool']['pages']} "
                  f"views {t['views']}", flush=True)  # fmt: skip
            ids = ids + list(out.token_ids) + end
        pages = stats["pool"]["pages"]
    long = [t for t in turns if t["prompt_tokens"] > args.chat_budget]
    return {"budget": args.chat_budget, "pool_pages": pages, "turns": turns,
            "min_cached_share_past_budget": min((t["cached_share"] for t in long), default=None),
            "max_state_pages": max((t["state_pages"] or 0) for t in turns)}  # fmt: skip


# -- part rerotate -----------------------------------------------------------------------------


def part_rerotate(args) -> dict:
    """Perplexity of long text read token by token in buckets of 1024: the full cache and
    ``streaming`` at the budget with original positions up to the trained context, and
    ``streaming`` with ``kv_rerotate`` (positions within the cache) past it."""
    budget, total, bucket = args.rerotate_budget, args.rerotate_tokens, 1024
    runs = {}
    with Engine(kv_cache_tokens=MAX_POSITIONS + 512, page_size=16) as engine:
        ids = text_ids(engine)[:total]
        inside = ids[: MAX_POSITIONS - 1]
        stream = dict(kv_policy="streaming", kv_budget=budget)
        for name, prompt, kw in (("full", inside, {}), ("streaming", inside, stream),
                                 ("streaming_rerotate", ids, {**stream, "kv_rerotate": True})):  # fmt: skip
            engine.flush_cache()
            t0 = time.perf_counter()
            out = engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs_from=1,
                                                           **kw))[0]  # fmt: skip
            if out.error:
                raise RuntimeError(out.error)
            lps = out.prompt_logprobs[1:]
            runs[name] = {"tokens": len(prompt), "wall_s": time.perf_counter() - t0,
                          "bucket_ppl": [math.exp(-statistics.mean(lps[i : i + bucket]))
                                         for i in range(0, len(lps) - bucket + 1, bucket)]}  # fmt: skip
            print(f"rerotate {name}: {len(prompt)} tokens, buckets " +
                  " ".join(f"{x:.2f}" for x in runs[name]["bucket_ppl"]), flush=True)  # fmt: skip
        engine.check_integrity()
    return {"budget": budget, "bucket": bucket, "max_positions": MAX_POSITIONS, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["ppl", "passkey", "askmany", "chat"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1536, 4096, 8192])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--kept", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    ap.add_argument("--peer", action="store_true", help="run kvpress in .peers/kvpress-venv (ppl part)")
    ap.add_argument("--threads", type=int, default=2, help="the peer's torch threads")
    ap.add_argument("--peer-json", type=Path, default=None, help="kvpress rows from an earlier kvpress_ppl.py run")
    ap.add_argument("--passkey-lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--passkey-keys", type=int, default=3)
    ap.add_argument("--passkey-kept", type=float, default=0.25)
    ap.add_argument("--askmany-policy", default="snapkv", choices=POLICIES)
    ap.add_argument("--rerotate-budget", type=int, default=2048)
    ap.add_argument("--rerotate-tokens", type=int, default=12288)
    ap.add_argument("--chat-turns", type=int, default=30)
    ap.add_argument("--chat-budget", type=int, default=2048)
    ap.add_argument("--chat-pool", type=int, default=3072)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/bench_longctx.json")
    args = ap.parse_args()
    result: dict = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}  # fmt: skip
    if args.json.exists():  # parts run separately add up
        result = {**json.loads(args.json.read_text()), **{k: v for k, v in result.items() if k != "args"}}

    def save():
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))

    if "ppl" in args.parts:
        result["ppl"] = part_ppl(args)
        save()
        if args.peer:
            result["kvpress"] = run_peer(args)
        elif args.peer_json is not None:
            result["kvpress"] = json.loads(args.peer_json.read_text())["rows"]
        peer = result.get("kvpress", [])
        print(ppl_table(result["ppl"], peer))
        result["ppl_targets"] = ppl_targets(result["ppl"], peer)
        for t in result["ppl_targets"]:
            print(t)
        save()
    if "passkey" in args.parts:
        result["passkey"] = part_passkey(args)
        save()
    if "askmany" in args.parts:
        result["askmany"] = a = part_askmany(args)
        print(f"askmany ({a['policy']}): first {a['ttft_first_s']:.2f}s, rest mean {a['ttft_rest_mean_s']:.3f}s "
              f"max {a['ttft_rest_max_s']:.3f}s ({a['rest_share_of_first_max']:.1%} of the first); view pages "
              f"{a['view_pages']} of {a['doc_pages']}; identical to standalone: {sum(a['identical_to_standalone'])}"
              f"/{len(QUESTIONS)}")  # fmt: skip
        save()
    if "rerotate" in args.parts:
        result["rerotate"] = part_rerotate(args)
        save()
    if "chat" in args.parts:
        result["chat"] = c = part_chat(args)
        print(f"chat: min cached share past the budget {c['min_cached_share_past_budget']:.3f}, "
              f"max state pages {c['max_state_pages']} (pool {c['pool_pages']})")  # fmt: skip
        save()


if __name__ == "__main__":
    main()
