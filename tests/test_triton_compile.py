"""Every Triton kernel variant compiles ahead of time for an H100/H200 (sm_90), no GPU
needed: this catches what the CPU interpreter lets through (dot shapes, dtypes, the
compiled-only dynamic loops).

The test session runs Triton's interpreter (see conftest.py), whose kernels cannot be
compiled, so the compiles run in a child process without it: ``python
tests/test_triton_compile.py`` compiles every variant and prints one line per kernel.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

POINTERS = {"mid_o": "*fp32", "mid_lse": "*fp32",
            "kv_indptr": "*i32", "kv_indices": "*i32", "seq_lens": "*i32", "qo_indptr": "*i32"}  # fmt: skip
DATA = {"q", "o", "k_cache", "v_cache", "k_params", "v_params", "scales"}
INT8 = {"o": "*fp32", "k_cache": "*i8", "v_cache": "*i8", "k_params": "*u8", "v_params": "*u8", "scales": "*fp32"}
FLOATS = {"scale", "softcap"}


def compile_kernel(kernel, dtype, kv=None, **constexprs):
    """Compile ``kernel`` for sm_90 with its data pointers of ``dtype``. ``kv="i8"``: int8
    caches with a log-scale byte per row, the scale table, and a float32 output (``INT8_KV``);
    otherwise the caches are ``dtype`` too and the parameter pointers (unused) take the
    caches, as ``TritonBackend.forward`` passes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif kv == "i8" and name in INT8:
            signature[name] = INT8[name]
        elif name in DATA:
            signature[name] = f"*{dtype}"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    missing = {n for n, t in signature.items() if t == "constexpr"} - set(constexprs)
    assert not missing, f"give values for {missing}"
    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target)
    if not compiled.asm.get("cubin"):
        raise RuntimeError(f"{kernel.__name__}: no cubin")


ATTN = dict(PAGE_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=16, NUM_BLOCKS=1)
VARIANTS = [
    # dtype (of the queries), native dot, dynamic loops (the GPU path), softcap, window, group, cache
    ("fp16", True, True, False, False, 4, None),
    ("bf16", True, True, True, True, 8, None),
    ("fp32", False, True, False, False, 1, None),
    ("bf16", False, False, False, True, 4, None),  # what the interpreter runs
    # int8 caches (codes + fp16 scale and offset): half queries on tensor cores, fp32 queries in IEEE fp32
    ("fp16", True, True, False, False, 4, "i8"),
    ("bf16", True, True, True, True, 8, "i8"),
    ("fp32", False, True, False, True, 3, "i8"),
    ("fp32", False, False, True, True, 3, "i8"),  # what the interpreter runs
]


def compile_all() -> int:
    from radixkv.kernels import triton_backend as tb

    count = 0
    for dtype, native, dynamic, softcap, window, group, kv in VARIANTS:
        flags = dict(USE_SOFTCAP=softcap, USE_WINDOW=window, NATIVE_DOT=native, DYNAMIC_LOOP=dynamic, GROUP=group,
                     INT8_KV=kv == "i8")  # fmt: skip
        compile_kernel(tb._decode_partial, dtype, kv, BLOCK_H=16, NUM_SPLITS=8, **flags, **ATTN)
        compile_kernel(tb._extend, dtype, kv, BLOCK_M=64, BLOCK_Q=64, PACK_GQA=False, **flags, **ATTN)
        compile_kernel(tb._extend, dtype, kv, BLOCK_M=64, BLOCK_Q=64 // group, PACK_GQA=True, **flags, **ATTN)
        count += 3
        if native and dynamic:  # the tiles the GPU runs for half-precision queries (and KV, or int8 KV)
            block_m, block_n = tb.TritonBackend.EXTEND_HALF
            tiles = dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, PACK_GQA=True, BLOCK_N=block_n)
            compile_kernel(tb._extend, dtype, kv, **flags, **{**ATTN, **tiles})
            count += 1
    for dtype in ("fp16", "bf16", "fp32"):
        compile_kernel(tb._decode_reduce, dtype, HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=8, BLOCK_S=8)
        count += 1
    return count


def test_every_kernel_variant_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # per variant: decode, extend per head, extend packed (+ the GPU's half tiles); 3 reduces
    expected = 3 * len(VARIANTS) + sum(1 for v in VARIANTS if v[1] and v[2]) + 3
    assert f"compiled {expected} kernel variants for sm_90" in out.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(f"compiled {compile_all()} kernel variants for sm_90")
