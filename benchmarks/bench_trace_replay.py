"""Trace capture: does `radixkv sim` replaying a recorded trace predict the live hit rate,
and what does recording cost?

1. Replay accuracy. For each workload (``rag``, ``agent``: the frontend programs of
   radixkv.workloads.programs), start `radixkv serve --record-trace FILE` with a pool of
   ``--pool-tokens`` tokens, run the workload through the frontend (RuntimeEndpoint,
   ``run_batch`` with the workload's client threads: concurrent requests, as a program
   sends them), stop the server, then replay FILE with radixkv.cache.sim at the same pool
   pages, page size, policy and prefill chunk. Reported: live hit rate (sum of cached /
   sum of prompt tokens, as the server reported them), replayed hit rate, difference in
   points (target: within 0.5), and requests whose cached tokens differ.

2. Recording overhead. One in-process Engine; rounds alternate recording off and on
   (the order flips every round, the cache is flushed before each run), the same
   workload each time; requests/s per run. Reported: median throughput each way and the
   median of the per-round ratios (target: recording costs <= 1%).

    .venv/bin/python benchmarks/bench_trace_replay.py [--scale small|tiny] [--workloads rag,agent]
        [--pool-tokens 8192] [--rounds 4] [--overhead-workload rag] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from radixkv import workloads as W
from radixkv.cache import sim, traces
from radixkv.cache.capture import TraceWriter
from radixkv.workloads.bench import write_result

PAGE = 16


def live_and_replay(name: str, scale: W.Scale, pool_tokens: int, policy: str, trace_dir: Path) -> dict:
    from radixkv.frontend import RuntimeEndpoint
    from radixkv.server.process import ServerProcess

    workload = W.make(name, 0, scale)
    path = trace_dir / f"{name}.jsonl"
    flags = ("--kv-cache-tokens", str(pool_tokens), "--page-size", str(PAGE), "--policy", policy,
             "--record-trace", str(path))  # fmt: skip
    with ServerProcess(*flags) as server:
        endpoint = RuntimeEndpoint(server.url)
        t0 = time.perf_counter()
        states = W.run(workload, endpoint)
        wall = time.perf_counter() - t0
        endpoint.close()
    calls = [c for s in states for c in s.all_calls()]
    live_prompt, live_cached = sum(c.prompt_tokens for c in calls), sum(c.cached_tokens for c in calls)
    trace = sorted(traces.load_jsonl(path), key=lambda r: r.arrival)  # lines are in finish order
    recorded = [r.cached_tokens for r in trace]
    prompts = sum(len(r.tokens) for r in trace)
    # sequential: one request after another in arrival order (the sim API, arrivals=False);
    # timed: what `radixkv sim FILE` does by default (arrival order, modelled time in flight, 64 slots)
    modes = {"sequential": sim.replay(trace, pool_tokens // PAGE, PAGE, policy, arrivals=False),
             "timed": sim.replay(trace, pool_tokens // PAGE, PAGE, policy, in_flight=64)}  # fmt: skip
    result = modes["sequential"]
    differ = sum(a != b for a, b in zip(recorded, result.cached_per_request))
    # both over whole prompts (the simulator's own hit_rate divides by the tokens it looks up: prompt[:-1])
    live_rate, replay_rate = live_cached / live_prompt, sum(result.cached_per_request) / prompts
    timed_rate = sum(modes["timed"].cached_per_request) / prompts
    row = {"workload": name, "requests": len(calls), "trace_lines": len(trace), "threads": workload.threads,
           "pool_tokens": pool_tokens, "policy": policy, "prompt_tokens": live_prompt, "live_cached": live_cached,
           "replay_cached": sum(result.cached_per_request), "live_hit_rate": live_rate, "replay_hit_rate": replay_rate,
           "difference_points": 100 * (replay_rate - live_rate), "requests_differing": differ,
           "evicted_pages_replay": result.evicted_pages, "wall_s": wall, "timed_replay_hit_rate": timed_rate,
           "timed_difference_points": 100 * (timed_rate - live_rate),
           "timed_requests_differing": sum(a != b for a, b in zip(recorded, modes["timed"].cached_per_request))}
    print(f"{name:<8} {len(calls):>5} req  live {100 * live_rate:6.2f}%  replay {100 * replay_rate:6.2f}%  "
          f"diff {row['difference_points']:+.2f} pt  ({differ} requests differ, {result.evicted_pages} pages "
          f"evicted in the replay); timed replay {100 * timed_rate:6.2f}% "
          f"diff {row['timed_difference_points']:+.2f} pt ({row['timed_requests_differing']} differ)",
          flush=True)  # fmt: skip
    return row


def record_cost(trace_path: Path, repeat: int = 5) -> dict:
    """CPU seconds recording spends per request, measured directly on a recorded trace's
    requests: the caller's ``record`` (a queue put) plus the writer thread's encoding and
    write. On a 2-core machine under the GIL this time is at worst taken from the engine,
    so cost / (wall seconds per request) bounds the throughput cost."""
    lines = traces.load_jsonl(trace_path)
    items = [(list(r.tokens), list(r.output_tokens), "salt", 0.0, 0, "s", r.cached_tokens or 0, None, None)
             for r in lines]  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        writer = TraceWriter(Path(d) / "t.jsonl")
        writer.close()  # the thread stops: time its work here, in this thread
        writer._file = open(Path(d) / "t2.jsonl", "w", buffering=1 << 16)
        best_put, best_write = float("inf"), float("inf")
        for _ in range(repeat):
            q = writer._queue
            t0 = time.perf_counter()
            for it in items:
                q.put(it)
            best_put = min(best_put, (time.perf_counter() - t0) / len(items))
            while not q.empty():
                q.get_nowait()
            t0 = time.perf_counter()
            for it in items:
                writer._write(writer._line(it))
            writer._file.flush()
            best_write = min(best_write, (time.perf_counter() - t0) / len(items))
        writer._file.close()
    mean_tokens = sum(len(r.tokens) for r in lines) / len(lines)
    return {"requests": len(lines), "mean_prompt_tokens": mean_tokens, "record_call_s": best_put,
            "writer_s": best_write, "per_request_s": best_put + best_write}


def overhead(name: str, scale: W.Scale, pool_tokens: int, rounds: int, trace_dir: Path) -> dict:
    from radixkv.frontend import EngineBackend

    backend = EngineBackend(kv_cache_tokens=pool_tokens, page_size=PAGE)
    engine = backend.engine
    workload = W.make(name, 0, scale)
    W.run(workload, backend)  # warm-up
    runs = {"off": [], "on": []}
    ratios, writer_cpu = [], []  # writer_cpu: the writer thread's CPU seconds per wall second of the run
    for k in range(rounds):
        got = {}
        for mode in (("off", "on") if k % 2 == 0 else ("on", "off")):
            while not engine.flush_cache():
                time.sleep(0.05)
            writer = TraceWriter(trace_dir / f"overhead_{k}.jsonl") if mode == "on" else None
            engine.trace_writer = writer
            t0 = time.perf_counter()
            states = W.run(workload, backend)
            wall = time.perf_counter() - t0
            engine.trace_writer = None
            if writer is not None:
                writer.close()
                writer_cpu.append(writer.cpu_seconds / wall)
            requests = sum(len(s.all_calls()) for s in states)
            got[mode] = requests / wall
            runs[mode].append(got[mode])
        ratios.append(got["on"] / got["off"])
        print(f"round {k}: off {got['off']:.2f} req/s, on {got['on']:.2f} req/s, on/off {ratios[-1]:.4f}; writer "
              f"thread CPU {100 * writer_cpu[-1]:.4f}% of the run's wall time", flush=True)  # fmt: skip
    backend.close()
    row = {"workload": name, "rounds": rounds, "req_s_off": runs["off"], "req_s_on": runs["on"],
           "median_off": statistics.median(runs["off"]), "median_on": statistics.median(runs["on"]),
           "median_ratio": statistics.median(ratios), "ratios": ratios, "writer_cpu_per_wall": writer_cpu}  # fmt: skip
    print(f"recording overhead ({name}): median on/off {row['median_ratio']:.4f} "
          f"({100 * (1 - row['median_ratio']):+.2f}% throughput, noise included); the writer thread used "
          f"{100 * max(writer_cpu):.4f}% of the wall time at most (the bound on what recording can take)")  # fmt: skip
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=W.SCALES, default="small")
    ap.add_argument("--workloads", default="rag,agent")
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--rounds", type=int, default=4, help="overhead rounds (0: skip)")
    ap.add_argument("--overhead-workload", default="rag")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scale = W.SCALES[args.scale]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_dir = Path(tempfile.mkdtemp(prefix="trace_replay_"))
    rows = [live_and_replay(n, scale, args.pool_tokens, args.policy, trace_dir)
            for n in args.workloads.split(",") if n]  # fmt: skip
    cost = overhead(args.overhead_workload, scale, args.pool_tokens, args.rounds, trace_dir) if args.rounds else None
    direct = {}
    for r in rows:
        c = record_cost(trace_dir / f"{r['workload']}.jsonl")
        c["fraction_of_request_time"] = c["per_request_s"] / (r["wall_s"] / r["requests"])
        direct[r["workload"]] = c
        print(f"recording cost ({r['workload']}): {1e6 * c['record_call_s']:.1f} us caller + "
              f"{1e6 * c['writer_s']:.1f} us writer per request ({c['mean_prompt_tokens']:.0f} prompt tokens); "
              f"{100 * c['fraction_of_request_time']:.3f}% of the live run's wall time per request", flush=True)
    write_result(out / "bench_trace_replay.json", rows, scale=args.scale, page_size=PAGE, overhead=cost,
                 recording_cost=direct,
                 target_points=0.5, target_overhead=0.01)  # fmt: skip
    if rows:
        worst = max(abs(r["timed_difference_points"]) for r in rows)
        print(f"worst difference of `radixkv sim`'s default (timed) replay: {worst:.2f} points (target 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
