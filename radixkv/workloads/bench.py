"""End-to-end: the SGLang-paper workloads (``radixkv.workloads.programs``) on radixkv
and on what a user would otherwise run on this machine, with the same model and prompts.
``radixkv bench`` runs it from the installed package with the radixkv systems;
``benchmarks/bench_e2e.py`` in a source checkout adds the peers.

Systems, one at a time on the machine, each running every workload through the
frontend (``run_batch`` with the workload's client threads, so requests arrive
concurrently the way a program sends them):

    radixkv            `radixkv serve` (a separate process, default attention backend: on
                       a CPU the C decode kernel), RuntimeEndpoint client
    radixkv no-cache   the same with --no-enable-prefix-cache
    radixkv bf16-kv    the same with --kv-dtype bf16 (half fp32's KV bytes; a 16-bit
                       cache, as llama.cpp's default f16 one)
    radixkv act8       the same with --activation-bits 8 (inputs of the native products
                       rounded to 8 bits, as llama.cpp rounds them: faster prefill)
    transformers       HF transformers in this process, request by request (benchmarks/peers;
                       source checkout)
    llama.cpp          llama-cpp-python's OpenAI server on the same GGUF, if installed
                       (bash benchmarks/peers/setup_llamacpp.sh); skipped with a notice if not
    llama-server       llama.cpp's own server on the same GGUF: 8 parallel slots, continuous
                       batching, prompt caching and --cache-reuse (benchmarks/peers/
                       llamaserver_backend.py; bash benchmarks/peers/setup_llamacpp_bin.sh)

Every generation is greedy with ``ignore_eos`` and a fixed ``max_tokens``, so each system
produces the same number of output tokens. The server's prefix cache is flushed before
each workload. Reported per workload and system: wall seconds, output tok/s (generated
tokens of ``gen`` calls over the wall time), requests/s (every call, including the
one-token requests a fork sends for its shared prefix), TTFT p50/p90 (submission to first
token, as each backend measures it), prompt-cache hit rate (cached / prompt tokens, where
the system reports it), and whether the program texts equal transformers'. Also: a PNG
bar chart of output tok/s, and a hit-rate-vs-cache-size plot from `radixkv sim` replays of
each workload's trace.

    radixkv bench [--scale full|small|tiny] [--workloads rag,agent] [--systems radixkv,radixkv-no-cache,radixkv-act8]
    .venv/bin/python benchmarks/bench_e2e.py [...] [--systems radixkv,radixkv-no-cache,transformers,llama.cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from typing import Callable

import numpy as np

from radixkv import workloads as W

GOALS = {"transformers": 5.0, "llama.cpp": 2.0, "llama-server": 1.5, "vllm": 1.5,
         "vllm-bf16": 1.5}  # radixkv throughput multiple on shared-prefix workloads
KV_CACHE_TOKENS = 65536


@dataclass
class Result:
    workload: str
    system: str
    wall_s: float
    requests: int
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    ttft_p50: float | None
    ttft_p90: float | None
    texts: list[str]
    round: int = 0  # with --rounds: which round of the systems this run was in

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def req_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def hit_rate(self) -> float | None:
        return None if self.cached_tokens is None else self.cached_tokens / max(self.prompt_tokens, 1)


def measure(workload: W.Workload, system: str, backend, reports_cache: bool) -> Result:
    t0 = time.perf_counter()
    states = W.run(workload, backend)
    wall = time.perf_counter() - t0
    calls = [c for s in states for c in s.all_calls()]
    ttfts = [c.ttft for c in calls if c.ttft is not None]
    return Result(
        workload.name, system, wall, len(calls), sum(c.completion_tokens for c in calls if c.kind == "gen"),
        sum(c.prompt_tokens for c in calls), sum(c.cached_tokens for c in calls) if reports_cache else None,
        float(np.percentile(ttfts, 50)) if ttfts else None, float(np.percentile(ttfts, 90)) if ttfts else None,
        [_program_text(s) for s in states],
    )  # fmt: skip


def _program_text(state) -> str:
    """A state's text with its forks' texts, so branching compares every branch."""
    return state.text() + "".join("\n--fork--\n" + _program_text(c) for c in state.children)


# -- systems ------------------------------------------------------------------------------------


class Served:
    """`radixkv serve` in a child process, and a RuntimeEndpoint on it."""

    def __init__(self, *flags: str, pool: tuple[str, ...] = ("--kv-cache-tokens", str(KV_CACHE_TOKENS))):
        """``pool``: the flags that size the KV pool (e.g. ``("--memory-bytes", "1073741824")``)."""
        from radixkv.frontend import RuntimeEndpoint
        from radixkv.server.process import ServerProcess

        self.server = ServerProcess(*pool, *flags)  # the default backend (auto)
        self.backend = RuntimeEndpoint(self.server.url)

    def reset(self) -> None:
        self.backend.flush_cache()

    def close(self) -> None:
        self.backend.close()
        self.server.stop()


class InProcess:
    def __init__(self, backend):
        self.backend = backend

    def reset(self) -> None:
        pass

    def close(self) -> None:
        self.backend.close()


# name -> factory: the system ready to serve (``backend``, ``reset``, ``close``), or None
# (with a printed reason) when it cannot run here. Peers are added by benchmarks/bench_e2e.py.
SYSTEMS: dict[str, Callable] = {
    "radixkv": lambda: Served(),
    "radixkv-no-cache": lambda: Served("--no-enable-prefix-cache"),
    "radixkv-bf16-kv": lambda: Served("--kv-dtype", "bf16"),
    "radixkv-act8": lambda: Served("--activation-bits", "8"),
    "radixkv-act8-bf16-kv": lambda: Served("--activation-bits", "8", "--kv-dtype", "bf16"),  # bf16-class precision
}


def warm_up(backend) -> None:
    ids = backend.tokenize("Warm up the runtime with a short request.")
    backend.generate([ids], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})


# -- reports ------------------------------------------------------------------------------------


def fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def print_tables(results: list[Result]) -> tuple[dict, dict]:
    """Per workload: the systems' figures, and radixkv's throughput multiples: each
    round's (radixkv's tok/s over the peer's in the same round) and their median, the
    summary."""
    summary, by_round = {}, {}
    several = len({r.round for r in results}) > 1
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload]
        print(f"\n== {workload}")
        print(f"{'system':<22}{'wall s':>9}{'out tok/s':>11}{'req/s':>8}{'TTFT p50':>10}{'TTFT p90':>10}"
              f"{'hit %':>8}{'same text':>11}")  # fmt: skip
        for r in rows:
            ref = next((x for x in rows if x.system == "transformers" and x.round == r.round), None)
            same = "-" if ref is None or r is ref else f"{sum(a == b for a, b in zip(r.texts, ref.texts))}/{len(r.texts)}"
            hit = fmt(None if r.hit_rate is None else 100 * r.hit_rate, ".1f")
            label = f"{r.system} #{r.round + 1}" if several else r.system
            print(f"{label:<22}{r.wall_s:>9.1f}{r.tok_s:>11.1f}{r.req_s:>8.2f}{fmt(r.ttft_p50, '.2f'):>10}"
                  f"{fmt(r.ttft_p90, '.2f'):>10}{hit:>8}{same:>11}")  # fmt: skip
        summary[workload], by_round[workload] = {}, {}
        for peer in GOALS:
            ratios = [ours.tok_s / other.tok_s for ours in rows if ours.system == "radixkv"
                      for other in rows if other.system == peer and other.round == ours.round]  # fmt: skip
            if ratios:
                summary[workload][peer], by_round[workload][peer] = float(np.median(ratios)), ratios
        if summary[workload]:
            print("radixkv throughput: " + ", ".join(
                f"{v:.2f}x {k}" + (f" (median of {', '.join(f'{x:.2f}' for x in by_round[workload][k])})"
                                   if len(by_round[workload][k]) > 1 else "")
                for k, v in summary[workload].items()))  # fmt: skip
    return summary, by_round


def plot_throughput(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    systems = list(dict.fromkeys(r.system for r in results))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        vals = [float(np.median([r.tok_s for r in results if r.workload == w and r.system == system] or [0]))
                for w in workloads]  # fmt: skip  (the median over --rounds)
        ax.bar(np.arange(len(workloads)) + i * width, vals, width, label=system)
    ax.set_xticks(np.arange(len(workloads)) + 0.4 - width / 2, workloads)
    ax.set_ylabel("output tokens / s")
    ax.set_title("End-to-end throughput, SmolLM2-135M fp32 on a 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hit_rates(workloads: list[W.Workload], path: Path, trace_dir: Path) -> dict:
    """Each workload's trace replayed by `radixkv sim` (LRU) at 10-100% of its unique pages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from radixkv.cache import sim, traces

    fractions = (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)
    curves = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in workloads:
        trace_path = trace_dir / f"{w.name}.jsonl"
        W.export_trace(w, trace_path)
        result = sim.sweep(traces.load_jsonl(trace_path), 16, ("lru",), fractions, None, 1, False)
        runs = [r for r in result["runs"] if r["policy"] == "lru"]
        curves[w.name] = {round(r["capacity_fraction"], 3): 100 * r["hit_rate"] for r in runs}
        ax.plot([100 * r["capacity_fraction"] for r in runs], [100 * r["hit_rate"] for r in runs], marker="o",
                label=w.name)
    ax.set_xlabel("cache size, % of the workload's unique KV pages")
    ax.set_ylabel("prefix-cache hit rate, % of prompt tokens")
    ax.set_title("Hit rate vs cache size (radixkv sim, LRU, page size 16)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return curves


def run_all(scale: W.Scale, names: list[str], systems: dict[str, Callable], seed: int = 0,
            rounds: int = 1) -> list[Result]:  # fmt: skip
    """Every system through every workload, one system at a time; with ``rounds`` > 1 all
    of that again, the systems' order reversed every other round, so that a drift of the
    machine's speed reaches both sides of a ratio."""
    workloads = [W.make(n, seed, scale) for n in names]
    results = []
    for k in range(rounds):
        for system, factory in (systems.items() if k % 2 == 0 else reversed(systems.items())):
            results += run_system(system, factory, workloads, k if rounds > 1 else None)
    return results


def run_system(system: str, factory: Callable, workloads: list[W.Workload], round_: int | None) -> list[Result]:
    """``system``'s server started, warmed up, run through ``workloads`` (its cache flushed
    before each) and stopped; none where it cannot run. ``round_``: with --rounds, which."""
    opened = factory()
    if opened is None:
        return []
    results = []
    try:
        warm_up(opened.backend)
        for w in workloads:
            opened.reset()
            print(f"[{system}{'' if round_ is None else f' #{round_ + 1}'}] {w.name} ...", flush=True)
            reports_cache = getattr(opened, "reports_cache", system.startswith("radixkv"))
            results.append(replace(measure(w, system, opened.backend, reports_cache), round=round_ or 0))
    finally:
        opened.close()
    return results


def main(argv=None, peers: dict[str, Callable] | None = None, versions: Callable[[], dict] | None = None) -> int:
    """Run the benchmark. ``peers`` adds systems by name (factories as in ``SYSTEMS``);
    ``versions()`` gives their versions for the JSON."""
    systems_known = {**SYSTEMS, **(peers or {})}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=W.SCALES, default="full")
    ap.add_argument("--workloads", default=",".join(W.WORKLOADS))
    ap.add_argument("--systems", default=",".join(systems_known))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, in reversed order every other round; the "
                         "throughput multiples are the median of the rounds' (each round's radixkv over its peer)")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/out", help="directory for JSON, plots and traces")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = [n for n in args.workloads.split(",") if n]
    systems = [s for s in args.systems.split(",") if s]
    for n in names:
        if n not in W.WORKLOADS:
            ap.error(f"unknown workload {n!r}; choose from {', '.join(W.WORKLOADS)}")
    for s in systems:
        if s not in systems_known:
            ap.error(f"unknown system {s!r}; choose from {', '.join(systems_known)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    scale = W.SCALES[args.scale]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(scale, names, {s: systems_known[s] for s in systems}, args.seed, args.rounds)
    summary, by_round = print_tables(results)
    curves = {}
    if not args.no_plots and results:
        plot_throughput(results, out / "e2e_throughput.png")
        curves = plot_hit_rates([W.make(n, args.seed, scale) for n in names], out / "e2e_hit_rate.png", out)
        print(f"\nplots: {out / 'e2e_throughput.png'}, {out / 'e2e_hit_rate.png'}")
    rows = [{**{k: v for k, v in asdict(r).items() if k != "texts"}, "output_tok_s": r.tok_s, "req_s": r.req_s,
             "hit_rate": r.hit_rate} for r in results]  # fmt: skip
    peer_versions = versions() if versions else {}
    write_result(out / "bench_e2e.json", rows, scale=args.scale, scale_settings=asdict(scale), seed=args.seed,
                 **peer_versions, rounds=args.rounds,
                 speedups=summary, speedups_by_round=by_round, hit_rate_vs_capacity=curves, goals=GOALS,
                 total_seconds=time.perf_counter() - t0)  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0



def write_result(path: str | Path, rows, **meta) -> None:
    """Write ``{"meta": {date, machine, **meta}, "rows": rows}`` as JSON and say where."""
    info = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **meta,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": info, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")
