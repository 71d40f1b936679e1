"""Eviction policies against LRU and Belady: how much of the gap between them each closes.

Two kinds of traces, replayed by ``radixkv.cache.sim`` (the engine's ``KVCacheManager``
calls, no model) once per policy and capacity, with LRU and Belady's offline policy
(evict the page whose next use is farthest away) as the peers of every row:

1. Mooncake's conversation trace (``../shared/traces/mooncake_conversation.jsonl``, the
   FAST'25 release: 12,031 requests of a production chat service), page size 512 = one
   Mooncake block a page (each hash id a run of 512 synthetic token ids, prompts cut to
   ``input_length``, no output tokens: a conversation's next turn carries its own block
   ids for what it reuses of an answer), in timestamp order one request at a time
   (arrivals off), each prompt prefilled whole (on the first 3,000 requests, prefill
   chunks of 512 tokens gave LRU and Belady the same hit rates in 13-15x the time: a
   reserve, commit and victim search per chunk). Capacities: 5% and 10% of the trace's
   unique block ids. Target: the new policy closes >= 50% of the LRU-to-Belady
   gap.
2. radixkv's chat workloads with a chat service's arrival times (``multi_turn_timed``,
   ``mixed_timed``: Poisson conversation starts, lognormal think times of median 30 s,
   Poisson few-shot questions; radixkv.cache.traces), page size 16, replayed in arrival
   order with up to 64 requests in flight (the engine's max_running) and the modelled
   time in flight of ``radixkv sim``; capacities 10%, 20% and 40% of the trace's unique
   pages. Target: >= 85% of Belady's hit rate.

Per row: hit rate (cached / prompt tokens), % of Belady's, share of the LRU-to-Belady gap
closed ((hit - lru) / (belady - lru)), pages evicted and the replay's wall seconds. A
second offline row, ``return-oracle`` (``sim.ReturnOracle``: LRU told only whether a leaf
is ever used again), shows how much of the gap is that question alone: the most an online
policy that predicts reuse, and nothing about when, could close.

    .venv/bin/python benchmarks/bench_eviction.py [--policies lru,lfu,cost] [--quick]
        [--trace PATH] [--json benchmarks/out/bench_eviction.json]

``--policies``: the registered policies to replay (default all of
``radixkv.cache.policy.POLICIES``); LRU, the return oracle and Belady always run. ``--quick``: the first 2,000
Mooncake requests and one capacity (20%) of the timed traces, for a smoke run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from radixkv.cache import sim, traces  # noqa: E402
from radixkv.cache.policy import POLICIES  # noqa: E402

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
BLOCK = traces.MOONCAKE_BLOCK_TOKENS
MOONCAKE_FRACTIONS = (0.05, 0.10)
TIMED = ("multi_turn_timed", "mixed_timed")
TIMED_PAGE, TIMED_FRACTIONS = 16, (0.1, 0.2, 0.4)
IN_FLIGHT = 64  # EngineConfig.max_running: what `radixkv sim` keeps in flight on a timed trace
QUICK_REQUESTS = 2000
GAP_TARGET, OF_BELADY_TARGET = 0.5, 0.85


def unique_blocks(trace: list[traces.TraceRequest]) -> int:
    """Distinct Mooncake block ids in a loaded trace (block h is tokens h*BLOCK onwards)."""
    starts = np.concatenate([np.frombuffer(r.tokens, dtype=np.int32)[::BLOCK] for r in trace])
    return int(np.unique(starts // BLOCK).size)


def replay_all(trace, caps, page_size, policies, **kw) -> list[dict]:
    """Every policy, LRU and Belady at every capacity; the gap fields added per capacity."""
    rows = []
    for name in dict.fromkeys(("lru", *policies, "return-oracle", "belady")):
        for cap in caps:
            t0 = time.perf_counter()
            r = sim.replay(trace, cap, page_size, name, **kw)
            rows.append({"policy": name, "capacity_pages": cap, "hit_rate": r.hit_rate, "hit_tokens": r.hit_tokens,
                         "queried_tokens": r.queried_tokens, "evicted_pages": r.evicted_pages,
                         "rejected": r.rejected, "seconds": time.perf_counter() - t0})  # fmt: skip
            print(f"  {name:>8} {cap:>7} pages: {100 * r.hit_rate:6.2f}%  ({rows[-1]['seconds']:.1f} s)", flush=True)
    sim.add_gap(rows)
    return rows


def table(rows: list[dict], caps: list[int], label) -> str:
    """Rows: policies; columns: per capacity hit %, % of Belady, gap closed %."""
    head = ["policy"] + [f"{label(c)} {col}" for c in caps for col in ("hit %", "of belady %", "gap closed %")]
    out = [head]
    for name in dict.fromkeys(r["policy"] for r in rows):
        by_cap = {r["capacity_pages"]: r for r in rows if r["policy"] == name}
        cells = []
        for c in caps:
            r = by_cap[c]
            cells += [f"{100 * r['hit_rate']:.2f}", sim._percent(r["of_belady"]), sim._percent(r["gap_closed"])]
        out.append([name] + cells)
    return sim._render(out, left=1)


def verdicts(rows: list[dict], field: str, target: float, what: str) -> list[str]:
    """One line per policy other than LRU and Belady: does it reach ``target`` in
    ``field`` at every capacity?"""
    lines = []
    for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] not in ("lru", *sim.OFFLINE)):
        values = [r[field] for r in rows if r["policy"] == name]
        ok = all(v is not None and v >= target for v in values)
        shown = ", ".join("-" if v is None else f"{100 * v:.1f}%" for v in values)
        lines.append(f"  {name}: {what} {shown} -> {'meets' if ok else 'misses'} the >= {100 * target:.0f}% target")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated registered policies (default all: {','.join(POLICIES)}); LRU and Belady "
                         f"always run")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run: a Mooncake prefix, one timed capacity")
    ap.add_argument("--trace", default=str(MOONCAKE), help="the Mooncake conversation trace (default %(default)s)")
    ap.add_argument("--json", default="benchmarks/out/bench_eviction.json")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; registered: {', '.join(POLICIES)}")
    t_start = time.perf_counter()
    sections = {}

    if Path(args.trace).exists():
        limit = QUICK_REQUESTS if args.quick else None
        trace = traces.load_mooncake(args.trace, outputs=False, limit=limit)
        blocks = unique_blocks(trace)
        caps = [max(1, round(f * blocks)) for f in MOONCAKE_FRACTIONS]
        print(f"== Mooncake conversation trace: {len(trace):,} requests, {blocks:,} unique blocks, page size {BLOCK}, "
              f"one at a time in timestamp order", flush=True)  # fmt: skip
        rows = replay_all(trace, caps, BLOCK, policies, in_flight=1, chunk_size=None, arrivals=False)
        unlimited = sim.replay(trace, None, BLOCK, "lru", 1, None, arrivals=False).hit_rate
        fraction = {c: f for c, f in zip(caps, MOONCAKE_FRACTIONS)}
        print(table(rows, caps, lambda c: f"{fraction[c]:.0%}"))
        print(f"  unlimited capacity: {100 * unlimited:.2f}%")
        print("\n".join(verdicts(rows, "gap_closed", GAP_TARGET, "gap closed")) + "\n")
        sections["mooncake"] = {"requests": len(trace), "unique_blocks": blocks, "page_size": BLOCK,
                                "fractions": list(MOONCAKE_FRACTIONS), "unlimited_hit_rate": unlimited,
                                "rows": rows}  # fmt: skip
    else:
        print(f"(no Mooncake trace at {args.trace}: that section is skipped)\n")

    fractions = (0.2,) if args.quick else TIMED_FRACTIONS
    for name in TIMED:
        trace = traces.synthetic(name)
        unlimited = sim.replay(trace, None, TIMED_PAGE, "lru", IN_FLIGHT)
        unique = unlimited.cached_pages
        caps = [max(1, round(f * unique)) for f in fractions]
        print(f"== {name}: {len(trace):,} requests over {trace[-1].arrival:,.0f} s, {unique:,} unique pages of "
              f"{TIMED_PAGE} tokens, arrival order, up to {IN_FLIGHT} in flight", flush=True)  # fmt: skip
        rows = replay_all(trace, caps, TIMED_PAGE, policies, in_flight=IN_FLIGHT)
        fraction = {c: f for c, f in zip(caps, fractions)}
        print(table(rows, caps, lambda c: f"{fraction[c]:.0%}"))
        print(f"  unlimited capacity: {100 * unlimited.hit_rate:.2f}%")
        print("\n".join(verdicts(rows, "of_belady", OF_BELADY_TARGET, "of Belady")) + "\n")
        sections[name] = {"requests": len(trace), "unique_pages": unique, "page_size": TIMED_PAGE,
                          "in_flight": IN_FLIGHT, "fractions": list(fractions),
                          "unlimited_hit_rate": unlimited.hit_rate, "rows": rows}  # fmt: skip

    rows = [{"trace": name, **r} for name, s in sections.items() for r in s["rows"]]
    meta = {name: {k: v for k, v in s.items() if k != "rows"} for name, s in sections.items()}
    write_result(args.json, rows, policies=policies, quick=args.quick, sections=meta,
                 seconds=round(time.perf_counter() - t_start, 1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
