"""Routers over radixkv replicas: hit rate, throughput and TTFT of the same programs
through each router, at the same offered load.

Three `radixkv serve` replicas on loopback (each a pool of ``--kv-tokens`` tokens,
publishing KV events) are started once; then, one system at a time, with every
replica's cache flushed before each workload:

    round-robin      radixkv router --policy round_robin
    approx           radixkv router --mode approx (SGLang's approximate text tree and thresholds)
    events           radixkv router (routes on the replicas' KV events)
    sglang           SGLang's router from PyPI (sglang-router, cache_aware) in front of the same
                     replicas (benchmarks/peers/sglang_router.py; installed into .peers/ when missing)
    one-cache        one `radixkv serve` whose pool holds the three replicas' capacities together:
                     the hit-rate reference

Each replica runs its kernels on the machine's cores shared out (``--threads`` as
``radixkv serve --replicas`` gives them: cores / replicas, at least one; ``--replica-threads``
to set it), one-cache on all of them.

With ``--store-bytes N`` the replicas also share one LMDB store of N bytes, written
through (a page one replica computed is found by the others: cross-replica reuse), and
one-cache gets a store of its own of the same size (the sum of the capacities is then
the three pools and one store). Every tier is flushed before each workload.

Workloads (radixkv.workloads.programs, greedy with ignore_eos: every system computes the
same tokens): ``multi_turn``, ``rag``, ``agent``, and ``mixed`` (the three run at once).
The offered load is fixed: the same programs through the same number of client threads
(each workload's own), closed loop. Reported: wall seconds, output tok/s, requests/s,
TTFT p50/p99, prompt-cache hit rate (cached / prompt tokens, as the replicas report per
request), and each router's hit rate as a percent of one-cache's (same seed). With several
``--seeds`` every seed runs all systems in turn and a summary gives medians over seeds:
routing under memory pressure is chaotic (a few early choices decide what each replica
keeps), so one seed's hit rate moves by a few points from run to run.

    .venv/bin/python benchmarks/bench_router.py [--scale small] [--workloads multi_turn,mixed]
        [--systems round-robin,approx,events,sglang,one-cache] [--kv-tokens 4096] [--store-bytes 0]
        [--seeds 0,1,2] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import shutil
import sys
import threading
import time
from datetime import date
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from radixkv import workloads as W  # noqa: E402
from radixkv.server.process import ServerProcess, free_port, launch, stop  # noqa: E402
from radixkv.server.serve import cpu_count, replica_threads  # noqa: E402

SYSTEMS = ("round-robin", "approx", "events", "sglang", "one-cache")
MIXED = ("multi_turn", "rag", "agent")


def endpoint(url: str, replica: str | None = None):
    """The frontend's RuntimeEndpoint on ``url``. With ``replica``: generations go to ``url``
    (a router that forwards only the generation routes, as SGLang's does) and everything
    else (/model_info, /tokenize, /render_chat) to ``replica``."""
    from radixkv.frontend import RuntimeEndpoint

    if replica is None:
        return RuntimeEndpoint(url, hints=False, max_parallel=64)

    class Split(RuntimeEndpoint):
        def __init__(self):
            self._gen = httpx.Client(base_url=url, timeout=600)
            super().__init__(replica, hints=False, max_parallel=64)

        def _call(self, method, path, body=None):
            if path != "/generate":
                return super()._call(method, path, body)
            from radixkv.frontend.backends import _checked

            return _checked(self._gen.request(method, path, json=body))

    return Split()


def run_workloads(workloads: list, url: str, replica: str | None = None) -> dict:
    """Run ``workloads`` at once through the runtime at ``url``; the figures of all their calls."""
    backend = endpoint(url, replica)
    states: list = []
    errors: list = []

    def one(w):
        try:
            states.extend(W.run(w, backend))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(w,)) for w in workloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    backend.close()
    if errors:
        raise errors[0]
    calls = [c for s in states for c in s.all_calls()]
    ttfts = [c.ttft for c in calls if c.ttft is not None]
    prompt = sum(c.prompt_tokens for c in calls)
    cached = sum(c.cached_tokens for c in calls)
    out = sum(c.completion_tokens for c in calls if c.kind == "gen")
    return {"wall_s": wall, "requests": len(calls), "output_tokens": out, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / max(prompt, 1), "tok_s": out / wall,
            "req_s": len(calls) / wall, "ttft_p50": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p99": float(np.percentile(ttfts, 99)) if ttfts else None}  # fmt: skip


def flush(urls: list[str], tiers: str = "memory") -> None:
    for u in urls:
        for _ in range(600):
            if httpx.post(u + "/flush_cache", params={"tiers": tiers}, timeout=60).status_code == 200:
                break
            time.sleep(0.1)


def store_args(path: Path, nbytes: int) -> list[str]:
    """A replica's flags for an LMDB store at ``path`` of ``nbytes``, written through ([] when 0)."""
    if not nbytes:
        return []
    return ["--kv-store", f"lmdb:{path}", "--kv-store-bytes", str(nbytes), "--kv-store-write", "through"]


def start_system(name: str, replicas: list[str], kv_tokens: int, logs: Path, router_args: list[str],
                 store: list[str] = ()):  # fmt: skip
    """(close function, base URL) of one system, or None when it cannot run here."""
    py = sys.executable
    if name in ("round-robin", "approx", "events"):
        extra = {"round-robin": ["--policy", "round_robin"], "approx": ["--mode", "approx"], "events": []}[name]
        extra += router_args
        proc, url = launch([py, "-m", "radixkv", "router", "--replica", *replicas, *extra], "/health",
                           f"radixkv router ({name})", 120, logs / f"router-{name}.log")  # fmt: skip
        if name == "events":  # wait until it has subscribed to every replica
            for _ in range(100):
                if httpx.get(url + "/router/state").json()["mode"] == "events":
                    break
                time.sleep(0.1)
        return (lambda: stop(proc)), url
    if name == "sglang":
        from benchmarks.peers import sglang_router

        if not sglang_router.available():
            print("[sglang] installing sglang-router into .peers/ ...", flush=True)
            try:
                sglang_router.install()
            except Exception as e:  # noqa: BLE001
                print(f"[sglang] skipped: cannot install sglang-router: {e}")
                return None
        proc, url = sglang_router.start(replicas, "cache_aware")
        return (lambda: sglang_router.stop(proc)), url
    if name == "one-cache":
        server = ServerProcess("--kv-cache-tokens", str(kv_tokens * len(replicas)), *store,
                               log_path=logs / "one-cache.log")  # fmt: skip
        return server.stop, server.url
    raise ValueError(f"systems: unknown system {name!r} (one of {', '.join(SYSTEMS)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="small", choices=("tiny", "small", "full"))
    ap.add_argument("--workloads", default="multi_turn,mixed")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=4096,
                    help="each replica's pool (one-cache: replicas x this); at 2048 one-cache's own pool thrashes on "
                         "mixed (RESULTS.md, routers, 2026-11-29)")  # fmt: skip
    ap.add_argument("--store-bytes", type=int, default=0,
                    help="an LMDB store of this many bytes shared by the replicas (one-cache: its own); 0: none")
    ap.add_argument("--seeds", default="0",
                    help="workload seeds (comma-separated); each seed runs every system in turn, and the summary "
                         "gives medians over seeds")
    ap.add_argument("--router-args", default="", help="more flags for radixkv router ('--load-weight 0.1')")
    ap.add_argument("--replica-threads", type=int, default=None,
                    help="each replica's kernel threads (default: the cores / replicas, at least 1, as radixkv serve "
                         "--replicas gives them)")  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args(argv)
    if args.replica_threads is not None and args.replica_threads < 1:
        ap.error(f"--replica-threads must be >= 1, got {args.replica_threads}")
    threads = args.replica_threads or replica_threads(args.replicas)
    scale = {"tiny": W.TINY, "small": W.SMALL, "full": W.FULL}[args.scale]
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"--systems: unknown system {s!r} (one of {', '.join(SYSTEMS)})")
    out = Path(args.out)
    logs = out / "bench_router_logs"
    logs.mkdir(parents=True, exist_ok=True)

    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")

    def workloads(name: str, seed: int) -> list:
        names = MIXED if name == "mixed" else (name,)
        return [W.make(n, seed, scale) for n in names]

    replicas = []
    rows = []
    tiers = "all" if args.store_bytes else "memory"
    stores = out / "bench_router_stores"
    if args.store_bytes:
        shutil.rmtree(stores, ignore_errors=True)
        stores.mkdir(parents=True)

    def queried(urls: list[str]) -> list[int]:
        return [httpx.get(u + "/stats").json()["cache"]["queried_tokens"] for u in urls]

    try:
        for i in range(args.replicas):
            ev, rp = free_port(), free_port()
            replicas.append(ServerProcess("--kv-cache-tokens", str(args.kv_tokens), "--threads", str(threads),
                                          "--kv-events", f"tcp://127.0.0.1:{ev}",
                                          "--kv-events-replay", f"tcp://127.0.0.1:{rp}",
                                          *store_args(stores / "shared", args.store_bytes),
                                          log_path=logs / f"replica-{i}.log"))  # fmt: skip
        urls = [r.url for r in replicas]
        for seed, system in itertools.product(seeds, systems):
            started = start_system(system, urls, args.kv_tokens, logs, args.router_args.split(),
                                   store_args(stores / "one-cache", args.store_bytes))  # fmt: skip
            if started is None:
                continue
            close, url = started
            try:
                for wname in args.workloads.split(","):
                    flush([url] if system == "one-cache" else urls, tiers)
                    before = queried(urls)
                    print(f"[{system}] {wname} seed {seed} ...", flush=True)
                    row = {"system": system, "workload": wname, "seed": seed,
                           **run_workloads(workloads(wname, seed), url, urls[0] if system == "sglang" else None)}  # fmt: skip
                    if system != "one-cache":
                        row["per_replica_prompt_tokens"] = [a - b for a, b in zip(queried(urls), before)]
                    rows.append(row)
                    print(f"    {row['wall_s']:.1f} s, hit {100 * row['hit_rate']:.1f}%", flush=True)
            finally:
                close()
    finally:
        for r in replicas:
            r.stop()

    # each row against the same seed's one-cache (hit rate) and round robin (throughput)
    ref = {(r["workload"], r["seed"]): r["hit_rate"] for r in rows if r["system"] == "one-cache"}
    rr = {(r["workload"], r["seed"]): r["tok_s"] for r in rows if r["system"] == "round-robin"}
    for r in rows:
        key = (r["workload"], r["seed"])
        r["of_one_cache"] = 100 * r["hit_rate"] / ref[key] if ref.get(key) else None
        r["x_round_robin"] = r["tok_s"] / rr[key] if rr.get(key) else None
    store = f", a shared {args.store_bytes / 1e6:.0f} MB LMDB store" if args.store_bytes else ""
    print(f"\nrouters over {args.replicas} radixkv replicas ({args.kv_tokens} KV tokens and {threads} threads each, "
          f"one-cache at the default{store}; {cpu_count()} cores), scale {args.scale}, "
          f"seeds {args.seeds}, {date.today()}, {platform.machine()} {platform.processor() or ''}\n")  # fmt: skip
    print("| workload | system | seed | wall s | output tok/s | x round robin | req/s | TTFT p50 s | TTFT p99 s | hit rate | % of one cache |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        x_rr = "-" if r["x_round_robin"] is None else f"{r['x_round_robin']:.2f}x"
        of_ref = "-" if r["of_one_cache"] is None else f"{r['of_one_cache']:.1f}"
        print(f"| {r['workload']} | {r['system']} | {r['seed']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {x_rr} | "
              f"{r['req_s']:.2f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {100 * r['hit_rate']:.1f}% | {of_ref} |")  # fmt: skip
    summary = []
    if len(seeds) > 1:
        print(f"\nmedians over seeds {args.seeds}:\n")
        print("| workload | system | hit rate | % of one cache (min-max) | x round robin |")
        print("|---|---|---|---|---|")
        for wname in args.workloads.split(","):
            for system in systems:
                got = [r for r in rows if r["workload"] == wname and r["system"] == system]
                if not got:
                    continue
                med = {k: float(np.median([r[k] for r in got])) if all(r[k] is not None for r in got) else None
                       for k in ("hit_rate", "of_one_cache", "x_round_robin")}  # fmt: skip
                summary.append({"workload": wname, "system": system, "seeds": len(got), **med})
                of = [r["of_one_cache"] for r in got]
                of_s = "-" if med["of_one_cache"] is None else f"{med['of_one_cache']:.1f} ({min(of):.1f}-{max(of):.1f})"
                x_rr = "-" if med["x_round_robin"] is None else f"{med['x_round_robin']:.2f}x"
                print(f"| {wname} | {system} | {100 * med['hit_rate']:.1f}% | {of_s} | {x_rr} |")
    path = out / "bench_router.json"
    path.write_text(json.dumps({"date": str(date.today()), "scale": args.scale, "replicas": args.replicas,
                                "kv_tokens": args.kv_tokens, "replica_threads": threads, "store_bytes": args.store_bytes,
                                "seeds": seeds, "rows": rows, "medians": summary}, indent=1))  # fmt: skip
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
