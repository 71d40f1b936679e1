"""The embedded SmolLM2-135M on a CUDA GPU: fidelity and speed per attention backend.

1. Fidelity. The six chats of ``tests/test_gpu.py``, 32 greedy tokens each, through the
   Engine on the GPU with each backend and KV dtype, against transformers' greedy tokens
   on the same GPU in float32. A row counts the tokens that agree with the reference
   before the first difference; float32 must agree fully (the exact mode), half
   precision is reported (agreement, not equality).
2. Speed, per backend and dtype, through ``Engine.generate`` (greedy, ``ignore_eos``):
   batch-1 and batch-64 decode (tok/s over 128 new tokens per sequence, the prefill
   subtracted by timing the same prompts with 1 new token), and a 4096-token prefill
   (one prompt, one token out: time to the end of the request). Seeded random prompts,
   a fresh cache each time (nothing is a cache hit), median of ``--repeat``. Peer:
   transformers on the same GPU and dtype, same prompts, its own KV cache (``generate``
   for decode, one forward for prefill), measured in the same run.

``--configs`` picks what runs instead of every backend and dtype: comma-separated
``backend:dtype[:weights[:kv_dtype]]`` (``triton:bfloat16:native``: the GGUF's packed
blocks multiplied by Triton; ``triton:float32:auto:int8``: int8 KV pages), each through
fidelity and speed; transformers runs in every dtype named, as the speed peer.

    python benchmarks/bench_gpu_model.py [--json benchmarks/out/bench_gpu_model.json] [--quick] [--configs ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import FIDELITY_CHATS as CHATS  # noqa: E402
from benchmarks.common import agreement, write_result  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.sampling import SamplingParams  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402

FIDELITY_STEPS = 32
DECODE_PROMPT, DECODE_NEW, PREFILL = 128, 128, 4096
ENGINE = {"kv_cache_tokens": 65536 + 16384, "max_batch_tokens": 8192, "chunked_prefill_size": 4096, "max_running": 64}


def backends():
    names = ["torch", "triton"]
    try:
        import flashinfer  # noqa: F401

        names.append("flashinfer")
    except ImportError:
        pass
    return names


def sync_seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_model(dtype):
    import transformers

    src = resolve_model()
    return transformers.AutoModelForCausalLM.from_pretrained(
        src.path.parent, gguf_file=src.path.name, dtype=dtype
    ).to("cuda").eval()  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_gpu_model.json")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat, batch-64 decode and prefill only in bf16")
    ap.add_argument("--configs", default=None, help="backend:dtype[:weights[:kv_dtype]],... (default: every "
                    "backend in float32, bfloat16 and float16)")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_model.py needs a CUDA GPU; nothing measured.")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    repeat = 1 if args.quick else args.repeat
    device = torch.cuda.get_device_name()
    rng = np.random.default_rng(0)

    # 1. fidelity ---------------------------------------------------------------------------
    with Engine(kv_cache_tokens=256) as cpu:
        prompts = [cpu.encode(cpu.render_chat(c)) for c in CHATS]
    hf = hf_model(torch.float32)
    ref = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=FIDELITY_STEPS, do_sample=False,
                              pad_token_id=2)  # fmt: skip
            ref.append(out[0, len(p) :].tolist())
    del hf
    total = sum(len(r) for r in ref)
    fidelity = []
    greedy = SamplingParams(temperature=0, max_new_tokens=FIDELITY_STEPS)
    if args.configs:
        combos = [tuple((c.split(":") + ["auto", "auto"])[:4]) for c in args.configs.split(",") if c]
    else:
        combos = [(b, d, "auto", "auto") for d in ("float32", "bfloat16", "float16") for b in backends()
                  if not (b == "flashinfer" and d == "float32")]  # fmt: skip
    for name, dtype, weights, kv in combos:
        label = {"backend": name, "dtype": dtype, "weights": weights, "kv_dtype": kv}
        try:
            with Engine(device="cuda", dtype=dtype, attention_backend=name, kv_cache_tokens=8192, weights=weights,
                        kv_dtype=kv) as e:  # fmt: skip
                results = e.generate(prompts, greedy)
                e.check_integrity()
            errors = [o.error for o in results if o.error]
            if errors:
                raise RuntimeError(errors[0])
            outs = [o.token_ids for o in results]
        except Exception as exc:  # a backend that fails is a finding, not a crash of the run
            fidelity.append({**label, "error": f"{type(exc).__name__}: {exc}"})
            continue
        agree = sum(agreement(o, r) for o, r in zip(outs, ref))
        fidelity.append({**label, "agree_tokens": agree, "total_tokens": total,
                         "exact_chats": sum(o == r for o, r in zip(outs, ref))})  # fmt: skip
        print("fidelity", fidelity[-1], flush=True)

    # 2. speed ------------------------------------------------------------------------------
    speed = []
    dtypes = ("bfloat16",) if args.quick else ("bfloat16", "float32")
    decode_batches = (64,) if args.quick else (1, 64)
    if args.configs:
        dtypes = tuple(dict.fromkeys(d for _, d, _, _ in combos))
    for dtype in dtypes:
        if args.configs:
            systems = [c for c in combos if c[1] == dtype] + [("transformers", dtype, "auto", "auto")]
        else:
            systems = [(n, dtype, "auto", "auto") for n in backends() + ["transformers"]
                       if not (n == "flashinfer" and dtype == "float32")]  # fmt: skip
        for name, _, weights, kv in systems:
            row = {"system": name, "dtype": dtype, "weights": weights, "kv_dtype": kv}
            try:
                runner = HFRunner(dtype) if name == "transformers" else EngineRunner(name, dtype, weights, kv)
                for b in decode_batches:
                    ps = rng.integers(100, 49000, (b, DECODE_PROMPT)).tolist()
                    runner.decode(ps, DECODE_NEW)  # warm-up (kernels compiled, plans made)
                    times = []
                    for _ in range(repeat):
                        ps = rng.integers(100, 49000, (b, DECODE_PROMPT)).tolist()
                        times.append(runner.decode(ps, DECODE_NEW) - runner.decode(ps, 1))
                    row[f"decode_b{b}_tok_s"] = b * (DECODE_NEW - 1) / statistics.median(times)
                long = rng.integers(100, 49000, PREFILL).tolist()
                runner.decode([long], 1)
                times = [runner.decode([rng.integers(100, 49000, PREFILL).tolist()], 1) for _ in range(repeat)]
                row["prefill_4k_tok_s"] = PREFILL / statistics.median(times)
                row["weight_bytes"] = runner.weight_bytes()
                runner.close()
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            speed.append(row)
            print("speed", row, flush=True)
            torch.cuda.empty_cache()

    # report ----------------------------------------------------------------------------------
    print(f"{device}, torch {torch.__version__}, triton {_version('triton')}, flashinfer {_version('flashinfer-python')}, "
          f"transformers {_version('transformers')}")  # fmt: skip
    print(f"\nfidelity: {len(CHATS)} chats x {FIDELITY_STEPS} greedy tokens vs transformers float32 on the GPU")
    print(f"{'backend':<12}{'dtype':<10}{'weights':<8}{'kv':<6}{'agree':>12}{'exact chats':>13}")
    for r in fidelity:
        head = f"{r['backend']:<12}{r['dtype']:<10}{r['weights']:<8}{r['kv_dtype']:<6}"
        if "error" in r:
            print(f"{head}  error: {r['error'][:200]}")
        else:
            print(f"{head}{r['agree_tokens']:>6}/{r['total_tokens']:<5}{r['exact_chats']:>8}/{len(CHATS)}")
    print(f"\nspeed (median of {repeat}): decode {DECODE_NEW} tokens on {DECODE_PROMPT}-token prompts; "
          f"prefill of {PREFILL} tokens")  # fmt: skip
    cols = [f"decode_b{b}_tok_s" for b in decode_batches] + ["prefill_4k_tok_s", "weight_bytes"]
    print(f"{'system':<14}{'dtype':<10}{'weights':<8}{'kv':<6}" + "".join(f"{c:>18}" for c in cols))
    for r in speed:
        head = f"{r['system']:<14}{r['dtype']:<10}{r['weights']:<8}{r['kv_dtype']:<6}"
        if "error" in r:
            print(f"{head}  error: {r['error'][:200]}")
        else:
            print(head + "".join(f"{r.get(c, float('nan')):>18,.0f}" for c in cols))
    write_result(args.json, {"fidelity": fidelity, "speed": speed}, device=device, torch=torch.__version__,
                 engine=ENGINE, repeat=repeat)  # fmt: skip
    return 0


class EngineRunner:
    def __init__(self, backend: str, dtype: str, weights: str = "auto", kv_dtype: str = "auto"):
        self.engine = Engine(device="cuda", dtype=dtype, attention_backend=backend, weights=weights, kv_dtype=kv_dtype,
                             **ENGINE)  # fmt: skip

    def weight_bytes(self) -> int:
        return self.engine.stats()["weights"]["bytes"]

    def decode(self, prompts, new: int) -> float:
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        self.engine.flush_cache()
        outs = []
        seconds = sync_seconds(lambda: outs.extend(self.engine.generate(prompts, [params] * len(prompts))))
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(errors[0])
        return seconds

    def close(self):
        self.engine.check_integrity()
        self.engine.close()


class HFRunner:
    def __init__(self, dtype: str):
        self.model = hf_model(getattr(torch, dtype))

    @torch.inference_mode()
    def decode(self, prompts, new: int) -> float:
        ids = torch.tensor(prompts, device="cuda")
        if new == 1:
            return sync_seconds(lambda: self.model(ids, logits_to_keep=1))
        return sync_seconds(lambda: self.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                        pad_token_id=2))  # fmt: skip

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.parameters())

    def close(self):
        del self.model


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
