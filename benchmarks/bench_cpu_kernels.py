"""The CPU kernels a prefill spends its time in, alone, against what a float32 runtime
runs in their place (the same run, rounds interleaved, medians):

- extend attention: the ``cpu`` backend's extend kernel (``radixkv_paged_extend``) against
  the ``torch`` backend (SDPA per sequence) on one layer of SmolLM2's shape (9 query / 3
  KV heads of 64, float32 pages of 16 scattered over the pool): few-shot's extend (771 new
  tokens over 1,152 cached), RAG's (4 sequences of 300 over 1,500) and a 512-token prefill;
- the products: ``PackedMatrix.linear`` on the embedded model's Q4_1 matrices of layer 0
  (q/k/v stacked, o, gate/up stacked, down) for a 771-token prefill, with 16- and 8-bit
  activation codes (``activation_bits``), against ``F.linear`` on the same weights
  expanded to float32 (the BLAS product vLLM's CPU build and the exact mode run).

Reported: milliseconds, G multiply-adds per second, and the ratio to the float32 peer.
Threads: ``--threads`` (default 2) for both.

Then the products' ceiling on this CPU (``tile_ceiling.c``, timed in the same rounds): a
tile block's 192 integer multiply-adds with the tokens' broadcasts, alone and with the 36
float steps per block that the bit contract adds (one multiply and two fused
multiply-adds per token and 8 rows), the weights' loads and decode left out, on the same
threads; each 16-bit product's rate as a share of that ceiling.

    .venv/bin/python benchmarks/bench_cpu_kernels.py [--rounds 5] [--json benchmarks/out/bench_cpu_kernels.json]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_seconds, write_result  # noqa: E402
from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.kernels import build, get_backend, weights  # noqa: E402
from radixkv.model import load_model  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402

HQ, HKV, DIM, PAGE = 9, 3, 64, 16
EXTENDS = {"few-shot 771 over 1152": (1, 1152, 771), "RAG 4 x 300 over 1500": (4, 1500, 300),
           "prefill 512": (1, 0, 512)}  # fmt: skip
PRODUCT_TOKENS = 771


class Extend:
    """``batch`` sequences of ``new`` tokens on ``cached`` in a one-layer float32 pool,
    pages shuffled; both backends planned once."""

    def __init__(self, batch: int, cached: int, new: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        per_seq = -(-(cached + new) // PAGE)
        order = torch.randperm(batch * per_seq, generator=g).numpy().astype(np.int32)
        seqs = [SeqInput([0] * new, cached, order[i * per_seq : (i + 1) * per_seq]) for i in range(batch)]
        self.batch = ForwardBatch.build(seqs, PAGE)
        pool = KVPool(PoolConfig(1, HKV, DIM, PAGE, num_pages=batch * per_seq))
        fresh = []  # the new tokens' K/V, in the pool too (the engine stores them before attention)
        for s in seqs:
            kv = torch.randn(2, cached + new, HKV, DIM, generator=g)
            pool.store_kv(0, kv[0], kv[1], pool.slots(s.pages, 0, cached + new))
            fresh.append(kv[:, cached:])
        self.kv = pool.view(0)
        self.q = torch.randn(self.batch.num_tokens, HQ, DIM, generator=g)
        self.k, self.v = torch.cat(fresh, dim=1).unbind(0)
        pairs = sum(sum(range(s - n + 1, s + 1)) for n, s in zip(self.batch.qo_lens, self.batch.seq_lens))
        self.macs = 2 * HQ * DIM * pairs  # QK^T and PV over the causal pattern
        self.impls = {}
        for name in ("cpu", "torch"):
            impl = get_backend(name, "cpu")
            impl.plan(self.batch)
            self.impls[name] = impl

    def call(self, name: str):
        return lambda: self.impls[name].forward(self.q, self.k, self.v, self.kv, DIM**-0.5)


CEILING = {"integer steps alone": 0, "with the float steps": 1}  # tile_ops's float_steps


def tile_ceiling(threads: int):
    """A call per ``CEILING`` label that times tile blocks without their weights' loads
    and decode (``tile_ceiling.c``) on ``threads`` threads for ~0.2 s and returns their G
    multiply-adds per second; None on a CPU without AVX2 and FMA."""
    source = Path(__file__).with_name("tile_ceiling.c")
    lib = ctypes.CDLL(str(build.build("tile_ceiling", source, weights.FLAGS, depends_on=(build.cpu_id(),))))
    lib.tile_ops.argtypes, lib.tile_ops.restype = [ctypes.c_long, ctypes.c_int, ctypes.c_int], ctypes.c_double
    if lib.tile_ops(1, 0, 1) < 0:
        return None
    macs_per_block = 192 * 16  # 12 multiply-adds a step x 16 steps, each on 8 lanes of 16-bit pairs
    iters = max(1, int(0.2 / max(lib.tile_ops(20000, 1, threads), 1e-9) * 20000))
    return {label: lambda f=float_steps: threads * iters * macs_per_block / lib.tile_ops(iters, f, threads) / 1e9
            for label, float_steps in CEILING.items()}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5, help="calls timed per round (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/out/bench_cpu_kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    extends = {label: Extend(*shape) for label, shape in EXTENDS.items()}
    for label, p in extends.items():  # the same answer before it is timed
        a, b = p.call("cpu")(), p.call("torch")()
        err = float((a - b).norm() / b.norm())
        if err > 1e-5:
            raise SystemExit(f"{label}: cpu and torch differ by {err:.1e}")

    n16, n8 = load_model(native=True), load_model(native=True, activation_bits=8)
    layer16, layer8 = n16.layers[0], n8.layers[0]
    products = {}
    g = torch.Generator().manual_seed(1)
    for name in ("qkv", "o", "gate_up", "down"):
        packed16, packed8 = getattr(layer16, name), getattr(layer8, name)
        x = torch.randn(PRODUCT_TOKENS, packed16.shape[1], generator=g)
        dense = packed16.rows()  # the same values in float32
        products[f"{name} {packed16.shape[0]}x{packed16.shape[1]}"] = {
            "macs": PRODUCT_TOKENS * packed16.shape[0] * packed16.shape[1],
            "calls": {"16-bit": lambda m=packed16, x=x: m.linear(x, dense=True),
                      "8-bit": lambda m=packed8, x=x: m.linear(x, dense=True),
                      "float32": lambda w=dense, x=x: F.linear(x, w)}}  # fmt: skip

    ceiling = tile_ceiling(args.threads)
    samples: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for label, rate in (ceiling or {}).items():  # in the same rounds as the products: the same drift
            samples.setdefault(("ceiling", label), []).append(rate())
        for label, p in extends.items():
            for name in ("cpu", "torch"):
                samples.setdefault(("extend", label, name), []).append(median_seconds(p.call(name), args.repeat))
        for label, prod in products.items():
            for name, fn in prod["calls"].items():
                samples.setdefault(("product", label, name), []).append(median_seconds(fn, args.repeat))
    med = {k: statistics.median(v) for k, v in samples.items()}

    rows = []
    print(f"{args.threads} threads, median of {args.rounds} interleaved rounds ({args.repeat} calls each)")
    print(f"\n{'extend attention':<26}{'kernel':>9}{'ms':>9}{'G MAC/s':>9}{'x torch':>9}")
    for label, p in extends.items():
        for name in ("cpu", "torch"):
            s = med[("extend", label, name)]
            ratio = med[("extend", label, "torch")] / s
            rows.append({"kind": "extend", "problem": label, "system": name, "ms": s * 1e3, "gmacs": p.macs / s / 1e9,
                         "x_peer": ratio})  # fmt: skip
            print(f"{label:<26}{name:>9}{s * 1e3:>9.2f}{p.macs / s / 1e9:>9.1f}{ratio:>9.2f}")
    print(f"\n{'products, ' + str(PRODUCT_TOKENS) + ' tokens':<26}{'codes':>9}{'ms':>9}{'G MAC/s':>9}{'x fp32':>9}")
    for label, prod in products.items():
        for name in prod["calls"]:
            s = med[("product", label, name)]
            ratio = med[("product", label, "float32")] / s
            rows.append({"kind": "product", "problem": label, "system": name, "ms": s * 1e3,
                         "gmacs": prod["macs"] / s / 1e9, "x_peer": ratio})  # fmt: skip
            print(f"{label:<26}{name:>9}{s * 1e3:>9.2f}{prod['macs'] / s / 1e9:>9.1f}{ratio:>9.2f}")
    if ceiling is None:
        print("\nno AVX2 and FMA: the products run their portable loops, no ceiling measured")
    else:
        top = med[("ceiling", "with the float steps")]
        print(f"\n{'ceiling of the tiles':<38}{'G MAC/s':>9}")
        for label in CEILING:
            rate = med[("ceiling", label)]
            print(f"{label:<38}{rate:>9.1f}")
            rows.append({"kind": "ceiling", "problem": "tile block, weights free", "system": label, "gmacs": rate})
        print(f"\n{'16-bit products':<26}{'G MAC/s':>9}{'% ceiling':>11}")
        for label, prod in products.items():
            rate = prod["macs"] / med[("product", label, "16-bit")] / 1e9
            print(f"{label:<26}{rate:>9.1f}{100 * rate / top:>10.0f}%")
            rows.append({"kind": "ceiling_share", "problem": label, "system": "16-bit", "gmacs": rate,
                         "of_ceiling": rate / top})  # fmt: skip
    write_result(args.json, rows, threads=args.threads, rounds=args.rounds, repeat=args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
