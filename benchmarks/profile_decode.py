"""Where a batch-1 decode step's host time goes: the model's forward on a decode batch,
timed per step, then profiled by torch's profiler (operators by their own CPU time, and
how many kernels a step launches) and by cProfile (Python functions by their own time).

On a GPU a 135M model's decode step is host-bound (~20 ms a step on an H100 and an H200,
where the arithmetic needs well under 1 ms): this says which operators and Python
functions hold the host, the input to CUDA graphs or fused steps. Runs on the CPU too
(then the operators' time is the arithmetic's).

    python benchmarks/profile_decode.py [--device cuda] [--dtype bfloat16] [--weights expanded|native]
        [--backend triton] [--steps 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixkv.cache import KVPool, PoolConfig  # noqa: E402
from radixkv.kernels import get_backend  # noqa: E402
from radixkv.model import load_model  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402

PROMPT = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", choices=("expanded", "native"), default="expanded")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    device = args.device
    model = load_model(dtype=args.dtype, device=device, native=args.weights == "native")
    c = model.config
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, kv_dtype=model.dtype, device=device,
                             num_pages=-(-(PROMPT + 3 * args.steps + 16) // 16)))  # fmt: skip
    backend = get_backend(args.backend, device, model.dtype, model.dtype)
    table = pool.alloc(pool.config.num_pages)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(pos: int, token: int) -> int:
        batch = ForwardBatch.build([SeqInput([token], pos, table)], 16, device)
        return int(model.forward(batch, pool, backend).argmax(-1)[0])  # the sampled token: a sync, as the engine's

    first = model.forward(ForwardBatch.build([SeqInput(list(range(100, 100 + PROMPT)), 0, table)], 16, device), pool,
                          backend)  # fmt: skip
    token, pos = int(first.argmax(-1)[0]), PROMPT
    for _ in range(5):  # warm-up: kernels compiled, caches made
        token, pos = step(pos, token), pos + 1
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        token, pos = step(pos, token), pos + 1
    sync()
    per_step = (time.perf_counter() - t0) / args.steps
    print(f"{device} {torch.cuda.get_device_name() if device.startswith('cuda') else ''} {args.dtype} "
          f"{args.weights} weights, {backend.name} attention: {per_step * 1e3:.2f} ms a decode step "
          f"({1 / per_step:.0f} tok/s), {c.num_layers} layers")  # fmt: skip

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            token, pos = step(pos, token), pos + 1
        sync()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    if launches:
        print(f"kernel launches a step: {launches / args.steps:.0f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))

    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(args.steps):
        token, pos = step(pos, token), pos + 1
    sync()
    prof_py.disable()
    out = io.StringIO()
    pstats.Stats(prof_py, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    pool.decref(table)
    pool.check_integrity()
    return 0


if __name__ == "__main__":
    sys.exit(main())
