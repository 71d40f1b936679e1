"""What observing attention mass costs a decode step on the CPU backend.

H2O-style bookkeeping: every decode row of a batch observed (``SeqInput.observe_from=0``),
so each layer's C kernel also adds its rows' probabilities per KV entry, summed over
query heads, into ``backend.mass``. Same setup as ``bench_kvquant.py --decode-speed``
(its ``filled_pools``): one pool per format with the embedded model's KV shape (30
layers, 3 KV heads of 64; 9 query heads), ``--batch`` sequences of ``--context`` tokens
of random K/V over pages of 16 scattered over the pool. Timed, without and with
observing alternating step by step (and the formats too), ``--repeats`` times each after
a warm-up, median reported:

- attention: ``plan`` plus the 30 layers' ``forward`` of one decode step;
- model step: the real weights' whole decode step (``model.forward``) and its argmax.

Target: observing adds at most 5% to a model step.

    .venv/bin/python benchmarks/bench_mass.py [--formats fp32 int8] [--batch 16] [--context 4096]
        [--repeats 9] [--json benchmarks/out/bench_mass.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_kvquant import PAGE, filled_pools, timed  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from radixkv.kernels import get_backend  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402
from radixkv.model.loader import load_model  # noqa: E402

TARGET = 0.05  # observing's share of a model decode step, at most


def measure(model, formats: list[str], batch: int, context: int, repeats: int) -> dict:
    """Seconds of attention and of a model step per format, without and with every
    decode row observed, the settings alternating; see the module docstring."""
    c = model.config
    load_before = os.getloadavg()[0]
    pools, seqs = filled_pools(c, formats, batch, context)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, c.num_heads, c.head_dim, generator=g)
    k_new = torch.randn(batch, c.num_kv_heads, c.head_dim, generator=g)
    v_new = torch.randn(batch, c.num_kv_heads, c.head_dim, generator=g)
    ids = torch.randint(0, c.vocab_size, (batch,), generator=g).tolist()
    batches = {  # observed or not -> (attention's batch, the model's batch)
        seen: tuple(
            ForwardBatch.build([SeqInput([t], s.num_cached, s.pages, observe_from=0 if seen else None)
                                for t, s in zip(tokens, seqs)], PAGE, "cpu")
            for tokens in ([0] * batch, ids)
        )
        for seen in (False, True)
    }  # fmt: skip
    backend = get_backend("cpu")
    scale = c.head_dim**-0.5

    def attention(key) -> None:
        f, seen = key
        backend.plan(batches[seen][0])
        for layer in range(c.num_layers):
            backend.forward(q, k_new, v_new, pools[f].view(layer), scale, c.sliding_window)

    def model_step(key) -> None:
        f, seen = key
        model.forward(batches[seen][1], pools[f], backend).argmax(-1)
        assert len(backend.mass) == (batch if seen else 0)

    keys = [(f, seen) for f in formats for seen in (False, True)]
    with torch.inference_mode():
        attn = timed(attention, keys, repeats)
        step = timed(model_step, keys, repeats)
    rows = {"shape": {"layers": c.num_layers, "q_heads": c.num_heads, "kv_heads": c.num_kv_heads,
                      "head_dim": c.head_dim, "batch": batch, "context": context, "page_size": PAGE},
            "load_average_1min": [load_before, os.getloadavg()[0]], "formats": {}}  # fmt: skip
    for f in formats:
        row = {}
        for name, times in (("attention", attn), ("model_step", step)):
            off, on = times[(f, False)], times[(f, True)]
            row[name] = {"off": off, "observed": on, "ratio": on["median_s"] / off["median_s"]}
        step_off = step[(f, False)]["median_s"]
        row["attention_added_over_model_step"] = (attn[(f, True)]["median_s"] - attn[(f, False)]["median_s"]) / step_off
        rows["formats"][f] = row
    return rows


def print_table(rows: dict) -> None:
    sh = rows["shape"]
    print(f"\nattention mass, cpu backend, {torch.get_num_threads()} threads: batch {sh['batch']} x {sh['context']}-token "
          f"contexts, every row observed; {sh['layers']} layers, {sh['q_heads']} query / {sh['kv_heads']} KV heads of "
          f"{sh['head_dim']}, pages of {sh['page_size']}; ms, median of the alternating runs (min)")  # fmt: skip
    head = (f"{'format':<8}{'attn off':>16}{'attn on':>16}{'ratio':>7}{'step off':>16}{'step on':>16}{'ratio':>7}"
            f"{'attn +% step':>14}")  # fmt: skip
    print(head)
    print("-" * len(head))

    def ms(t):
        return f"{t['median_s'] * 1e3:>9.1f} ({t['min_s'] * 1e3:>4.0f})"

    for f, row in rows["formats"].items():
        a, m = row["attention"], row["model_step"]
        print(f"{f:<8}{ms(a['off'])}{ms(a['observed'])}{a['ratio']:>7.3f}{ms(m['off'])}{ms(m['observed'])}"
              f"{m['ratio']:>7.3f}{row['attention_added_over_model_step'] * 100:>13.1f}%")  # fmt: skip
    print(f"\ntarget: observing adds <= {TARGET:.0%} to a model step ('attn +% step': the attention calls' added "
          f"time over the unobserved model step); 1-minute load average before and after: "
          f"{rows['load_average_1min'][0]:.2f}, {rows['load_average_1min'][1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default="benchmarks/out/bench_mass.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = load_model(resolve_model().path, "float32", "cpu")
    rows = measure(model, args.formats, args.batch, args.context, args.repeats)
    print_table(rows)
    write_result(args.json, rows, threads=torch.get_num_threads(), page_size=PAGE, target_overhead=TARGET)


if __name__ == "__main__":
    main()
