"""What a KV format buys at a fixed pool size in bytes, end to end.

The RAG and multi-turn programs of ``radixkv.workloads`` (what ``radixkv bench`` runs) on a
real ``radixkv serve`` process (the embedded model, the default attention backend), with the
machinery of ``radixkv/workloads/bench.py`` (RuntimeEndpoint client, the workload's client
threads sending concurrently, the cache flushed before each workload), once per
configuration (KV format, pool bytes): the server runs with ``--kv-dtype FMT --memory-bytes
N``. For each budget B of ``--pool-bytes`` the configurations are fp32 at ``--ref-multiple``
x B (the reference), then each of ``--kv-dtypes`` at B: by default fp32@4B, fp32@B, int8@B,
int4@B. The question: does int8 at B reach fp32's hit rate at 4B, within 1 point?

Per workload and configuration: prompt-cache hit rate (cached / prompt tokens of every
call), pages the pool holds (the server's /stats; a page's bytes come from the KV format,
never hard-coded), wall seconds, output tok/s, pages evicted, and how many programs' texts
equal the reference row's (fp32 at any pool size must give the same text; a quantized
format need not). Beside each e2e hit rate, `radixkv sim` at the same pool bytes
(``sim.byte_sweep``: LRU, one request in flight, pages = bytes // ``KVFormat.bytes_per_page``)
on two traces:

    sim       the workload's trace as ``radixkv sim --workload`` records it: programs one
              at a time, placeholder outputs
    sim sent  the requests this run sent, in the order it sent them, with the model's real
              outputs (saved as JSONL under bench_kvbytes_traces/ beside the JSON)

Concurrent clients interleave conversations, so a multi-turn pool must hold every open
conversation at once, not one: "sim" misses that, "sim sent" sees it. Neither models the
scheduler admitting the waiting request with the longest cached prefix first, which e2e
gains from when the pool is short. Interleaving depends on timing, so e2e hit rates under
pressure vary from run to run (multi-turn, fp32 at 80 MiB: 26.6% to 35.1% in three runs).

Sizes. The defaults (``--scale small``, ``--pool-bytes 80MiB``) are scaled down to the
workloads: at the small scale the RAG trace needs 725 unique pages (510 MiB of fp32, page
size 16) and multi-turn 332 (233 MiB), so fp32 at 1 GiB would hold all of either and every
configuration of the 1 GiB / 4 GiB question would show the same hit rate. B = 80 MiB holds
113 fp32 pages: enough for the longest single request (multi-turn's last turn, 1,521 tokens,
96 pages) but far short of either working set, so fp32@B evicts, while fp32@4B (320 MiB, 455
pages) holds most of RAG's and all of multi-turn's; int8 and int4 at B hold about 4x and 6x
fp32's pages. The default run (4 servers, 8 workload runs; int4 takes the slower torch
attention path) takes 10 minutes on a 2-core CPU (16 with other jobs sharing it).
``--workloads rag --pool-bytes 48MiB`` puts RAG on the steep part of its curve (fp32@4B
holds 273 of its 725 pages), a stricter test of int8. ``--scale full --pool-bytes 1GiB``
asks it at the README's sizes (not run: at full scale multi-turn's 1,810 unique pages fit
1 GiB of fp32 and RAG's 2,345 nearly do, so it says little there either).

    .venv/bin/python benchmarks/bench_kvbytes.py [--scale tiny|small|full] [--workloads rag,multi_turn]
        [--pool-bytes 80MiB[,160MiB...]] [--kv-dtypes fp32,int8,int4] [--ref-multiple 4]
        [--json benchmarks/out/bench_kvbytes.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from array import array
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from radixkv import workloads as W  # noqa: E402
from radixkv.cache import sim  # noqa: E402
from radixkv.cache.traces import TraceRequest, dump_jsonl  # noqa: E402
from radixkv.cli import _bytes_per_page, _kv_dtypes, _sizes  # noqa: E402  (radixkv sim's parsers)
from radixkv.frontend.backends import Backend  # noqa: E402
from radixkv.workloads import bench  # noqa: E402

PAGE_SIZE = 16  # EngineConfig's default page size, which the server runs with
TARGET_POINTS = 1.0  # int8 at B within this many points of fp32 at 4B


class SentLog(Backend):
    """A backend that passes every call on and records each request as sent (submission
    order, the model's output ids): the trace of the e2e run itself."""

    def __init__(self, inner: Backend):
        self.inner, self.eos_token_ids, self.max_context = inner, inner.eos_token_ids, inner.max_context
        self.requests: list[TraceRequest | None] = []
        self._lock = threading.Lock()

    def tokenize(self, *args, **kwargs):
        return self.inner.tokenize(*args, **kwargs)

    def render_chat(self, messages, add_generation_prompt):
        return self.inner.render_chat(messages, add_generation_prompt)

    def generate(self, prompts, params):
        with self._lock:
            first = len(self.requests)
            self.requests += [None] * len(prompts)
        results = self.inner.generate(prompts, params)
        for i, (prompt, r) in enumerate(zip(prompts, results)):
            self.requests[first + i] = TraceRequest(array("i", prompt), output_tokens=array("i", r.token_ids))
        return results


def configurations(budgets: tuple[int, ...], formats: tuple[str, ...], multiple: int) -> list[tuple[str, int]]:
    """(format, pool bytes): per budget B, fp32 at ``multiple`` x B first (none when 0), then
    each format at B; duplicates dropped."""
    configs = []
    for b in budgets:
        configs += ([("fp32", multiple * b)] if multiple else []) + [(f, b) for f in formats]
    return list(dict.fromkeys(configs))


def label(fmt: str, size: int) -> str:
    return f"{fmt} @ {sim.format_bytes(size)}"


def sim_hit_rate(trace: list[TraceRequest], fmt: str, size: int, per_page: int) -> float:
    """`radixkv sim --pool-bytes SIZE --kv-dtype FMT` on ``trace`` (LRU, one request in flight)."""
    (run,) = sim.byte_sweep(trace, PAGE_SIZE, (size,), {fmt: per_page})["runs"]
    return run["hit_rate"]


def check_fits(configs, per_page: dict[str, int], traces: dict[str, list[TraceRequest]]) -> str | None:
    """An error message if some pool cannot hold the longest request of a workload alone."""
    for name, trace in traces.items():
        longest = max(len(r.tokens) + r.num_output for r in trace)
        for fmt, size in sorted(configs, key=lambda c: c[1] // per_page[c[0]]):  # the smallest pool first
            pages = size // per_page[fmt]
            if pages * PAGE_SIZE < longest + PAGE_SIZE:
                return (f"{label(fmt, size)} holds {pages} pages ({pages * PAGE_SIZE} tokens), but {name}'s longest "
                        f"request needs {longest} tokens: raise --pool-bytes or lower --scale")  # fmt: skip
    return None


def run_config(fmt: str, size: int, workloads: list[W.Workload]) -> tuple[dict, list[dict]]:
    """Serve with this format and pool size; run each workload on an empty cache.
    Returns the server's pool stats and one row per workload (with ``sent``: its trace)."""
    import httpx

    served = bench.Served("--kv-dtype", fmt, pool=("--memory-bytes", str(size)))
    stats = lambda: httpx.get(served.server.url + "/stats", timeout=60).json()  # noqa: E731
    rows = []
    try:
        pool = stats()["pool"]
        bench.warm_up(served.backend)
        for w in workloads:
            served.reset()
            print(f"[{label(fmt, size)}: {pool['pages']} pages] {w.name} ...", flush=True)
            log, before = SentLog(served.backend), stats()
            r = bench.measure(w, label(fmt, size), log, reports_cache=True)
            after = stats()
            rows.append({"result": r, "sent": log.requests,
                         "evicted_pages": after["cache"]["evicted_pages"] - before["cache"]["evicted_pages"],
                         "preemptions": after["preemptions"] - before["preemptions"]})  # fmt: skip
    finally:
        served.close()
    return pool, rows


def print_table(name: str, rows: list[dict], unique_pages: int, per_page_fp32: int) -> None:
    """One workload's table: a row per configuration, the first one the reference of "same text"."""
    print(f"\n== {name} ({unique_pages} unique pages = {sim.format_bytes(unique_pages * per_page_fp32)} of fp32)")
    head = f"{'config':<18}{'pages':>7}{'hit e2e':>9}{'sim':>8}{'sim sent':>10}{'wall s':>8}{'out tok/s':>11}"
    print(head + f"{'evicted':>9}{'same text':>11}")
    ref_texts = rows[0]["result"].texts
    for row in rows:
        r = row["result"]
        same = sum(a == b for a, b in zip(r.texts, ref_texts))
        print(f"{row['config']:<18}{row['pages']:>7}{100 * r.hit_rate:>9.2f}{100 * row['hit_sim']:>8.2f}"
              f"{100 * row['hit_sim_sent']:>10.2f}{r.wall_s:>8.1f}{r.tok_s:>11.1f}{row['evicted_pages']:>9}"
              f"{f'{same}/{len(r.texts)}':>11}")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=W.SCALES, default="small", help="workload sizes (default small)")
    ap.add_argument("--workloads", default="rag,multi_turn", help="comma-separated (default rag,multi_turn)")
    ap.add_argument("--pool-bytes", type=_sizes, default=(80 << 20,),
                    help="budgets B, e.g. 80MiB or 1GiB,256MiB (default 80MiB; see the module docstring)")
    ap.add_argument("--kv-dtypes", type=_kv_dtypes, default=("fp32", "int8", "int4"),
                    help="KV formats run at each budget (default fp32,int8,int4)")  # fmt: skip
    ap.add_argument("--ref-multiple", type=int, default=4,
                    help="the reference row: fp32 at this multiple of each budget; 0: none (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/out/bench_kvbytes.json")
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    for n in names:
        if n not in W.WORKLOADS:
            ap.error(f"unknown workload {n!r}; choose from {', '.join(W.WORKLOADS)}")
    if args.ref_multiple < 0:
        ap.error("--ref-multiple must be >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()

    configs = configurations(args.pool_bytes, args.kv_dtypes, args.ref_multiple)
    per_page = _bytes_per_page(None, tuple(dict.fromkeys(["fp32"] + [f for f, _ in configs])), PAGE_SIZE)
    workloads = [W.make(n, args.seed, W.SCALES[args.scale]) for n in names]
    traces = {w.name: W.trace(w) for w in workloads}
    error = check_fits(configs, per_page, traces)
    if error:
        print(f"bench_kvbytes: error: {error}", file=sys.stderr)
        return 2
    print("bytes per page (page size 16, all layers, K and V, scales included): "
          + ", ".join(f"{f} {b:,}" for f, b in per_page.items()))  # fmt: skip

    rows = {w.name: [] for w in workloads}
    traces_dir = Path(args.json).parent / "bench_kvbytes_traces"  # what each run sent, for `radixkv sim`
    traces_dir.mkdir(parents=True, exist_ok=True)
    for fmt, size in configs:
        pool, results = run_config(fmt, size, workloads)
        if pool["bytes_per_page"] != per_page[fmt]:
            print(f"note: the server's {fmt} page is {pool['bytes_per_page']} bytes, the format says {per_page[fmt]}")
        for w, row in zip(workloads, results):
            row.update(config=label(fmt, size), kv_dtype=fmt, pool_bytes=size, pages=pool["pages"],
                       bytes_per_page=pool["bytes_per_page"], kv_format=pool["kv_format"],
                       hit_sim=sim_hit_rate(traces[w.name], fmt, size, pool["bytes_per_page"]),
                       hit_sim_sent=sim_hit_rate(row["sent"], fmt, size, pool["bytes_per_page"]))  # fmt: skip
            rows[w.name].append(row)
            row["sent_trace"] = str(traces_dir / f"{w.name}-{fmt}-{size}.jsonl")
            dump_jsonl(row["sent"], row["sent_trace"])

    comparisons = {}
    for w in workloads:
        unique = sim.replay(traces[w.name], None, PAGE_SIZE).cached_pages
        print_table(w.name, rows[w.name], unique, per_page["fp32"])
        if args.ref_multiple:
            comparisons[w.name] = compare(rows[w.name], args.pool_bytes, args.ref_multiple)

    out = []
    for name, rs in rows.items():
        for row in rs:
            r = row.pop("result")
            row.pop("sent")
            out.append({"workload": name, **row, **{k: v for k, v in asdict(r).items() if k not in ("texts", "system")},
                        "hit_rate": r.hit_rate, "output_tok_s": r.tok_s})  # fmt: skip
    import torch

    import radixkv

    write_result(args.json, out, scale=args.scale, scale_settings=asdict(W.SCALES[args.scale]), seed=args.seed,
                 pool_bytes=list(args.pool_bytes), kv_dtypes=list(args.kv_dtypes), ref_multiple=args.ref_multiple,
                 page_size=PAGE_SIZE, bytes_per_page=per_page, comparisons=comparisons, target_points=TARGET_POINTS,
                 torch=torch.__version__, radixkv=radixkv.__version__, threads=torch.get_num_threads(),
                 total_seconds=time.perf_counter() - t0)  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


def compare(rows: list[dict], budgets: tuple[int, ...], multiple: int) -> dict:
    """Each format at B against fp32 at multiple x B: hit-rate difference in points (e2e and sim)."""
    by = {(r["kv_dtype"], r["pool_bytes"]): r for r in rows}
    out = {}
    for b in budgets:
        ref = by.get(("fp32", multiple * b))
        for (fmt, size), r in by.items():
            if size != b or ref is None or r is ref:
                continue
            e2e = 100 * (r["result"].hit_rate - ref["result"].hit_rate)
            sim_d = 100 * (r["hit_sim"] - ref["hit_sim"])
            verdict = "met" if e2e >= -TARGET_POINTS else "not met"
            print(f"  {label(fmt, b)} vs {ref['config']}: {e2e:+.2f} points e2e, {sim_d:+.2f} sim"
                  + (f" (target >= -{TARGET_POINTS:g}: {verdict})" if fmt == "int8" else ""))  # fmt: skip
            out[label(fmt, b)] = {"vs": ref["config"], "points_e2e": e2e, "points_sim": sim_d}
    return out


if __name__ == "__main__":
    sys.exit(main())
