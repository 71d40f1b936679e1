"""Attention backend benchmark (GPU): long-context decode and extend over the paged pool.

Every registered backend among torch, triton and flashinfer runs the same two
problems, bf16, 32 query heads on 8 KV heads of 128, pages of 16 tokens, pages
scattered over the pool:

- decode: 32 sequences of 8192 tokens (8191 cached + 1 new). Attention here only streams
  K and V, so the figure of merit is achieved KV bandwidth (bytes of K and V read per
  second) as a share of the device-to-device copy bandwidth measured in the same run
  (``dst.copy_(src)`` of a 1 GiB buffer, read + write bytes counted).
- extend: 8 sequences with 512 new tokens each on 4096 cached; time per batch and its
  ratio to flashinfer's.
- long decode by KV format: 8 sequences of 32,768 tokens over bf16 pages and over int8
  pages (one byte a value plus a scale byte per token and KV head); time per step and
  int8's speed-up over the same backend on bf16 pages and over that backend's fastest
  variant on bf16 pages (issue 15's GPU target: triton int8 >= 1.3x bf16).

Every problem's K/V goes into a one-layer pool of its format through ``KVPool.store_kv``,
as the engine stores it. Each backend is planned once per problem, then ``forward``
(attention alone: backends read the pool, they do not store) runs over and over; CUDA
events after a warm-up of 3 calls and 0.2 s (an idle GPU clocks down), median of
``--repeat``; with ``--rounds N`` every backend is timed N times, the backends
interleaved, and the median of the rounds is reported with their spread. Backends that
are not registered, or whose factory or first call raises, are listed as skipped with
the reason.

    .venv/bin/python benchmarks/bench_attention.py [--json benchmarks/out/bench_attention.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402
from radixkv.kernels import get_backend  # noqa: E402

BACKENDS = ("torch", "triton", "flashinfer")
HQ, HKV, DIM, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DECODE = {"batch": 32, "cached": 8191, "new": 1}
EXTEND = {"batch": 8, "cached": 4096, "new": 512}
LONG_DECODE = {"batch": 8, "cached": 32767, "new": 1}
LONG_FORMATS = ("bf16", "int8")
COPY_BYTES = 1 << 30
WARMUP = 3  # calls at least,
WARMUP_S = 0.2  # and seconds at least: an idle GPU's clocks take a while to come back up


def cuda_ms(fn, repeat: int) -> float:
    """Median milliseconds of ``repeat`` calls of ``fn`` after a warm-up of ``WARMUP``
    calls and ``WARMUP_S`` seconds, by CUDA events."""
    calls, begin = 0, time.perf_counter()
    while calls < WARMUP or time.perf_counter() - begin < WARMUP_S:
        fn()
        calls += 1
        if calls % 16 == 0:
            torch.cuda.synchronize()  # (time the GPU's work, not the launches queued)
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def copy_bandwidth(repeat: int) -> float:
    """Device-to-device copy bandwidth in GB/s, read and write bytes both counted."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), repeat)
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


class Problem:
    """One batch of ``batch`` sequences, each ``new`` tokens on ``cached`` tokens already in
    the pool; page ids shuffled so no sequence's pages are contiguous."""

    def __init__(self, batch: int, cached: int, new: int, seed: int = 0, kv_dtype: str = "bf16"):
        g = torch.Generator().manual_seed(seed)
        per_seq = -(-(cached + new) // PAGE)
        num_pages = batch * per_seq
        order = torch.randperm(num_pages, generator=g).numpy().astype(np.int32)
        seqs = [SeqInput([0] * new, cached, order[i * per_seq : (i + 1) * per_seq]) for i in range(batch)]
        self.batch = ForwardBatch.build(seqs, PAGE, device="cuda")
        # K/V through a pool of the format, a sequence at a time, as the engine stores them
        pool = KVPool(PoolConfig(1, HKV, DIM, PAGE, kv_dtype=kv_dtype, num_pages=num_pages, device="cuda"))
        for s in seqs:
            kv = torch.randn(2, cached + new, HKV, DIM, dtype=DTYPE, device="cuda")
            pool.store_kv(0, kv[0], kv[1], pool.slots(s.pages, 0, cached + new))
        self.kv = pool.view(0)
        stored = pool.config.kv_dtype.bytes_per_page(1, PAGE, HKV, DIM) // PAGE  # K and V (and scales) per token
        t = self.batch.num_tokens
        self.q = torch.randn(t, HQ, DIM, dtype=DTYPE, device="cuda")
        self.k = torch.randn(t, HKV, DIM, dtype=DTYPE, device="cuda")
        self.v = torch.randn(t, HKV, DIM, dtype=DTYPE, device="cuda")
        self.kv_bytes = sum(self.batch.seq_lens) * stored  # read once
        # multiply-adds of QK^T and PV over the causal pattern, 2 flops each
        pairs = sum(sum(range(s - n + 1, s + 1)) for n, s in zip(self.batch.qo_lens, self.batch.seq_lens))
        self.flops = 4 * HQ * DIM * pairs


def run(name: str, p: Problem, repeat: int):
    """``(ms, output)`` for one backend on ``p``, or ``(None, reason)`` when it cannot run.
    ``name@N[:W:S[:P]]``: that backend with its decode block set to N context positions
    for every KV format (its decode kernel launched with W warps and S pipeline stages, the
    context split in up to P slices): a sweep of the Triton decode kernel."""
    name, _, variant = name.partition("@")
    try:
        impl = get_backend(name, "cuda", p.kv.format.dtype)
        if variant:  # one DecodeTile for every KV kind; fields not given keep the backend's DECODE
            fields = [int(x) for x in variant.split(":")]
            impl.DECODE = type(impl.DECODE)(*fields, *dataclasses.astuple(impl.DECODE)[len(fields):])
            impl.DECODE_BY_KIND = {}
    except ValueError:
        return None, "not registered"
    except Exception as e:  # an optional dependency missing, no GPU support, ...
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    scale = DIM**-0.5
    try:
        impl.plan(p.batch)  # once: forward below is one layer, repeated
        fn = lambda: impl.forward(p.q, p.k, p.v, p.kv, scale)  # noqa: E731
        out = fn()
        ms = cuda_ms(fn, repeat)
    except Exception as e:
        torch.cuda.empty_cache()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    torch.cuda.empty_cache()
    return ms, out


def timed(names: list[str], p: Problem, args, spread: dict) -> dict:
    """``run`` for every backend in ``names``, ``args.rounds`` times over, the backends
    interleaved: ``{name: (median ms of the rounds, output)}`` (or ``(None, reason)``);
    each backend's per-round times go into ``spread[name]``."""
    results: dict = {}
    for _ in range(args.rounds):
        for n in names:
            ms, out = run(n, p, args.repeat)
            if ms is None:
                results[n] = (None, out)
                continue
            spread.setdefault(n, []).append(ms)
            results[n] = (statistics.median(spread[n]), out)
    return results


def rounds_note(times: list[float] | None) -> str:
    """`` rounds a-b ms`` when a backend was timed more than once, else nothing."""
    return f"  rounds {min(times):.3f}-{max(times):.3f}" if times and len(times) > 1 else ""


def torch_output(results: dict):
    """The torch backend's output among ``timed``'s results (what the others are compared
    with), or None when it did not run."""
    ms, out = results.get("torch", (None, None))
    return out if ms is not None else None


def skipped(rows: list, label: str, reason: str, **row) -> None:
    """Print and record a backend that could not run."""
    print(f"{label}  skipped: {reason}")
    rows.append({**row, "skipped": reason})


def max_diff(out, ref) -> float | None:
    return None if ref is None else float((out.float() - ref.float()).abs().max())


def fmt(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_attention.json")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--problems", default="decode,extend,long", help="which of decode, extend, long to run")
    ap.add_argument("--long-formats", default=",".join(LONG_FORMATS), help="the long decode's KV formats")
    ap.add_argument("--rounds", type=int, default=1, help="time every backend this many times, interleaved "
                    "(the median is reported, the spread beside it)")  # fmt: skip
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated names")
    ap.add_argument("--decode-backends", default=None, help="for both decode problems (default: --backends); "
                    "name@N[:W:S[:P]] sets a decode block of N positions (W warps, S stages, up to P splits), "
                    "e.g. triton@32 or triton@64:8:3:32")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU (torch.cuda.is_available() is False here); nothing measured.")
        return 0
    names = [n for n in args.backends.split(",") if n]
    problems = set(args.problems.split(","))
    long_formats = [f for f in args.long_formats.split(",") if f]
    decode_names = [n for n in (args.decode_backends or args.backends).split(",") if n]
    try:
        fi_version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        fi_version = None
    device = torch.cuda.get_device_name()
    copy_gb_s = copy_bandwidth(args.repeat)
    torch.cuda.empty_cache()  # the copy buffers are gone once it returns

    print(f"{device}, torch {torch.__version__}, flashinfer {fi_version or 'not installed'}")
    print(f"bf16, heads {HQ}/{HKV}, head_dim {DIM}, page {PAGE}; CUDA events, median of {args.repeat}"
          f"{f', {args.rounds} rounds interleaved' if args.rounds > 1 else ''}")
    print(f"device-to-device copy: {copy_gb_s:,.0f} GB/s (read + write)")
    rows = []

    # decode ------------------------------------------------------------------------------
    if "decode" in problems:
        p, spread = Problem(**DECODE), {}
        results = timed(decode_names, p, args, spread)
        ref = torch_output(results)
        ctx = DECODE["cached"] + DECODE["new"]
        print(f"\ndecode: {DECODE['batch']} seqs x {ctx} tokens, {p.kv_bytes / 1e9:.2f} GB of K+V")
        print(f"{'backend':<16}{'ms':>9}{'KV GB/s':>10}{'of copy BW':>12}{'max|d| vs torch':>17}")
        for n, (ms, out) in results.items():
            if ms is None:
                skipped(rows, f"{n:<16}", out, case="decode", backend=n)
                continue
            gb_s = p.kv_bytes / (ms * 1e-3) / 1e9
            d = max_diff(out, ref)
            print(f"{n:<16}{ms:>9.3f}{gb_s:>10,.0f}{gb_s / copy_gb_s:>11.0%} {fmt(d, '.2e', 16)}"
                  f"{rounds_note(spread.get(n))}")  # fmt: skip
            rows.append({"case": "decode", "backend": n, "ms": ms, "ms_rounds": spread.get(n), "kv_gb_s": gb_s,
                         "fraction_of_copy_bw": gb_s / copy_gb_s, "max_abs_diff_vs_torch": d})  # fmt: skip
        del p, results, ref
        torch.cuda.empty_cache()

    # extend ------------------------------------------------------------------------------
    if "extend" in problems:
        p, spread = Problem(**EXTEND), {}
        results = timed(names, p, args, spread)
        ref = torch_output(results)
        fi_ms = results.get("flashinfer", (None, None))[0]
        print(f"\nextend: {EXTEND['batch']} seqs x {EXTEND['new']} new tokens on {EXTEND['cached']} cached")
        print(f"{'backend':<16}{'ms':>9}{'TFLOP/s':>10}{'x flashinfer':>14}{'max|d| vs torch':>17}")
        for n, (ms, out) in results.items():
            if ms is None:
                skipped(rows, f"{n:<16}", out, case="extend", backend=n)
                continue
            tflops = p.flops / (ms * 1e-3) / 1e12
            ratio = ms / fi_ms if fi_ms else None
            d = max_diff(out, ref)
            ratio_s = "-" if ratio is None else f"{ratio:.2f}x"
            print(f"{n:<16}{ms:>9.3f}{tflops:>10.1f}{ratio_s:>14} {fmt(d, '.2e', 16)}"
                  f"{rounds_note(spread.get(n))}")  # fmt: skip
            rows.append({"case": "extend", "backend": n, "ms": ms, "ms_rounds": spread.get(n), "tflop_s": tflops,
                         "time_vs_flashinfer": ratio, "max_abs_diff_vs_torch": d})  # fmt: skip
        del p, results, ref
        torch.cuda.empty_cache()

    # long decode by KV format ------------------------------------------------------------
    if "long" in problems:
        ctx = LONG_DECODE["cached"] + LONG_DECODE["new"]
        print(f"\nlong decode: {LONG_DECODE['batch']} seqs x {ctx} tokens, by KV format")
        print(f"{'format':<8}{'backend':<16}{'ms':>9}{'KV GB/s':>10}{'x bf16':>9}{'x best bf16':>13}{'max|d| vs torch':>17}")
        base: dict[str, float] = {}  # bf16's time by backend (variant included), and by backend its fastest variant's
        best: dict[str, float] = {}
        for fmt_name in long_formats:
            p, spread = Problem(**LONG_DECODE, kv_dtype=fmt_name), {}
            results = timed(decode_names, p, args, spread)
            ref = torch_output(results)
            for n, (ms, out) in results.items():
                if ms is None:
                    skipped(rows, f"{fmt_name:<8}{n:<16}", out, case="long_decode", kv_dtype=fmt_name, backend=n)
                    continue
                family = n.partition("@")[0]
                if fmt_name == "bf16":
                    base[n] = ms
                    best[family] = min(ms, best.get(family, ms))
                speedup = base[n] / ms if n in base else None
                over_best = best[family] / ms if family in best else None
                gb_s = p.kv_bytes / (ms * 1e-3) / 1e9
                d = max_diff(out, ref)
                print(f"{fmt_name:<8}{n:<16}{ms:>9.3f}{gb_s:>10,.0f}{fmt(speedup, '.2f', 8)}x"
                      f"{fmt(over_best, '.2f', 12)}x {fmt(d, '.2e', 16)}{rounds_note(spread.get(n))}")  # fmt: skip
                rows.append({"case": "long_decode", "kv_dtype": fmt_name, "backend": n, "ms": ms,
                             "ms_rounds": spread.get(n), "kv_gb_s": gb_s,
                             "speedup_vs_bf16": speedup, "speedup_vs_best_bf16": over_best,
                             "max_abs_diff_vs_torch": d})  # fmt: skip
            del p, results, ref
            torch.cuda.empty_cache()

    write_result(
        args.json, rows, device=device, torch=torch.__version__, flashinfer=fi_version, copy_gb_s=copy_gb_s,
        dtype="bfloat16", heads={"q": HQ, "kv": HKV}, head_dim=DIM, page_size=PAGE, decode=DECODE, extend=EXTEND, long_decode=LONG_DECODE,
        repeat=args.repeat, rounds=args.rounds, warmup={"calls": WARMUP, "seconds": WARMUP_S},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
