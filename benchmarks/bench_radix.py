"""Radix tree benchmark: hit rate and per-operation latency on seeded synthetic traces.

Replays each workload (multi-turn chat, few-shot, branching, and multi-turn + few-shot
mixed) at 40% of the trace's unique pages, page sizes 1 and 16, one request at a
time, the way the engine drives the tree:

    match -> lock -> evict (only when the pool is short) -> alloc -> insert -> unlock

and times each tree call (lock and unlock together). SGLang's own radix tree (``sglang.srt.mem_cache.radix_cache``)
replays the same trace in the same run when it is installed
(``bash benchmarks/peers/setup_sglang.sh``); Belady's offline policy and unlimited
capacity give the hit-rate references.

A second section times the whole per-request KV lifecycle on the mixed trace, page
sizes 1 and 16: radixkv's ``KVCacheManager`` (admit -> reserve, evicting -> computed ->
release) against SGLang's Rust radix tree core driven the way SGLang's scheduler drives
it (match -> lock -> evict -> alloc -> insert, duplicates freed -> unlock; see
``benchmarks/peers/sglang_rust_tree.py``), one wall time per request; target: radixkv
at most 0.5x the Rust core's time (mean and p50). radixkv runs with its compiled page
loops and, for reference, with their numpy twin (what a machine without a C compiler
gets).

    .venv/bin/python benchmarks/bench_radix.py [--json benchmarks/out/bench_radix.json] [--lifecycle-only]
    (--lifecycle-only: that section alone, into benchmarks/out/bench_radix_lifecycle.json)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peers import sglang_rust_tree, sglang_tree  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from radixkv.cache import KVCacheManager, PageAllocator, RadixCache, SeqKV  # noqa: E402
from radixkv.cache import sim, traces  # noqa: E402
from radixkv.kernels import pages as page_loops  # noqa: E402

OPS = ("match", "insert", "evict", "lock")


def replay_timed(prompts, capacity_pages: int, page_size: int, policy: str = "lru") -> dict:
    """One request at a time; each tree call timed on its own (perf_counter_ns).
    ``lock`` is a request's lock plus its unlock."""
    allocator = PageAllocator(capacity_pages)
    tree = RadixCache(allocator, page_size, policy)
    times = {op: [] for op in OPS}
    clock = time.perf_counter_ns
    rejected = 0
    gc.disable()
    try:
        for tokens in prompts:
            t0 = clock()
            match = tree.match_prefix(tokens)
            t1 = clock()
            tree.lock(match.node)
            t2 = clock()
            times["match"].append(t1 - t0)
            times["lock"].append(t2 - t1)
            need = -(-len(tokens) // page_size) - len(match.pages)
            short = need - allocator.num_free()
            if short > 0:
                t0 = clock()
                tree.evict(short)
                times["evict"].append(clock() - t0)
                if allocator.num_free() < need:
                    tree.unlock(match.node)
                    rejected += 1
                    continue
            allocator.incref(match.pages)
            table = np.concatenate([match.pages, allocator.alloc(need)])
            t0 = clock()
            tree.insert(tokens, table)
            times["insert"].append(clock() - t0)
            t0 = clock()
            tree.unlock(match.node)
            times["lock"][-1] += clock() - t0
            allocator.decref(table)
    finally:
        gc.enable()
    tree.check_integrity(external_refs={})
    return {
        "hit_rate": tree.hit_tokens / tree.queried_tokens,
        "evicted_pages": tree.evicted_pages,
        "rejected": rejected,
        "timings_us": {op: [t / 1000 for t in v] for op, v in times.items()},
    }


def replay_lifecycle(prompts, capacity_pages: int, page_size: int, loops=None) -> dict:
    """One request at a time through radixkv's ``KVCacheManager``, the whole per-request
    KV lifecycle a serving engine runs for a prefill, timed as one span per request
    (perf_counter_ns, gc off): a fresh ``SeqKV``; ``admit`` (match ``tokens[:-1]``,
    lock the match); ``reserve`` the uncached tokens (evicting when the pool is short);
    ``computed(seq, len)``; ``release`` (the tree adopts the whole new pages, copies of
    pages it had go free, unlock, the partial last page goes free). A request ``reserve`` refuses is released at once, counted in
    ``rejected``, its time kept.

    Returns ``hit_rate`` (hit / prompt tokens), ``queried_tokens``, ``hit_tokens``
    (what ``admit`` took from the cache, summed), ``evicted_pages``, ``rejected`` and
    ``request_ns`` (one wall time per request), the shape of
    ``sglang_rust_tree.replay``. Checks the pool and tree invariants at the end.
    ``loops``: the page loops (``radixkv.kernels.pages``; default the compiled ones).
    """
    pool = PageAllocator(capacity_pages, loops)
    tree = RadixCache(pool, page_size)
    kv = KVCacheManager(pool, tree, page_size)
    request_ns = []
    queried_tokens = hit_tokens = rejected = 0
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for tokens in prompts:
            num_tokens = len(tokens)
            t0 = clock()
            seq = SeqKV()
            hit = kv.admit(seq, tokens)
            reserved = kv.reserve(seq, num_tokens - seq.computed)
            if reserved:
                kv.computed(seq, num_tokens)
            kv.release(seq, tokens)
            request_ns.append(clock() - t0)
            queried_tokens += num_tokens
            hit_tokens += hit
            rejected += not reserved
    finally:
        gc.enable()
    kv.check([])
    return sglang_tree.replay_result(queried_tokens, hit_tokens, tree.evicted_pages, rejected, request_ns=request_ns)


LIFECYCLE_TARGET = 0.5  # radixkv's time per request / the Rust core's, at most


def lifecycle_rows(fraction: float, repeat: int, rust_missing: str | None) -> list[dict]:
    """The whole per-request lifecycle on the mixed trace at page sizes 1 and 16, at
    ``fraction`` of its unique pages: per system the replay with the lowest mean of
    ``repeat``; its hit rate, mean and p50 us per request. With the Rust core
    available, also radixkv / Rust (mean and p50) against ``LIFECYCLE_TARGET``."""
    trace = traces.synthetic("mixed")
    prompts = [r.tokens for r in trace]
    as_lists = [p.tolist() for p in prompts]
    rows = []
    for page_size in (1, 16):
        capacity = max(1, int(fraction * sim.replay(trace, None, page_size).cached_pages))
        systems = {"radixkv": lambda: replay_lifecycle(prompts, capacity, page_size)}
        if page_loops.native() is not page_loops.NumpyPages:  # what the compiled loops buy
            systems["radixkv_numpy"] = lambda: replay_lifecycle(prompts, capacity, page_size, page_loops.NumpyPages)
        if rust_missing is None:
            systems["sglang_rust"] = lambda: sglang_rust_tree.replay(as_lists, capacity, page_size)
        row = {"workload": "mixed", "page_size": page_size, "capacity_pages": capacity, "requests": len(prompts)}
        for system, run in systems.items():
            best = min((run() for _ in range(repeat)), key=lambda r: np.mean(r["request_ns"]))
            us = np.asarray(best["request_ns"], dtype=float) / 1000
            row[system] = {
                "hit_rate": best["hit_rate"], "hit_tokens": best["hit_tokens"],
                "evicted_pages": best["evicted_pages"], "rejected": best["rejected"],
                "mean_us": float(us.mean()), "p50_us": float(np.median(us)),
            }  # fmt: skip
        if rust_missing is None:
            for stat in ("mean", "p50"):
                row[f"ratio_{stat}"] = row["radixkv"][f"{stat}_us"] / row["sglang_rust"][f"{stat}_us"]
            row["target_ratio"] = LIFECYCLE_TARGET
        rows.append(row)
    return rows


def print_lifecycle(rows: list[dict], rust_missing: str | None) -> None:
    """The "whole per-request lifecycle" table."""
    print("\nwhole per-request lifecycle (mixed trace, one request at a time; us per request)")
    head = f"{'P':>3} {'system':<14}{'hit %':>7}{'rejected':>9}{'mean us':>9}{'p50 us':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        for system in ("radixkv", "radixkv_numpy", "sglang_rust"):
            if system in r:
                s = r[system]
                print(f"{r['page_size']:>3} {system:<14}{100 * s['hit_rate']:>7.2f}{s['rejected']:>9}"
                      f"{s['mean_us']:>9.2f}{s['p50_us']:>8.2f}")  # fmt: skip
        if "ratio_mean" in r:
            verdict = "met" if max(r["ratio_mean"], r["ratio_p50"]) <= r["target_ratio"] else "NOT met"
            print(f"{'':>4}radixkv/rust: mean {r['ratio_mean']:.2f}x, p50 {r['ratio_p50']:.2f}x "
                  f"(target <= {r['target_ratio']}x: {verdict})")  # fmt: skip
    print("lifecycle: admit/match + lock + evict when short + alloc + insert (duplicates freed) + unlock + free")
    print("radixkv: page loops compiled (radixkv.kernels.pages); radixkv_numpy: their numpy twin (no C compiler)")
    if rust_missing:
        print(f"\nsglang_rust: not measured ({rust_missing})")


def summarize(timings_us: dict, requests: int) -> dict:
    """Per op: calls, mean per request (total time / requests: evict runs only when the
    pool is short), mean and p99 per call."""
    out = {}
    for op in OPS:
        v = np.asarray(timings_us.get(op, []), dtype=float)
        out[op] = {
            "calls": int(v.size),
            "per_request_us": float(v.sum() / requests),
            "mean_us": float(v.mean()) if v.size else 0.0,
            "p99_us": float(np.percentile(v, 99)) if v.size else 0.0,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None,
                    help="default benchmarks/out/bench_radix.json (bench_radix_lifecycle.json with --lifecycle-only)")
    ap.add_argument("--fraction", type=float, default=0.4, help="capacity as a fraction of unique pages")
    ap.add_argument("--repeat", type=int, default=3, help="timed replays per system; the best mean counts")
    ap.add_argument("--lifecycle-only", action="store_true", help="only the whole per-request lifecycle section")
    ap.add_argument("--policies", default="lru,cost",
                    help="radixkv eviction policies to time (comma-separated; lru is the row named radixkv)")
    ap.add_argument("--workloads", default="multi_turn,few_shot,branching,mixed")
    args = ap.parse_args()
    if args.json is None:
        args.json = f"benchmarks/out/bench_radix{'_lifecycle' if args.lifecycle_only else ''}.json"

    peer_missing = sglang_tree.available()
    rust_missing = sglang_rust_tree.available()
    rows = []
    policies = args.policies.split(",")
    for workload in args.workloads.split(",") if not args.lifecycle_only else ():
        trace = traces.synthetic(workload)
        prompts = [r.tokens for r in trace]
        for page_size in (1, 16):
            unlimited = sim.replay(trace, None, page_size)
            capacity = max(1, int(args.fraction * unlimited.cached_pages))
            belady = sim.replay(trace, capacity, page_size, "belady")
            systems = {("radixkv" if p == "lru" else f"rkv-{p}"): (lambda p=p: replay_timed(prompts, capacity, page_size, p))
                       for p in policies}  # fmt: skip
            if peer_missing is None:
                as_lists = [p.tolist() for p in prompts]
                systems["sglang"] = lambda: sglang_tree.replay(as_lists, capacity, page_size)
            for system, run in systems.items():
                best = None
                for _ in range(args.repeat):
                    result = run()
                    stats = summarize(result["timings_us"], len(prompts))
                    if best is None or sum(s["per_request_us"] for s in stats.values()) < sum(
                        s["per_request_us"] for s in best[1].values()
                    ):
                        best = (result, stats)
                result, stats = best
                rows.append({
                    "workload": workload, "page_size": page_size, "system": system,
                    "capacity_pages": capacity, "unique_pages": unlimited.cached_pages,
                    "hit_rate": result["hit_rate"], "belady_hit_rate": belady.hit_rate,
                    "unlimited_hit_rate": unlimited.hit_rate, "rejected": result["rejected"],
                    "ops": stats,
                })  # fmt: skip

    lifecycle = lifecycle_rows(args.fraction, args.repeat, rust_missing)
    if args.lifecycle_only:
        print_lifecycle(lifecycle, rust_missing)
        write_result(args.json, rows, capacity_fraction=args.fraction, lifecycle=lifecycle,
                     sglang_rust=rust_missing or "measured")  # fmt: skip
        return

    head = f"{'workload':<11}{'P':>3} {'system':<9}{'hit %':>7}{'/belady':>8}{'belady':>8}{'unlim':>7}"
    head += "".join(f"{op + ' us/req | p99':>22}" for op in OPS)
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r['workload']:<11}{r['page_size']:>3} {r['system']:<9}{100 * r['hit_rate']:>7.2f}"
        line += f"{100 * r['hit_rate'] / r['belady_hit_rate']:>7.1f}%"
        line += f"{100 * r['belady_hit_rate']:>8.2f}{100 * r['unlimited_hit_rate']:>7.2f}"
        for op in OPS:
            s = r["ops"][op]
            line += f"{s['per_request_us']:>13.1f} |{s['p99_us']:>6.1f}"
        print(line)
    print("\nus/req: total time in the call / requests (evict runs only when the pool is short); p99 per call")
    if peer_missing:
        print(f"\nsglang: not measured ({peer_missing})")
    print_lifecycle(lifecycle, rust_missing)

    write_result(args.json, rows, capacity_fraction=args.fraction, sglang=peer_missing or "measured",
                 lifecycle=lifecycle, sglang_rust=rust_missing or "measured")  # fmt: skip

if __name__ == "__main__":
    main()
