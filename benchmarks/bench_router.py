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

Workloads (radixkv.workloads.programs, greedy with ignore_eos: every system computes the
same tokens): ``multi_turn``, ``rag``, ``agent``, and ``mixed`` (the three run at once).
The offered load is fixed: the same programs through the same number of client threads
(each workload's own), closed loop. Reported: wall seconds, output tok/s, requests/s,
TTFT p50/p99, prompt-cache hit rate (cached / prompt tokens, as the replicas report per
request), and each router's hit rate as a percent of one-cache's.

    .venv/bin/python benchmarks/bench_router.py [--scale small] [--workloads multi_turn,mixed]
        [--systems round-robin,approx,events,sglang,one-cache] [--kv-tokens 2048] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import platform
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


def flush(urls: list[str]) -> None:
    for u in urls:
        for _ in range(600):
            if httpx.post(u + "/flush_cache", params={"tiers": "memory"}, timeout=60).status_code == 200:
                break
            time.sleep(0.1)


def start_system(name: str, replicas: list[str], kv_tokens: int, logs: Path, router_args: list[str]):
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
        server = ServerProcess("--kv-cache-tokens", str(kv_tokens * len(replicas)), log_path=logs / "one-cache.log")
        return server.stop, server.url
    raise ValueError(f"systems: unknown system {name!r} (one of {', '.join(SYSTEMS)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="small", choices=("tiny", "small", "full"))
    ap.add_argument("--workloads", default="multi_turn,mixed")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=2048, help="each replica's pool (one-cache: replicas x this)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-args", default="", help="more flags for radixkv router ('--load-weight 0.1')")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args(argv)
    scale = {"tiny": W.TINY, "small": W.SMALL, "full": W.FULL}[args.scale]
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"--systems: unknown system {s!r} (one of {', '.join(SYSTEMS)})")
    out = Path(args.out)
    logs = out / "bench_router_logs"
    logs.mkdir(parents=True, exist_ok=True)

    def workloads(name: str) -> list:
        names = MIXED if name == "mixed" else (name,)
        return [W.make(n, args.seed, scale) for n in names]

    replicas = []
    rows = []
    try:
        for i in range(args.replicas):
            ev, rp = free_port(), free_port()
            replicas.append(ServerProcess("--kv-cache-tokens", str(args.kv_tokens), "--kv-events", f"tcp://127.0.0.1:{ev}",
                                          "--kv-events-replay", f"tcp://127.0.0.1:{rp}",
                                          log_path=logs / f"replica-{i}.log"))  # fmt: skip
        urls = [r.url for r in replicas]
        for system in systems:
            started = start_system(system, urls, args.kv_tokens, logs, args.router_args.split())
            if started is None:
                continue
            close, url = started
            try:
                for wname in args.workloads.split(","):
                    flush(urls)
                    print(f"[{system}] {wname} ...", flush=True)
                    row = {"system": system, "workload": wname, **run_workloads(workloads(wname), url, urls[0] if system == "sglang" else None)}
                    if system != "one-cache":
                        row["per_replica_prompt_tokens"] = [
                            httpx.get(u + "/stats").json()["cache"]["queried_tokens"] for u in urls
                        ]  # fmt: skip
                    rows.append(row)
                    print(f"    {row['wall_s']:.1f} s, hit {100 * row['hit_rate']:.1f}%", flush=True)
            finally:
                close()
    finally:
        for r in replicas:
            r.stop()

    ref = {r["workload"]: r["hit_rate"] for r in rows if r["system"] == "one-cache"}
    rr = {r["workload"]: r["tok_s"] for r in rows if r["system"] == "round-robin"}
    print(f"\nrouters over {args.replicas} radixkv replicas ({args.kv_tokens} KV tokens each), scale {args.scale}, "
          f"{date.today()}, {platform.machine()} {platform.processor() or ''}\n")  # fmt: skip
    print("| workload | system | wall s | output tok/s | x round robin | req/s | TTFT p50 s | TTFT p99 s | hit rate | % of one cache |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        of_ref = f"{100 * r['hit_rate'] / ref[r['workload']]:.1f}" if ref.get(r["workload"]) else "-"
        x_rr = f"{r['tok_s'] / rr[r['workload']]:.2f}x" if rr.get(r["workload"]) else "-"
        r["of_one_cache"] = None if of_ref == "-" else float(of_ref)
        print(f"| {r['workload']} | {r['system']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {x_rr} | {r['req_s']:.2f} | "
              f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {100 * r['hit_rate']:.1f}% | {of_ref} |")  # fmt: skip
    path = out / "bench_router.json"
    path.write_text(json.dumps({"date": str(date.today()), "scale": args.scale, "replicas": args.replicas,
                                "kv_tokens": args.kv_tokens, "rows": rows}, indent=1))  # fmt: skip
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
