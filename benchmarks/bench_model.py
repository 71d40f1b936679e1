"""Model forward benchmark: prefill and batched decode, radixkv vs HF transformers.

Both run the embedded SmolLM2-135M-Instruct (the same GGUF, dequantized to float32) on
the CPU, in the same process, one after the other:

- prefill: one 512-token prompt, logits for its last token only (transformers gets
  ``logits_to_keep=1`` too, as its ``generate`` does);
- decode: 16 sequences with 128-token prompts, then 32 greedy steps of one token each,
  radixkv through its paged pool, transformers through its KV cache.

radixkv uses the attention backend ``auto`` picks (on a CPU with a C compiler: ``cpu``);
``--attention-backend torch`` measures the reference backend instead.

    .venv/bin/python benchmarks/bench_model.py [--attention-backend auto] [--json benchmarks/out/bench_model.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (median_seconds, paged_decode_seconds, transformers_decode_seconds,  # noqa: E402
                               write_result)
from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402
from radixkv.kernels import get_backend  # noqa: E402
from radixkv.model import load_model, resolve_model  # noqa: E402

PREFILL = 512
BATCH, CONTEXT, STEPS = 16, 128, 32
TARGETS = {"prefill_tok_s": 600, "decode_tok_s": 130}


def bench_radixkv(prompt, prompts, repeat, backend):
    model = load_model()
    c = model.config
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=4096))
    table = pool.alloc(-(-PREFILL // 16))
    prefill = median_seconds(lambda: model.forward(ForwardBatch.build([SeqInput(prompt, 0, table)], 16), pool, backend),
                             repeat)  # fmt: skip

    def decode():
        return paged_decode_seconds(model, pool, backend, prompts, STEPS)

    decode()
    step_time = statistics.median(decode() for _ in range(repeat))
    return prefill, step_time


def bench_transformers(prompt, prompts, repeat):
    import transformers

    src = resolve_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src.path.parent, gguf_file=src.path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        prefill = median_seconds(lambda: model(ids, logits_to_keep=1), repeat)

        def decode():
            return transformers_decode_seconds(model, prompts, STEPS)

        decode()
        step_time = statistics.median(decode() for _ in range(repeat))
    return prefill, step_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_model.json")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto", help="radixkv's attention backend: auto, cpu or torch")
    args = ap.parse_args()
    backend = get_backend(args.attention_backend)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 49152, PREFILL).tolist()
    prompts = rng.integers(0, 49152, (BATCH, CONTEXT)).tolist()

    rows = {}
    runs = {
        "radixkv": lambda: bench_radixkv(prompt, prompts, args.repeat, backend),
        "transformers": lambda: bench_transformers(prompt, prompts, args.repeat),
    }
    for name, run in runs.items():
        prefill, decode = run()
        rows[name] = {"prefill_tok_s": PREFILL / prefill, "decode_tok_s": BATCH * STEPS / decode}

    print(f"SmolLM2-135M float32, CPU ({torch.get_num_threads()} threads), radixkv attention backend "
          f"{backend.name}, median of {args.repeat}")  # fmt: skip
    print(f"{'system':<14}{'prefill 512 tok/s':>19}{'decode b16 tok/s':>18}")
    for name, r in rows.items():
        print(f"{name:<14}{r['prefill_tok_s']:>19.0f}{r['decode_tok_s']:>18.1f}")
    print(f"{'target':<14}{TARGETS['prefill_tok_s']:>19}{TARGETS['decode_tok_s']:>18}")
    ours, theirs = rows["radixkv"], rows["transformers"]
    print(f"{'ratio':<14}{ours['prefill_tok_s'] / theirs['prefill_tok_s']:>18.2f}x"
          f"{ours['decode_tok_s'] / theirs['decode_tok_s']:>17.2f}x")  # fmt: skip

    write_result(
        args.json, rows, torch=torch.__version__, threads=torch.get_num_threads(), backend=backend.name, prefill_tokens=PREFILL,
        decode={"batch": BATCH, "context": CONTEXT, "steps": STEPS}, targets=TARGETS,
    )  # fmt: skip

if __name__ == "__main__":
    main()
