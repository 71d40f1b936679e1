"""The packed-weight Triton kernel (``radixkv.kernels.triton_weights``) on a GPU: time per
product of the embedded model's matrix shapes, in its types, at decode and prefill
token counts, for the tile in use and the alternatives, against ``F.linear`` on the same
weights expanded to the activations' dtype (what ``weights bf16`` runs), in the same run.

Shapes (rows x cols, type): SmolLM2-135M's q/k/v stacked 960 x 576, o 576 x 576,
gate/up stacked 3072 x 576, down 576 x 1536 (Q4_1), the tied head 49152 x 576 (Q8_0),
and one 7B-sized 14336 x 4096 (Q4_K). bf16 activations; CUDA events, the median over
``--rep-ms`` milliseconds of calls after warm-up (``triton.testing.do_bench``). Random blocks with small
finite scales (never zeros). Each variant's output is checked against the expanded
product before it is timed.

    python benchmarks/bench_qlinear.py [--json benchmarks/out/bench_qlinear.json] [--rep-ms 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import random_blocks, write_result  # noqa: E402

SHAPES = [("qkv", 960, 576, 3), ("gate_up", 3072, 576, 3), ("down", 576, 1536, 3), ("head", 49152, 576, 8),
          ("7b_up", 14336, 4096, 12)]  # fmt: skip
TOKENS = (1, 512, 4096)
DECODE_TILES = ["16x64/4/3", "16x32/4/3", "16x16/2/3", "16x128/4/3"]
PREFILL_TILES = ["64x64/4/3", "128x64/4/3", "128x128/8/3", "64x128/4/4", "128x256/8/3"]
def parse(spec: str):
    from radixkv.kernels.triton_weights import Tile

    size, warps, stages = spec.split("/")
    m, n = size.split("x")
    return Tile(int(m), int(n), int(warps), int(stages))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/out/bench_qlinear.json")
    ap.add_argument("--rep-ms", type=int, default=50, help="do_bench's repetition time per variant")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_qlinear.py needs a CUDA GPU; nothing measured.")
        return 0
    import triton.testing

    from radixkv.kernels import triton_weights as tw

    device, rows_out = torch.cuda.get_device_name(), []
    current = dict(tw.TILES)
    print(f"{device}, torch {torch.__version__}; bf16 activations, median over {args.rep_ms} ms (do_bench)")
    print(f"{'matrix':<9}{'type':<6}{'tokens':>7}{'dense us':>10}{'tile':>14}{'us':>9}{'x dense':>9}{'rel err':>10}")
    for seed, (name, n, k, type_id) in enumerate(SHAPES):
        m = tw.TritonPackedMatrix.from_blocks(type_id, torch.from_numpy(random_blocks(type_id, n, k, seed)), k, "cuda")
        dense = m.dequantize().to(torch.bfloat16)
        for tokens in TOKENS:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, dense)
            dense_us = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, dense), rep=args.rep_ms,
                                               return_mode="median") * 1e3  # fmt: skip
            kind = "decode" if tokens <= tw.DECODE_TOKENS else "prefill"
            for spec in DECODE_TILES if kind == "decode" else PREFILL_TILES:
                tw.TILES = {**current, kind: parse(spec)}
                try:
                    out = m.linear(x)
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    us = triton.testing.do_bench(lambda: m.linear(x), rep=args.rep_ms, return_mode="median") * 1e3
                except Exception as e:  # a tile that does not fit (shared memory, registers) is a finding
                    print(f"{name:<9}{m.type_name:<6}{tokens:>7}{dense_us:>10.1f}{spec:>14}  failed: {str(e)[:80]}")
                    rows_out.append({"matrix": name, "type": m.type_name, "tokens": tokens, "tile": spec,
                                     "error": str(e)[:300]})  # fmt: skip
                    continue
                finally:
                    tw.TILES = current
                mark = " *" if parse(spec) == current[kind] else ""
                print(f"{name:<9}{m.type_name:<6}{tokens:>7}{dense_us:>10.1f}{spec + mark:>14}{us:>9.1f}"
                      f"{dense_us / us:>8.2f}x{err:>10.1e}")  # fmt: skip
                rows_out.append({"matrix": name, "type": m.type_name, "tokens": tokens, "tile": spec, "us": us,
                                 "dense_us": dense_us, "rel_err": err, "in_use": bool(mark)})  # fmt: skip
        del m, dense
        torch.cuda.empty_cache()
    print("(* the tile in use)")
    write_result(args.json, rows_out, device=device, torch=torch.__version__, rep_ms=args.rep_ms,
                 tiles_in_use={k: list(v) for k, v in current.items()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
