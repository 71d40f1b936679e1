"""Which activations of the embedded model can take 8-bit codes: the next-token KL against
float32 when the inputs of some of the products are rounded to 8 bits per block of 32.

The native model rounds every product's input to 16-bit codes per block of 32 (codes
within +-32767, the block's scale its largest magnitude over 32767); ``--activation-bits 8``
rounds them to +-127, as llama.cpp does, and runs the products up to twice as fast. This
applies the kernels' own rounding (``radixkv_round_activations``) to the float32 model's
product inputs (the same weights, expanded), block by block at 8 or 16 bits, so that any
mix can be tried without a kernel for it:

- every input at 16 bits, and every input at 8;
- 8 bits for one product's inputs (q/k/v, o, gate/up or down) and 16 for the rest;
- 8 bits for the blocks without an outlier (largest magnitude at most T times the block's
  RMS), 16 for the others (LLM.int8()'s idea, per block).

For each: the share of blocks at 8 bits, the mean and largest KL of the next-token
distribution against float32 over every position of the fidelity chats, and the share of
positions whose argmax agrees. The native model's stated bound is a KL of 1e-4 (tests).

    .venv/bin/python benchmarks/bench_act_rounding.py [--json benchmarks/out/bench_act_rounding.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import FIDELITY_CHATS, write_result  # noqa: E402
from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.kernels import get_backend  # noqa: E402
from radixkv.kernels.weights import ACTIVATION_CODES, load_library  # noqa: E402
from radixkv.model import llama, load_model  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402
from radixkv.model.chat_template import ChatTemplate  # noqa: E402
from radixkv.model.registry import resolve_model  # noqa: E402
from radixkv.model.tokenizer import Tokenizer  # noqa: E402

PRODUCTS = ("qkv", "o", "gate_up", "down")
OUTLIER_FACTORS = (2.5, 3.0, 4.0)


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [n, cols]`` (contiguous float32) with each block of 32 replaced by its rounding
    to ``bits``-bit codes, by the kernels' own rounding (``radixkv_round_activations``)."""
    out = torch.empty_like(x)
    load_library().radixkv_round_activations(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                                             ACTIVATION_CODES[bits], torch.get_num_threads())  # fmt: skip
    return out


class Rounding:
    """Patches the model's products (``llama._linear``) to round their inputs by
    ``rule(product, blocks, amax) -> eight``; counts the blocks."""

    def __init__(self, model):
        self.kind = {id(getattr(layer, p)): p for layer in model.layers for p in PRODUCTS}
        self.rule, self.blocks, self.eight = None, 0, 0
        self.plain = llama._linear

    def __call__(self, x, w, bias=None, dense=None):
        product = self.kind.get(id(w))
        if self.rule is None or product is None:  # the head, or no rounding
            return self.plain(x, w, bias, dense)
        x = x.contiguous()
        blocks = x.reshape(x.shape[0], -1, 32)
        eight = self.rule(product, blocks, blocks.abs().amax(-1, keepdim=True))
        self.blocks += eight.numel()
        self.eight += int(eight.sum())
        pick = torch.where(eight, rounded(x, 8).reshape(blocks.shape), rounded(x, 16).reshape(blocks.shape))
        return self.plain(pick.reshape(x.shape), w, bias, dense)


def logprobs(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=-(-len(ids) // 16)))
    batch = ForwardBatch.build([SeqInput(ids, 0, pool.alloc(-(-len(ids) // 16)))], 16)
    return torch.log_softmax(model.forward(batch, pool, get_backend("torch"), all_logits=True).double(), -1)


def rules() -> dict:
    never = lambda p, b, a: torch.zeros_like(a, dtype=torch.bool)  # noqa: E731
    always = lambda p, b, a: torch.ones_like(a, dtype=torch.bool)  # noqa: E731
    out = {"16 bits everywhere": never, "8 bits everywhere": always}
    for product in PRODUCTS:
        out[f"8 bits for {product} only"] = lambda p, b, a, only=product: (always if p == only else never)(p, b, a)
    for t in OUTLIER_FACTORS:
        out[f"8 bits where max <= {t} x RMS"] = lambda p, b, a, t=t: a <= t * b.pow(2).mean(-1, keepdim=True).sqrt()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_act_rounding.json")
    args = ap.parse_args()
    source = resolve_model()
    tok = Tokenizer.load(source)
    template = ChatTemplate.from_tokenizer(tok)
    prompts = [template.encode(tok, chat, add_generation_prompt=True) for chat in FIDELITY_CHATS]
    model = load_model(source.path, native=False)  # float32, the GGUF's weights expanded
    patch = Rounding(model)
    llama._linear = patch
    try:
        patch.rule = None
        reference = [logprobs(model, ids) for ids in prompts]
        rows = []
        print(f"{len(prompts)} chats, {sum(map(len, prompts))} positions; KL of the next-token distribution "
              f"against float32\n")  # fmt: skip
        print(f"{'inputs':<34}{'8-bit blocks':>13}{'KL mean':>10}{'KL max':>10}{'top-1 same':>12}")
        with torch.inference_mode():
            for name, rule in rules().items():
                patch.rule, patch.blocks, patch.eight = rule, 0, 0
                kls, same = [], []
                for ids, p in zip(prompts, reference):
                    r = logprobs(model, ids)
                    kls.append((p.exp() * (p - r)).sum(-1))
                    same.append(p.argmax(-1) == r.argmax(-1))
                kl, agree = torch.cat(kls), torch.cat(same).double().mean()
                share = patch.eight / patch.blocks
                rows.append({"inputs": name, "eight_bit_blocks": share, "kl_mean": float(kl.mean()),
                             "kl_max": float(kl.max()), "top1_same": float(agree)})  # fmt: skip
                print(f"{name:<34}{100 * share:>12.1f}%{float(kl.mean()):>10.1e}{float(kl.max()):>10.1e}"
                      f"{100 * float(agree):>11.1f}%")  # fmt: skip
    finally:
        llama._linear = patch.plain
    write_result(args.json, rows, chats=len(prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
