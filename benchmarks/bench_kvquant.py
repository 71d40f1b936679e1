"""KV format quality gate: what storing the KV cache in fewer bits costs the model.

For each KV format, the embedded SmolLM2 (float32 weights) reads natural text (the
licence texts every Debian image ships: GPL-3, then GFDL-1.3 when a context needs more)
at 2k and 8k context, prefilled in chunks of 512 tokens through a pool of that format,
so every chunk attends to the earlier ones as the pool stored them. Against the fp32
cache, run in lockstep on the same chunks:

- perplexity of the text and its change (%);
- KL divergence of the next-token distributions, KL(fp32 || format): mean and p99;
- top-1 agreement (the argmax token equal);
- on chat prompts, the first position where greedy generation (64 tokens) differs from
  the fp32 cache's (none: equal throughout).

Peer in the same run, when installed (``bash benchmarks/peers/setup_llamacpp.sh``):
llama.cpp through llama-cpp-python on the same GGUF, with its q8_0 and q4_0 K/V cache
types (flash attention on, which quantized V needs), KL and top-1 against its own f16
cache on the same tokens, at 2k by default (``--peer-contexts``). llama.cpp runs the
GGUF's own quantized weights, so its figures compare cache types within llama.cpp, as
radixkv's do within radixkv.

    .venv/bin/python benchmarks/bench_kvquant.py [--contexts 2048 8192] [--formats bf16 fp16 int8]
        [--peer-contexts 2048] [--json benchmarks/out/bench_kvquant.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.sampling import SamplingParams  # noqa: E402
from radixkv.kernels import get_backend  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402
from radixkv.model.loader import load_model  # noqa: E402
from radixkv.model.tokenizer import Tokenizer  # noqa: E402
from radixkv.workloads.bench import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/GFDL-1.3")]
PAGE, CHUNK = 16, 512
LLAMA_PY = ROOT / ".peers" / "llamacpp-venv" / "bin" / "python"
CHATS = [
    "Explain in two sentences why the sky is blue.", "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.", "What is the difference between a list and a tuple in Python?",
]  # fmt: skip
TARGETS = {"int8": {"ppl_change_pct": 0.25, "kl_mean": 1.5e-3, "top1": 0.98}}


def text_ids(tokenizer, count: int) -> list[int]:
    ids: list[int] = []
    for path in TEXTS:
        ids += tokenizer.encode(path.read_text(), add_special_tokens=False)
        if len(ids) >= count:
            return ids[:count]
    raise SystemExit(f"the licence texts hold only {len(ids)} tokens, fewer than {count}")


def lockstep(model, ids: list[int], formats: list[str]) -> dict:
    """Chunked prefill of ``ids`` through an fp32 pool and one pool per format, chunk by
    chunk; per format the metrics against fp32 (and fp32's own perplexity)."""
    c = model.config
    pages = -(-len(ids) // PAGE)
    backend = get_backend("torch")
    pools = {f: KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, PAGE, kv_dtype=f, num_pages=pages))
             for f in ["fp32", *formats]}  # fmt: skip
    tables = {f: p.alloc(pages) for f, p in pools.items()}
    nll = {f: [] for f in pools}
    kl = {f: [] for f in formats}
    top1 = {f: [] for f in formats}
    targets = torch.tensor(ids[1:] + [0])
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            logp = {}
            for f, pool in pools.items():
                batch = ForwardBatch.build([SeqInput(chunk, start, tables[f])], PAGE, "cpu")
                logp[f] = torch.log_softmax(model.forward(batch, pool, backend, all_logits=True).double(), -1)
            n = len(chunk) - (start + len(chunk) == len(ids))  # the last token predicts nothing
            tgt = targets[start : start + n]
            for f in pools:
                nll[f].append(-logp[f][:n].gather(1, tgt[:, None])[:, 0])
            ref = logp["fp32"][:n]
            for f in formats:
                kl[f].append((ref.exp() * (ref - logp[f][:n])).sum(-1))
                top1[f].append(ref.argmax(-1) == logp[f][:n].argmax(-1))
    ppl = {f: float(torch.cat(v).mean().exp()) for f, v in nll.items()}
    out = {"fp32": {"ppl": ppl["fp32"]}}
    for f in formats:
        k = torch.cat(kl[f]).numpy()
        out[f] = {
            "ppl": ppl[f], "ppl_change_pct": 100 * (ppl[f] / ppl["fp32"] - 1),
            "kl_mean": float(k.mean()), "kl_p99": float(np.quantile(k, 0.99)),
            "top1": float(torch.cat(top1[f]).double().mean()),
        }  # fmt: skip
    return out


def first_divergence(formats: list[str], new_tokens: int = 64) -> dict:
    """Per format, the first greedy position (of ``new_tokens``) on each chat prompt
    where its tokens differ from the fp32 cache's (None: no difference)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = {}
    for f in ["fp32", *formats]:
        with Engine(kv_dtype=f, kv_cache_tokens=8192, attention_backend="torch") as e:
            prompts = [e.render_chat([{"role": "user", "content": q}]) for q in CHATS]
            outs[f] = [o.token_ids for o in e.generate(prompts, [greedy] * len(prompts))]
    result = {}
    for f in formats:
        firsts = []
        for a, b in zip(outs["fp32"], outs[f]):
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            firsts.append(diff[0] if diff else None)
        result[f] = firsts
    return result


LLAMA_SCRIPT = r"""
import json, sys, numpy as np, llama_cpp
path, ids, types = sys.argv[1], json.loads(sys.stdin.read()), sys.argv[2].split(",")
codes = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
def logprobs(kind):
    llm = llama_cpp.Llama(path, n_ctx=len(ids) + 8, n_batch=512, n_ubatch=512, logits_all=True, verbose=False,
                          type_k=codes[kind], type_v=codes[kind], flash_attn=True, n_threads=2)
    llm.eval(ids)
    s = np.array(llm.scores[: len(ids)], dtype=np.float32)  # float32: 8k x 49k logits are 1.6 GB already
    del llm
    s -= s.max(-1, keepdims=True)
    s -= np.log(np.exp(s).sum(-1, keepdims=True))
    return s
ref = logprobs("f16")
types = ["f16", *types]  # f16 again: the noise floor of two runs of the same cache type
tgt = np.asarray(ids[1:])
def ppl(lp): return float(np.exp(-lp[np.arange(len(tgt)), tgt].mean()))
out = {"f16 (ref)": {"ppl": ppl(ref[:-1])}}
for kind in types:
    lp = logprobs(kind)
    kl = np.einsum("ij,ij->i", np.exp(ref), ref - lp)[:-1].astype(np.float64)
    out[kind] = {"ppl": ppl(lp[:-1]), "ppl_change_pct": 100 * (ppl(lp[:-1]) / out["f16 (ref)"]["ppl"] - 1),
                 "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
                 "top1": float((ref.argmax(-1) == lp.argmax(-1))[:-1].mean())}
print(json.dumps({"version": llama_cpp.__version__, "rows": out}))
"""


def llama_cpp_peer(ids: list[int]) -> dict | str:
    """llama.cpp's f16 / q8_0 / q4_0 caches on ``ids``, or why it did not run."""
    if not LLAMA_PY.exists():
        return "not installed (bash benchmarks/peers/setup_llamacpp.sh)"
    run = subprocess.run([str(LLAMA_PY), "-c", LLAMA_SCRIPT, str(resolve_model().path), "q8_0,q4_0"],
                         input=json.dumps(ids), capture_output=True, text=True, timeout=3600)  # fmt: skip
    if run.returncode != 0:
        return f"failed: {run.stderr.strip().splitlines()[-1:] or run.returncode}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp16", "int8"])
    ap.add_argument("--peer-contexts", type=int, nargs="*", default=[2048],
                    help="contexts llama.cpp runs at (default 2048: its quantized-cache attention on this CPU "
                         "takes minutes per run already there); none: skip it")  # fmt: skip
    ap.add_argument("--json", default="benchmarks/out/bench_kvquant.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    src = resolve_model()
    model = load_model(src.path, "float32", "cpu")
    tokenizer = Tokenizer.load(src)
    rows = {}
    for ctx in args.contexts:
        ids = text_ids(tokenizer, ctx)
        t0 = time.perf_counter()
        row = {"radixkv": lockstep(model, ids, args.formats)}
        row["radixkv_seconds"] = time.perf_counter() - t0
        print(f"{ctx}: radixkv done in {row['radixkv_seconds']:.0f} s", flush=True)
        if ctx in args.peer_contexts:
            t0 = time.perf_counter()
            row["llama_cpp"] = llama_cpp_peer(ids)
            row["llama_cpp_seconds"] = time.perf_counter() - t0
            print(f"{ctx}: llama.cpp done in {row['llama_cpp_seconds']:.0f} s", flush=True)
        rows[str(ctx)] = row
    rows["first_greedy_divergence"] = first_divergence(args.formats)
    print_table(rows, args)
    write_result(args.json, rows, text=[p.name for p in TEXTS], chunk=CHUNK, page_size=PAGE, targets=TARGETS)


def print_table(rows: dict, args) -> None:
    print("SmolLM2-135M float32 weights; KV formats against the fp32 cache (llama.cpp: against its f16 cache)")
    head = f"{'context':>8} {'system':<10}{'cache':<7}{'ppl':>9}{'change %':>10}{'KL mean':>11}{'KL p99':>11}{'top-1 %':>9}"
    print(head)
    print("-" * len(head))
    for ctx in args.contexts:
        row = rows[str(ctx)]
        for system, res in (("radixkv", row["radixkv"]), ("llama.cpp", row.get("llama_cpp"))):
            if isinstance(res, str) or res is None:
                if res:
                    print(f"{ctx:>8} {system:<10}{res}")
                continue
            res = res.get("rows", res)
            for kind, m in res.items():
                if "kl_mean" not in m:
                    print(f"{ctx:>8} {system:<10}{kind:<7}{m['ppl']:>9.3f}{'(ref)':>10}")
                    continue
                print(f"{ctx:>8} {system:<10}{kind:<7}{m['ppl']:>9.3f}{m['ppl_change_pct']:>10.3f}"
                      f"{m['kl_mean']:>11.2e}{m['kl_p99']:>11.2e}{100 * m['top1']:>9.2f}")  # fmt: skip
    print(f"\nfirst greedy divergence from the fp32 cache ({len(CHATS)} chat prompts, 64 tokens; None: none):")
    for f, firsts in rows["first_greedy_divergence"].items():
        print(f"  {f:<6}{firsts}")
    print(f"\ntargets (int8): ppl change <= {TARGETS['int8']['ppl_change_pct']}%, KL mean <= "
          f"{TARGETS['int8']['kl_mean']}, top-1 >= {100 * TARGETS['int8']['top1']}%, KL no worse than llama.cpp q8_0")


if __name__ == "__main__":
    main()
