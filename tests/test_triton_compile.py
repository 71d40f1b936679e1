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
DATA = {"q", "o", "k_cache", "v_cache", "k_params", "v_params",
        "k_new", "v_new", "k_stage", "v_stage", "slot_of", "basis"}  # fmt: skip
INT8 = {"o": "*fp32", "k_cache": "*i8", "v_cache": "*i8", "k_params": "*u8", "v_params": "*u8"}
# int4: packed codes, fp16 (scale, offset) pairs, float32 staging rows and their page map, the row map
INT4_PAGES = {"k_cache": "*u8", "v_cache": "*u8", "k_params": "*fp16", "v_params": "*fp16",
              "k_stage": "*fp32", "v_stage": "*fp32", "slot_of": "*i64", "basis": "*fp32"}  # fmt: skip
KV_POINTERS = {"i8": INT8, "u4": {**INT4_PAGES, "o": "*fp32"}, "u4_norot": INT4_PAGES}
FLOATS = {"scale", "softcap"}


def compile_kernel(kernel, dtype, kv=None, options=None, **constexprs):
    """Compile ``kernel`` for sm_90 with its data pointers of ``dtype``. ``kv="i8"``: int8
    caches with a log-scale byte per row, the scale table, and a float32 output (``INT8_KV``);
    ``kv="u4"`` (rotated: a float32 output) or ``"u4_norot"``: int4 pages, their
    parameters, staging and row map, and the new tokens' K/V in ``dtype`` (``INT4_KV``);
    otherwise the caches are ``dtype`` too and the format pointers (unused) take the
    caches, as ``TritonBackend.forward`` passes them."""
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in KV_POINTERS.get(kv, {}):
            signature[name] = KV_POINTERS[kv][name]
        elif name in DATA:
            signature[name] = f"*{dtype}"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    missing = {n for n, t in signature.items() if t == "constexpr"} - set(constexprs)
    assert not missing, f"give values for {missing}"
    compile_sm90(kernel, signature, constexprs, options)


def compile_sm90(kernel, signature: dict, constexprs: dict, options: dict | None = None) -> None:
    """``triton.compile`` of ``kernel`` for sm_90 (no GPU needed); RuntimeError when no
    cubin comes out."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
    if not compiled.asm.get("cubin"):
        raise RuntimeError(f"{kernel.__name__}: no cubin")


ATTN = dict(HEAD_DIM=128, BLOCK_D=128, NUM_BLOCKS=1)
VARIANTS = [
    # dtype (of the queries), native dot, dynamic loops (the GPU path), softcap, window, group, cache, page size
    ("fp16", True, True, False, False, 4, None, 16),
    ("bf16", True, True, True, True, 8, None, 16),
    ("fp32", False, True, False, False, 1, None, 16),
    ("bf16", False, False, False, True, 4, None, 16),  # what the interpreter runs
    # int8 caches (codes + a log-scale byte): half queries on tensor cores, fp32 queries in IEEE fp32
    ("fp16", True, True, False, False, 4, "i8", 16),
    ("bf16", True, True, True, True, 8, "i8", 16),
    ("fp32", False, True, False, True, 3, "i8", 16),
    ("fp32", False, False, True, True, 3, "i8", 16),  # what the interpreter runs
    # int4 pages, rotated or not; K's parameters loaded per page (16) or per position (3, 1).
    # Only the GPU's loops: the interpreter's run in tests/test_triton_int4.py (and its
    # compiles are slow: an int4 block body holds four or six dots)
    ("bf16", True, True, True, True, 8, "u4", 16),
    ("fp16", True, True, False, False, 4, "u4_norot", 3),
    ("fp32", False, True, False, True, 3, "u4", 1),
]
INT4_KV = ("u4", "u4_norot")
KINDS = {None: None, "i8": "int8", "u4": "int4", "u4_norot": "int4"}  # the backend's name of each cache kind
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def blocks(page_size: int, block_n: int) -> dict:
    """``BLOCK_N`` and K's int4 parameter runs (``PARAM_RUN``) as ``forward`` sizes them."""
    from radixkv.kernels.triton_backend import _param_run

    return dict(BLOCK_N=block_n, PARAM_RUN=_param_run(page_size, block_n))


def jobs() -> list[tuple[str, str, str | None, dict]]:
    """Every (kernel name, query dtype, cache kind, constexprs) to compile."""
    import torch

    from radixkv.kernels import triton_backend as tb

    out = []
    for dtype, native, dynamic, softcap, window, group, kv, page_size in VARIANTS:
        flags = dict(USE_SOFTCAP=softcap, USE_WINDOW=window, NATIVE_DOT=native, DYNAMIC_LOOP=dynamic, GROUP=group,
                     PAGE_SIZE=page_size, INT8_KV=kv == "i8", INT4_KV=kv in INT4_KV, ROTATED=kv == "u4")  # fmt: skip
        small = {**ATTN, **blocks(page_size, 16)}
        out.append(("_decode_partial", dtype, kv, dict(BLOCK_H=16, NUM_SPLITS=8, **flags, **small)))
        out.append(("_extend", dtype, kv, dict(BLOCK_M=64, BLOCK_Q=64 // group, PACK_GQA=True, **flags, **small)))
        if kv not in INT4_KV:  # (int4 reads K/V the same in either row layout)
            out.append(("_extend", dtype, kv, dict(BLOCK_M=64, BLOCK_Q=64, PACK_GQA=False, **flags, **small)))
        if native and dynamic:  # the tiles the GPU runs for half-precision queries (and KV, or int8/int4 KV)
            tile = tb.TritonBackend().decode_tile(KINDS[kv], getattr(torch, DTYPES[dtype]))  # (a float cache: q's dtype)
            decode = dict(BLOCK_H=16, NUM_SPLITS=tile.max_splits, **flags, **ATTN, **blocks(page_size, tile.block_n))
            out.append(("_decode_partial", dtype, kv, {**decode, "options": dict(num_warps=tile.num_warps,
                                                                                 num_stages=tile.num_stages)}))
            block_m, block_n = tb.TritonBackend.EXTEND_HALF
            tiles = dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, PACK_GQA=True, **blocks(page_size, block_n))
            out.append(("_extend", dtype, kv, {**flags, **ATTN, **tiles}))
    for dtype in ("fp16", "bf16", "fp32"):
        out.append(("_decode_reduce", dtype, None, dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=8, BLOCK_S=8)))
    return out


def _compile_job(job) -> None:
    from radixkv.kernels import triton_backend as tb

    name, dtype, kv, constexprs = job
    compile_kernel(getattr(tb, name), dtype, kv, **constexprs)


def compile_in_parallel(job, todo: list) -> int:
    """``job(item)`` for every item, on every core (a cold Triton cache takes minutes);
    the number of items."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        list(pool.map(job, todo))
    return len(todo)


def compile_all() -> int:
    """Compile every job."""
    return compile_in_parallel(_compile_job, jobs())


def test_every_kernel_variant_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # per variant: decode, extend packed, extend per head (not int4) (+ the GPU's decode and extend
    # tiles for half-precision queries); 3 reduces
    expected = sum(2 + (v[6] not in INT4_KV) + 2 * (v[1] and v[2]) for v in VARIANTS) + 3
    assert f"compiled {expected} kernel variants for sm_90" in out.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(f"compiled {compile_all()} kernel variants for sm_90")
