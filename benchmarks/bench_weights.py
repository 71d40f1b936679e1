"""Native quantized weights: radixkv against llama.cpp on the same GGUF, same CPU threads.

Every system runs in its own process, the systems one after another in each round
(interleaved, so drift over the run hits all of them alike); the table gives the median
over rounds. The embedded SmolLM2-135M-Instruct GGUF (Q4_1 matrices, a Q8_0 embedding
tied to the head), ``--threads`` threads everywhere:

- radixkv ``native`` (``--weights native``: the blocks read in place), ``native8`` (the
  same with ``--activation-bits 8``: inputs rounded to 8 bits as llama.cpp rounds them) and
  ``fp32`` (the exact mode: the weights expanded to float32), through ``LlamaModel.forward`` and the
  attention backend ``auto`` picks (the C decode kernel), as an engine step runs them:
  prefill of one 512-token prompt (logits of its last token); decode at batch 1 (a
  128-token prompt, then 64 greedy steps) and at batch 16 (16 prompts of 128 tokens, 32
  steps); the process's RSS after loading (torch imported, model loaded, no KV pool).
- llama.cpp (``llama-bench -p 512 -n 0`` for prefill; ``llama-batched-bench -npp 128
  -ntg 64 -npl 1`` and ``-ntg 32 -npl 16`` for decode, S_TG: generated tokens per second
  of the generation phase), built from the llama.cpp that llama-cpp-python's sdist vendors
  (``benchmarks/peers/setup_llamacpp_bin.sh``); its peak RSS (which includes its KV cache
  of ``-c`` tokens at f16, so the comparison favours it).

Then greedy agreement on 12 chat prompts (up to 64 tokens): radixkv native, native8 and
fp32 against llama-server on the same GGUF, and native and native8 against fp32.

    .venv/bin/python benchmarks/bench_weights.py [--rounds 3] [--threads 2] [--json benchmarks/out/bench_weights.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import paged_decode_seconds, write_result  # noqa: E402

PREFILL, CONTEXT, STEPS_B1, BATCH, STEPS_B16 = 512, 128, 64, 16, 32
LLAMA_BIN = ROOT / ".peers" / "llama.cpp-bin" / "bin"
TARGETS = {"decode_b1_vs_llamacpp": 1.0, "decode_b16_vs_llamacpp": 1.3, "prefill_vs_llamacpp": 2.0,
           "rss_over_llamacpp_mb": 200}  # fmt: skip


def worker(mode: str, threads: int) -> dict:
    """radixkv in this process: ``mode`` native, native8 or fp32."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    from radixkv.cache import KVPool, PoolConfig
    from radixkv.kernels import get_backend
    from radixkv.model import load_model
    from radixkv.model.batch import ForwardBatch, SeqInput

    model = load_model(native=mode != "fp32", activation_bits=8 if mode == "native8" else 16)
    loaded_rss = rss()
    backend = get_backend("auto")
    c = model.config
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=1024))
    rng = np.random.default_rng(0)

    def prefill() -> float:
        prompt = rng.integers(0, c.vocab_size, PREFILL).tolist()
        table = pool.alloc(PREFILL // 16)
        t0 = time.perf_counter()
        model.forward(ForwardBatch.build([SeqInput(prompt, 0, table)], 16), pool, backend)
        elapsed = time.perf_counter() - t0
        pool.decref(table)
        return PREFILL / elapsed

    def decode(batch: int, steps: int) -> float:
        prompts = rng.integers(0, c.vocab_size, (batch, CONTEXT)).tolist()
        return batch * steps / paged_decode_seconds(model, pool, backend, prompts, steps)

    prefill(), decode(1, 4)  # warm-up
    return {"prefill_tok_s": statistics.median(prefill() for _ in range(3)), "decode_b1_tok_s": decode(1, STEPS_B1),
            "decode_b16_tok_s": decode(BATCH, STEPS_B16), "rss_mb": loaded_rss / 1e6}  # fmt: skip


def run_measured(cmd: list[str]) -> tuple[str, float]:
    """stdout of ``cmd`` and its peak RSS in MB."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}")
    return out, usage.ru_maxrss / 1e3


def llamacpp(gguf: Path, threads: int) -> dict:
    out, _ = run_measured([str(LLAMA_BIN / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(PREFILL),
                           "-n", "0", "-r", "3", "-o", "json"])  # fmt: skip
    prefill = json.loads(out)[0]["avg_ts"]
    result = {"prefill_tok_s": prefill}
    for batch, steps, key in ((1, STEPS_B1, "decode_b1_tok_s"), (BATCH, STEPS_B16, "decode_b16_tok_s")):
        out, rss = run_measured([str(LLAMA_BIN / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
                                 "-c", "4096", "-b", "2048", "-ub", "512", "-npp", str(CONTEXT), "-ntg", str(steps),
                                 "-npl", str(batch), "--output-format", "jsonl"])  # fmt: skip
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        result[key] = rows[-1]["speed_tg"]
        result["rss_mb"] = max(result.get("rss_mb", 0.0), rss)
    return result


QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 7 times 8?", "Who wrote Hamlet?",
             "What is the boiling point of water?", "Name a planet.", "What language is spoken in Brazil?",
             "What is the largest ocean?", "What do bees make?", "Explain photosynthesis in two sentences.",
             "Write a haiku about the sea.", "List three uses of a paperclip."]  # fmt: skip
AGREE_TOKENS = 64


def agreement(threads: int) -> dict:
    """Greedy tokens of radixkv (native and fp32) against llama-server on the same GGUF,
    and native against fp32: the chat prompts above, up to ``AGREE_TOKENS`` tokens each
    (to EOS). Per pair: the prompts whose continuations are equal, and the mean index of
    the first differing token (a continuation's length where none differs). llama.cpp
    rounds activations to 8 bits, which moves near-tied greedy choices."""
    from benchmarks.peers.llamaserver_backend import LlamaServer, unavailable
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling import SamplingParams

    if unavailable():
        return {}
    server = LlamaServer(threads)
    try:
        http, tok = server.backend._http, server.backend.tokenizer
        prompts = [tok.encode(server.backend.render_chat([{"role": "user", "content": q}], True), False)
                   for q in QUESTIONS]  # fmt: skip
        eos = server.backend.eos_token_ids
        theirs = []
        for p in prompts:
            body = {"prompt": p, "n_predict": AGREE_TOKENS, "temperature": 0.0, "top_k": 1, "return_tokens": True,
                    "cache_prompt": False}  # fmt: skip
            theirs.append([t for t in http.post("/completion", json=body).json()["tokens"] if t not in eos])
    finally:
        server.close()
    runs = {"llama.cpp": theirs}
    for name, weights, bits in (("native", "native", 16), ("native8", "native", 8), ("fp32", "fp32", 16)):
        with Engine(weights=weights, activation_bits=bits, kv_cache_tokens=8192) as engine:
            greedy = SamplingParams(temperature=0, max_new_tokens=AGREE_TOKENS)
            runs[f"radixkv {name}"] = [[t for t in engine.generate(p, greedy).outputs[0].token_ids if t not in eos]
                                       for p in prompts]  # fmt: skip
    out = {}
    for a, b in (("radixkv native", "llama.cpp"), ("radixkv native8", "llama.cpp"), ("radixkv fp32", "llama.cpp"),
                 ("radixkv native", "radixkv fp32"), ("radixkv native8", "radixkv fp32")):  # fmt: skip
        firsts = [next((i for i, (x, y) in enumerate(zip(xs, ys)) if x != y), min(len(xs), len(ys)))
                  for xs, ys in zip(runs[a], runs[b])]  # fmt: skip
        out[f"{a} vs {b}"] = {"equal": sum(x == y for x, y in zip(runs[a], runs[b])), "prompts": len(prompts),
                              "mean_first_difference": statistics.mean(firsts), "first_differences": firsts}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/out/bench_weights.json")
    ap.add_argument("--worker", choices=("native", "native8", "fp32"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    from radixkv.model import resolve_model

    gguf = resolve_model().path
    systems = ["radixkv native", "radixkv native8", "radixkv fp32"]
    if (LLAMA_BIN / "llama-bench").exists():
        systems.append("llama.cpp")
    else:
        print("llama.cpp binaries missing: run benchmarks/peers/setup_llamacpp_bin.sh (measuring radixkv alone)")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    samples: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems:
            if system == "llama.cpp":
                samples[system].append(llamacpp(gguf, args.threads))
            else:
                cmd = [sys.executable, __file__, "--worker", system.split()[1], "--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
                samples[system].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {system}: {samples[system][-1]}", flush=True)
    rows = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in samples.items()}

    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, {cpu.group(1) if cpu else 'CPU'}, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'system':<16}{'prefill 512':>13}{'decode b1':>11}{'decode b16':>12}{'RSS MB':>9}")
    for s, r in rows.items():
        print(f"{s:<16}{r['prefill_tok_s']:>13.0f}{r['decode_b1_tok_s']:>11.1f}{r['decode_b16_tok_s']:>12.1f}"
              f"{r['rss_mb']:>9.0f}")  # fmt: skip
    ratios = {}
    if "llama.cpp" in rows:
        ours, peer = rows["radixkv native"], rows["llama.cpp"]
        ratios = {"decode_b1_vs_llamacpp": ours["decode_b1_tok_s"] / peer["decode_b1_tok_s"],
                  "decode_b16_vs_llamacpp": ours["decode_b16_tok_s"] / peer["decode_b16_tok_s"],
                  "prefill_vs_llamacpp": ours["prefill_tok_s"] / peer["prefill_tok_s"],
                  "rss_over_llamacpp_mb": ours["rss_mb"] - peer["rss_mb"]}  # fmt: skip
    if "llama.cpp" in rows:  # the 8-bit option beside the peer that rounds activations alike (no target)
        fast, peer = rows["radixkv native8"], rows["llama.cpp"]
        print(f"\nnative8 / llama.cpp: prefill {fast['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x, decode b1 "
              f"{fast['decode_b1_tok_s'] / peer['decode_b1_tok_s']:.2f}x, b16 "
              f"{fast['decode_b16_tok_s'] / peer['decode_b16_tok_s']:.2f}x")  # fmt: skip
    print(f"\n{'target':<26}{'measured':>10}{'goal':>8}")
    for k, v in ratios.items():
        goal = TARGETS[k]
        met = v <= goal if k.startswith("rss") else v >= goal
        print(f"{k:<26}{v:>10.2f}{goal:>8}  {'met' if met else 'MISSED'}")
    agree = agreement(args.threads)
    if agree:
        print(f"\ngreedy agreement ({len(QUESTIONS)} chat prompts, up to {AGREE_TOKENS} tokens)")
        for pair, a in agree.items():
            print(f"{pair:<34} equal {a['equal']}/{a['prompts']}, first difference at token "
                  f"{a['mean_first_difference']:.1f} on average ({a['first_differences']})")  # fmt: skip
    write_result(args.json, rows, ratios=ratios, targets=TARGETS, threads=args.threads, rounds=args.rounds,
                 agreement=agree,
                 samples=samples, shapes={"prefill": PREFILL, "context": CONTEXT, "steps_b1": STEPS_B1,
                                          "batch": BATCH, "steps_b16": STEPS_B16})  # fmt: skip


if __name__ == "__main__":
    main()
