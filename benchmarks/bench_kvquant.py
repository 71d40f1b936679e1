"""KV format quality gate: what storing the KV cache in fewer bits costs the model.

For each KV format, the embedded SmolLM2 (float32 weights) reads natural text (the
licence texts every Debian image ships: GPL-3, then GFDL-1.3 when a context needs more)
at 2k and 8k context, prefilled in chunks of 512 tokens through a pool of that format,
so every chunk attends to the earlier ones as the pool stored them. A format spec is
``NAME[@PAGE][+cal]``: ``int4@64`` is int4 over pages of 64 tokens (its K groups; 16
otherwise), ``fp8_e4m3`` runs with unity scales and ``fp8_e4m3+cal`` with scales
measured on another text (Apache-2.0). Against the fp32 cache, run in lockstep on the
same chunks:

- perplexity of the text and its change (%);
- KL divergence of the next-token distributions, KL(fp32 || format): mean and p99;
- top-1 agreement (the argmax token equal);
- on chat prompts, the first position where greedy generation (64 tokens) differs from
  the fp32 cache's (none: equal throughout).

Peer in the same run, when installed (``bash benchmarks/peers/setup_llamacpp.sh``):
llama.cpp through llama-cpp-python on the same GGUF, with its q8_0, q4_0 and q4_1 K/V
cache types (flash attention on, which quantized V needs), KL and top-1 against its own f16
cache on the same tokens, at 2k by default (``--peer-contexts``). llama.cpp runs the
GGUF's own quantized weights, so its figures compare cache types within llama.cpp, as
radixkv's do within radixkv.

    .venv/bin/python benchmarks/bench_kvquant.py [--contexts 2048 8192] [--formats bf16 int8 int4@64 ...] [--backend torch|cpu]
        [--peer-contexts 2048] [--json benchmarks/out/bench_kvquant.json]

Decode speed (``--decode-speed``, instead of the above): what a format costs per decode
step on the CPU backend. One ``KVPool`` per format with the embedded model's KV shape
(30 layers, 3 KV heads of 64; 9 query heads), pages of 16 scattered over the pool, holds
``--speed-batch`` sequences of ``--speed-context`` tokens of random K/V (the same values
in every pool; attention's cost does not depend on them). Timed, the formats alternating
step by step, ``--speed-repeats`` times each after a warm-up, median reported:

- attention only: ``plan`` plus the 30 layers' ``forward`` of one decode step (one new
  token per sequence), as the model calls them;
- model step: the real weights' whole decode step (``model.forward``: embeddings, 30
  layers with the store of the new K/V, attention, MLP, logits) and the argmax over the
  logits. Prefilling 16 real 4k prompts through the engine would take most of an hour
  here, so the context is the same random K/V; only the new token's K/V is the model's.

The int8 and int4 rows on the torch reference path (gather, dequantize, SDPA; what the
CPU backend did with them before its kernel read their pages) are timed once beside them.
An int4 pool holds each sequence's last page staged, as serving leaves it; its model step
writes the new token at that page's last slot, so it also seals every sequence's page
(quantize on seal), which serving does for one step in 16. Target: int8 >= 1.3x fp32
tokens/s.

    .venv/bin/python benchmarks/bench_kvquant.py --decode-speed [--speed-formats fp32 int8 int4]
        [--speed-batch 16] [--speed-context 4096] [--speed-repeats 7] [--json benchmarks/out/bench_kvquant_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.cache.formats import UNITY, kv_format, load_kv_scales  # noqa: E402
from radixkv.model.kv_scales import calibrate  # noqa: E402
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
TARGETS = {"int8": {"ppl_change_pct": 0.25, "kl_mean": 1.5e-3, "top1": 0.98}, "int4": {"ppl_change_pct": 1.0},
           "int4@64": {"ppl_change_pct": 2.5}}  # fmt: skip
DEFAULT_FORMATS = ["bf16", "fp16", "int8", "int4", "int4@64", "int4_norot", "int4_norot@64", "fp8_e4m3",
                   "fp8_e4m3+cal", "fp8_e5m2+cal"]  # fmt: skip
CALIBRATION_TEXT = Path("/usr/share/common-licenses/Apache-2.0")  # fp8 scales are measured on other text
# bits per element of a cache type: radixkv's by bytes_per_page, llama.cpp's by its block layout
LLAMA_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0}
SPEED_TARGET = 1.3  # int8 decode tokens/s over fp32's, batch 16 at 4k context


def text_ids(tokenizer, count: int) -> list[int]:
    ids: list[int] = []
    for path in TEXTS:
        ids += tokenizer.encode(path.read_text(), add_special_tokens=False)
        if len(ids) >= count:
            return ids[:count]
    raise SystemExit(f"the licence texts hold only {len(ids)} tokens, fewer than {count}")


def parse_spec(spec: str) -> tuple[str, int, str | None]:
    """A format spec: ``NAME[@PAGE][+cal]`` -> (format, page size, kv_scales). fp8 takes
    ``unity`` scales, or with ``+cal`` scales measured on ``CALIBRATION_TEXT`` (another
    text than the one scored)."""
    name, _, cal = spec.partition("+")
    name, _, page = name.partition("@")
    scales = None
    if name.startswith("fp8"):
        scales = str(calibrated_scales(name)) if cal == "cal" else UNITY
    return name, int(page or PAGE), scales


_CALIBRATED: dict[str, Path] = {}


def calibrated_scales(fmt: str) -> Path:
    """A scale file for ``fmt`` measured (``radixkv.model.kv_scales.calibrate``) on 2048
    tokens of ``CALIBRATION_TEXT``, written once per run."""
    if fmt not in _CALIBRATED:
        src = resolve_model()
        ids = Tokenizer.load(src).encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)[:2048]
        path = Path(tempfile.mkdtemp()) / f"{fmt}.json"
        path.write_text(json.dumps(calibrate(load_model(src.path, "float32", "cpu"), ids, fmt)))
        _CALIBRATED[fmt] = path
    return _CALIBRATED[fmt]


def lockstep(model, ids: list[int], formats: list[str], backend_name: str = "torch") -> dict:
    """Chunked prefill of ``ids`` through an fp32 pool and one pool per format spec
    (``parse_spec``), chunk by chunk, on one attention backend; per format the metrics
    against fp32 (and fp32's own perplexity)."""
    c = model.config
    backend = get_backend(backend_name)
    pools = {}
    for f in ["fp32", *formats]:
        name, page, scales = parse_spec(f)
        kv_scales = load_kv_scales(scales, c.num_layers, c.num_kv_heads, name) if scales else None
        pools[f] = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, page, kv_dtype=name,
                                     num_pages=-(-len(ids) // page), kv_scales=kv_scales))  # fmt: skip
    tables = {f: p.alloc(p.num_pages) for f, p in pools.items()}
    nll = {f: [] for f in pools}
    kl = {f: [] for f in formats}
    top1 = {f: [] for f in formats}
    targets = torch.tensor(ids[1:] + [0])
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            logp = {}
            for f, pool in pools.items():
                batch = ForwardBatch.build([SeqInput(chunk, start, tables[f])], pool.page_size, "cpu")
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


def first_divergence(formats: list[str], new_tokens: int = 64, backend_name: str = "torch") -> dict:
    """Per format, the first greedy position (of ``new_tokens``) on each chat prompt
    where its tokens differ from the fp32 cache's (None: no difference)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = {}
    for f in ["fp32", *formats]:
        name, page, scales = parse_spec(f)
        with Engine(kv_dtype=name, kv_scales=scales, page_size=page, kv_cache_tokens=8192, attention_backend=backend_name) as e:
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
codes = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0,
         "q4_1": llama_cpp.GGML_TYPE_Q4_1}
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
    """llama.cpp's f16 / q8_0 / q4_0 / q4_1 caches on ``ids``, or why it did not run."""
    if not LLAMA_PY.exists():
        return "not installed (bash benchmarks/peers/setup_llamacpp.sh)"
    run = subprocess.run([str(LLAMA_PY), "-c", LLAMA_SCRIPT, str(resolve_model().path), "q8_0,q4_0,q4_1"],
                         input=json.dumps(ids), capture_output=True, text=True, timeout=3600)  # fmt: skip
    if run.returncode != 0:
        return f"failed: {run.stderr.strip().splitlines()[-1:] or run.returncode}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS,
                    help="format specs NAME[@PAGE][+cal] (default %(default)s); fp8 without +cal: unity scales")
    ap.add_argument("--peer-contexts", type=int, nargs="*", default=[2048],
                    help="contexts llama.cpp runs at (default 2048: its quantized-cache attention on this CPU "
                         "takes minutes per run already there); none: skip it")  # fmt: skip
    ap.add_argument("--json", default=None,
                    help="default benchmarks/out/bench_kvquant.json, or bench_kvquant_decode.json with --decode-speed")
    ap.add_argument("--backend", default="torch", choices=["torch", "cpu"],
                    help="attention backend of the quality gate (default torch: the reference, which "
                         "dequantizes; cpu: the C kernels' own arithmetic, e.g. bf16 products on bf16 pages "
                         "where the CPU has them)")  # fmt: skip
    ap.add_argument("--decode-speed", action="store_true",
                    help="time decode steps per KV format on the CPU backend instead of the quality gate")
    ap.add_argument("--speed-formats", nargs="+", default=["fp32", "int8"])
    ap.add_argument("--speed-batch", type=int, default=16)
    ap.add_argument("--speed-context", type=int, default=4096)
    ap.add_argument("--speed-repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    src = resolve_model()
    model = load_model(src.path, "float32", "cpu")
    if args.decode_speed:
        rows = decode_speed(model, args.speed_formats, args.speed_batch, args.speed_context, args.speed_repeats)
        print_speed_table(rows)
        write_result(args.json or "benchmarks/out/bench_kvquant_decode.json", rows, threads=torch.get_num_threads(),
                     page_size=PAGE, target_int8_over_fp32=SPEED_TARGET)  # fmt: skip
        return
    args.json = args.json or "benchmarks/out/bench_kvquant.json"
    tokenizer = Tokenizer.load(src)
    rows = {}
    for ctx in args.contexts:
        ids = text_ids(tokenizer, ctx)
        t0 = time.perf_counter()
        row = {"radixkv": lockstep(model, ids, args.formats, args.backend)}
        row["radixkv_seconds"] = time.perf_counter() - t0
        print(f"{ctx}: radixkv done in {row['radixkv_seconds']:.0f} s", flush=True)
        if ctx in args.peer_contexts:
            t0 = time.perf_counter()
            row["llama_cpp"] = llama_cpp_peer(ids)
            row["llama_cpp_seconds"] = time.perf_counter() - t0
            print(f"{ctx}: llama.cpp done in {row['llama_cpp_seconds']:.0f} s", flush=True)
        rows[str(ctx)] = row
    rows["first_greedy_divergence"] = first_divergence(args.formats, backend_name=args.backend)
    rows["bits_per_element"] = {f: bits_per_element(model.config, f) for f in ["fp32", *args.formats]}
    rows["llama_cpp_bits_per_element"] = LLAMA_BITS
    print_table(rows, args)
    write_result(args.json, rows, text=[p.name for p in TEXTS], chunk=CHUNK, page_size=PAGE, targets=TARGETS,
                 backend=args.backend)


def bits_per_element(config, spec: str) -> float:
    """Bits a format spec stores per K or V element, its parameters included."""
    name, page, _ = parse_spec(spec.split("+")[0])  # no calibration needed to count bits
    per_page = kv_format(name).bytes_per_page(config.num_layers, page, config.num_kv_heads, config.head_dim)
    return 8 * per_page / (2 * config.num_layers * page * config.num_kv_heads * config.head_dim)


def print_table(rows: dict, args) -> None:
    print("SmolLM2-135M float32 weights; KV formats against the fp32 cache (llama.cpp: against its f16 cache)")
    head = f"{'context':>8} {'system':<10}{'cache':<15}{'ppl':>9}{'change %':>10}{'KL mean':>11}{'KL p99':>11}{'top-1 %':>9}"
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
                    print(f"{ctx:>8} {system:<10}{kind:<15}{m['ppl']:>9.3f}{'(ref)':>10}")
                    continue
                print(f"{ctx:>8} {system:<10}{kind:<15}{m['ppl']:>9.3f}{m['ppl_change_pct']:>10.3f}"
                      f"{m['kl_mean']:>11.2e}{m['kl_p99']:>11.2e}{100 * m['top1']:>9.2f}")  # fmt: skip
    print(f"\nfirst greedy divergence from the fp32 cache ({len(CHATS)} chat prompts, 64 tokens; None: none):")
    for f, firsts in rows["first_greedy_divergence"].items():
        print(f"  {f:<15}{firsts}")
    print(f"\ntargets (int8): ppl change <= {TARGETS['int8']['ppl_change_pct']}%, KL mean <= "
          f"{TARGETS['int8']['kl_mean']}, top-1 >= {100 * TARGETS['int8']['top1']}%, KL no worse than llama.cpp q8_0")
    print("targets (int4, rotated): ppl change <= 1% at page size 16, <= 2.5% at 64; better than llama.cpp's q4_0 "
          "and q4_1 at equal or fewer bits")
    print("bits per element: " + ", ".join(f"{f} {b:.2f}" for f, b in rows["bits_per_element"].items())
          + "; llama.cpp " + ", ".join(f"{k} {v}" for k, v in LLAMA_BITS.items()))


def filled_pools(config, formats: list[str], batch: int, context: int, seed: int = 0):
    """One pool per format of ``config``'s KV shape holding ``batch`` sequences of
    ``context`` tokens of the same random K/V, each sequence's pages scattered over the
    pool; and the sequences (``SeqInput``s of one new token, at the last slot). A paged
    format (int4) holds what a decode step finds in serving: the pages before the new
    token's page sealed, that page's earlier tokens staged by a later write (the new
    token's slot is left to the step)."""
    c = config
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // PAGE)
    num_pages = batch * per_seq
    pools = {f: KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, PAGE, kv_dtype=f, num_pages=num_pages))
             for f in formats}  # fmt: skip
    for pool in pools.values():
        pool.alloc(num_pages)  # every page, so any order of them is a valid set of page tables
    order = torch.randperm(num_pages, generator=g).numpy().astype(np.int32)  # a long-running server's scatter
    seqs = [SeqInput([0], context - 1, order[i * per_seq : (i + 1) * per_seq]) for i in range(batch)]
    slots = torch.cat([pools[formats[0]].slots(s.pages, 0, context) for s in seqs])
    pos = torch.arange(context).repeat(batch)
    own = (context - 1) // PAGE * PAGE  # the new token's page starts here
    sealed, staged = torch.nonzero(pos < own)[:, 0], torch.nonzero((pos >= own) & (pos < context - 1))[:, 0]
    later = []  # the staged rows per layer, written after every layer's sealed ones (one write = one forward)
    for layer in range(c.num_layers):
        k = torch.randn(len(slots), c.num_kv_heads, c.head_dim, generator=g)
        v = torch.randn(len(slots), c.num_kv_heads, c.head_dim, generator=g)
        for pool in pools.values():
            if pool.format.paged:
                pool.store_kv(layer, k[sealed], v[sealed], slots[sealed])
            else:
                pool.store_kv(layer, k, v, slots)
        later.append((k[staged], v[staged]))
    for pool in pools.values():
        if pool.format.paged and len(staged):
            for layer, (k, v) in enumerate(later):
                pool.store_kv(layer, k, v, slots[staged])
    return pools, seqs


def timed(fn, order: list, repeats: int) -> dict:
    """Median, min and all seconds of ``fn(key)`` per key, the keys alternating."""
    seconds: dict = {}
    for key in order:  # warm-up: the kernel's first build and load, first-touch of scratch
        fn(key)
    for _ in range(repeats):
        for key in order:
            t0 = time.perf_counter()
            fn(key)
            seconds.setdefault(key, []).append(time.perf_counter() - t0)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "all_s": v} for k, v in seconds.items()}


def decode_speed(model, formats: list[str], batch: int, context: int, repeats: int) -> dict:
    """Seconds per decode step of ``batch`` sequences at ``context`` tokens, per format:
    attention only (the cpu backend's plan + every layer's forward) and the model's whole
    step; plus int8 and int4 through the torch reference path, attention only. See the
    module docstring."""
    c = model.config
    load_before = os.getloadavg()[0]  # another busy process here slows the timed steps
    t0 = time.perf_counter()
    pools, seqs = filled_pools(c, formats, batch, context)
    fill_s = time.perf_counter() - t0
    dbatch = ForwardBatch.build(seqs, PAGE, "cpu")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, c.num_heads, c.head_dim, generator=g)
    k_new = torch.randn(batch, c.num_kv_heads, c.head_dim, generator=g)
    v_new = torch.randn(batch, c.num_kv_heads, c.head_dim, generator=g)
    ids = torch.randint(0, c.vocab_size, (batch,), generator=g).tolist()
    mbatch = ForwardBatch.build([SeqInput([t], s.num_cached, s.pages) for t, s in zip(ids, seqs)], PAGE, "cpu")
    backend = get_backend("cpu")
    scale = c.head_dim**-0.5

    def attention(f: str, impl=backend) -> None:
        impl.plan(dbatch)
        for layer in range(c.num_layers):
            impl.forward(q, k_new, v_new, pools[f].view(layer), scale, c.sliding_window)

    def model_step(f: str) -> None:
        logits = model.forward(mbatch, pools[f], backend)
        logits.argmax(-1)

    with torch.inference_mode():
        attn = timed(attention, formats, repeats)
        e2e = timed(model_step, formats, repeats)
        ref = get_backend("torch")
        slow = [f for f in ("int8", "int4") if f in formats]  # what the quantized formats did before the kernel
        torch_path = timed(lambda f: attention(f, ref), slow, max(2, repeats // 3)) if slow else {}
    kv_bytes = {f: pools[f].num_pages * pools[f].config.bytes_per_page for f in formats}
    rows = {"shape": {"layers": c.num_layers, "q_heads": c.num_heads, "kv_heads": c.num_kv_heads,
                      "head_dim": c.head_dim, "batch": batch, "context": context, "page_size": PAGE},
            "fill_seconds": fill_s, "load_average_1min": [load_before, os.getloadavg()[0]], "formats": {}}  # fmt: skip
    base = formats[0]
    for f in formats:
        rows["formats"][f] = {"kv_bytes_read_per_step": kv_bytes[f], "attention": attn[f], "model_step": e2e[f]}
        for times in (attn, e2e):
            times[f]["tokens_per_s"] = batch / times[f]["median_s"]
            times[f][f"speedup_vs_{base}"] = times[base]["median_s"] / times[f]["median_s"]
    for f, times in torch_path.items():
        times["tokens_per_s"] = batch / times["median_s"]
        times[f"speedup_vs_{base}"] = attn[base]["median_s"] / times["median_s"]
        rows[f"{f}_torch_path_attention"] = times
    return rows


def print_speed_table(rows: dict) -> None:
    sh = rows["shape"]
    print(f"\ndecode speed, cpu backend, {torch.get_num_threads()} threads: batch {sh['batch']} x {sh['context']}-token "
          f"contexts; {sh['layers']} layers, {sh['q_heads']} query / {sh['kv_heads']} KV heads of {sh['head_dim']}, "
          f"pages of {sh['page_size']}; median of the alternating runs (min)")  # fmt: skip
    base = next(iter(rows["formats"]))
    head = f"{'format':<20}{'KV MB':>8}{'attn ms':>16}{'tok/s':>8}{'x ' + base:>8}{'step ms':>16}{'tok/s':>8}{'x ' + base:>8}"
    print(head)
    print("-" * len(head))
    for f, row in rows["formats"].items():
        a, m = row["attention"], row["model_step"]
        print(f"{f:<20}{row['kv_bytes_read_per_step'] / 1e6:>8.0f}"
              f"{a['median_s'] * 1e3:>9.1f} ({a['min_s'] * 1e3:>4.0f}){a['tokens_per_s']:>8.1f}{a[f'speedup_vs_{base}']:>8.2f}"
              f"{m['median_s'] * 1e3:>9.1f} ({m['min_s'] * 1e3:>4.0f}){m['tokens_per_s']:>8.1f}{m[f'speedup_vs_{base}']:>8.2f}")  # fmt: skip
    for f in ("int8", "int4"):
        t = rows.get(f"{f}_torch_path_attention")
        if t:
            print(f"{f + ' (torch path)':<20}{'':>8}{t['median_s'] * 1e3:>9.1f} ({t['min_s'] * 1e3:>4.0f})"
                  f"{t['tokens_per_s']:>8.1f}{t[f'speedup_vs_{base}']:>8.2f}")  # fmt: skip
    print(f"\ntarget: int8 >= {SPEED_TARGET}x {base} tokens/s; 1-minute load average before and after: "
          f"{rows['load_average_1min'][0]:.2f}, {rows['load_average_1min'][1]:.2f} (this run's own 2 threads count)")


if __name__ == "__main__":
    main()
