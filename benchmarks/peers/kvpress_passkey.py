"""Passkey retrieval under kvpress's presses: the peer column of bench_longctx.py's
``passkey`` part.

The same prompts as that part (``longctx_data.passkey_parts``: a 5-digit key at 10 / 50
/ 90% depth of a haystack of about L tokens, the keys of ``passkey_keys(n, seed=1)``):
the haystack (and a newline) is the context, prefilled with the press compressing it to
the kept fraction (kvpress's pipeline: the context is compressed, the question is not);
then the question and "The pass key is" are read over the compressed cache, positions
continuing from the context's end, and 8 tokens are generated greedily. Correct when
the first run of digits is the key. ``none`` is the full cache.

Runs in .peers/kvpress-venv (``bash benchmarks/peers/setup_kvpress.sh``); the SmolLM2
GGUF radixkv serves, dequantized to float32, CPU; presses as ``kvpress_ppl.py``.

    .peers/kvpress-venv/bin/python benchmarks/peers/kvpress_passkey.py [--lengths 2048 4096]
        [--keys 2] [--kept 0.25] [--presses none streaming window snapkv h2o keydiff]
        [--out benchmarks/out/kvpress_passkey.json] [--resume]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import transformers
from transformers import AutoTokenizer, DynamicCache

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from kvpress_ppl import PRESSES, find_gguf, load_model  # noqa: E402
from longctx_data import passkey_correct, passkey_keys, passkey_parts  # noqa: E402

import kvpress  # noqa: E402


@torch.inference_mode()
def answer(model, press, context: list[int], question: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``context`` (compressed by ``press`` in its prefill) and
    ``question``; returns (tokens, wall s)."""
    t0 = time.perf_counter()
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=torch.tensor([context]), past_key_values=cache)
    pos = len(context)
    ids = torch.tensor([question])
    out = model(input_ids=ids, past_key_values=cache, position_ids=torch.arange(pos, pos + len(question))[None])
    pos += len(question)
    token = int(out.logits[0, -1].argmax())
    generated = [token]
    while len(generated) < new_tokens:
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
        pos += 1
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
    return generated, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--keys", type=int, default=2)
    ap.add_argument("--kept", type=float, default=0.25)
    ap.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=HERE.parents[1] / "benchmarks/out/kvpress_passkey.json")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out, run the rest")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()

    gguf = args.gguf or find_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    count = lambda text: len(encode(text))  # noqa: E731
    keys = passkey_keys(args.keys, seed=1)
    rows: list[dict] = []
    if args.resume and args.out.is_file():
        rows = json.loads(args.out.read_text())["rows"]
    done = {(r["length"], r["depth"], r["key"], r["policy"]) for r in rows}
    result = {"benchmark": "kvpress_passkey", "model": str(gguf), "kept": args.kept, "new_tokens": args.new_tokens,
              "keys": keys, "threads": torch.get_num_threads(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "kvpress": getattr(kvpress, "__version__", "?")},
              "rows": rows}  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    models = {}
    for length in args.lengths:
        for depth in args.depths:
            for key in keys:
                parts = passkey_parts(length, depth, key, count)
                context = encode(parts["haystack"] + "\n")
                question = encode(parts["question"] + " " + parts["answer_prefix"])
                for name in args.presses:
                    if (length, depth, key, name) in done:
                        continue
                    make, attn = PRESSES[name]
                    if attn not in models:  # one model per attention implementation (a load is ~20 s)
                        models[attn] = load_model(gguf, attn)
                    model = models[attn]
                    press = None if make is None else make(1.0 - args.kept)
                    gen, wall = answer(model, press, context, question, args.new_tokens)
                    text = tok.decode(gen, skip_special_tokens=True)
                    rows.append({"length": length, "tokens": len(context) + len(question), "depth": depth, "key": key,
                                 "policy": name, "correct": passkey_correct(text, key), "text": text,
                                 "wall_s": wall})  # fmt: skip
                    save()
                    print(f"{length} {depth} {key} {name:9s} {rows[-1]['correct']!s:5s} {text!r} {wall:.1f}s", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
