"""Compile the FlashInfer kernels radixkv uses, all at once, before tests or benchmarks.

flashinfer-python builds each attention module (one per dtype, head size, sliding
window and soft-cap setting) with nvcc the first time it is planned, one module after
another. On a freshly lent GPU machine that costs minutes of device time; handing the
whole list to one ninja run compiles the modules side by side on every core.

    python benchmarks/flashinfer_prebuild.py [--head-dims 64,128] [--dtypes float16,bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--variants", default="all", help="'plain': no sliding window or soft-cap; 'all': every combination")
    args = ap.parse_args()
    import flashinfer  # noqa: F401
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.core import build_jit_specs
    from flashinfer.utils import determine_attention_backend

    device = torch.device("cuda")
    flags = [(False, False)] if args.variants == "plain" else list(itertools.product((False, True), repeat=2))
    specs = []
    for name, hd, (window, softcap) in itertools.product(args.dtypes.split(","), map(int, args.head_dims.split(",")), flags):
        dt = getattr(torch, name)
        specs.append(gen_batch_decode_module(dt, dt, dt, torch.int32, hd, hd, 0, window, softcap))
        backend = determine_attention_backend(device, 0, False, False, dt, dt, head_dim_qk=hd, head_dim_vo=hd)
        specs.append(gen_batch_prefill_module(backend, dt, dt, dt, torch.int32, hd, hd, 0, window, softcap, False))
    t0 = time.perf_counter()
    build_jit_specs(specs, verbose=False)
    print(f"flashinfer: {len(specs)} modules ready in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
