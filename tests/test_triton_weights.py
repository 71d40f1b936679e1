"""GGUF quantized weights on the GPU (``radixkv.kernels.triton_weights``).

The planes against gguf's own numpy dequantization, bit for bit, on random blocks of
every type; ``linear`` (the Triton kernel: under the interpreter on the CPU, compiled
on CUDA where there is one) against float64 dequantize-then-matmul for float32,
bfloat16 and float16 activations, decode and prefill shapes, rows that are no multiple
of the row tile and widths that need each column step; ``rows``, ``stack`` and bad
inputs; and (like ``test_triton_compile.py``) every kernel variant compiled for sm_90
in a child process without the interpreter.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

pytest.importorskip("triton")

from test_attention import device_for
from test_triton_compile import compile_in_parallel, compile_sm90
from benchmarks.common import random_blocks  # random bytes in a type's block layout, finite fp16 scales
from radixkv.kernels import triton_weights as tw
from radixkv.kernels.triton_weights import TritonPackedMatrix
from radixkv.kernels.weights import TYPES

DEVICE = device_for("triton")  # compiled Triton takes CUDA tensors; the interpreter CPU ones
K_QUANTS = (12, 13, 14)
NAMES = [TYPES[t][0] for t in TYPES]


def reference(type_id: int, blocks: np.ndarray, cols: int) -> np.ndarray:
    """gguf's dequantization, float32 ``[rows, cols]``."""
    return dequantize(blocks, GGMLQuantizationType(type_id)).reshape(-1, cols)


def matrix(type_id: int, rows: int, cols: int, seed: int = 0, device=DEVICE):
    blocks = random_blocks(type_id, rows, cols, seed)
    return TritonPackedMatrix.from_blocks(type_id, torch.from_numpy(blocks), cols, device), blocks


def widths(type_id: int) -> list[int]:
    """256 (column steps of 128), and for the 32-value types 96 (steps of 32) and 320 (64)."""
    return [256] if type_id in K_QUANTS else [256, 96, 320]


@pytest.mark.parametrize("type_id", list(TYPES), ids=NAMES)
def test_planes_dequantize_to_gguf_bit_for_bit(type_id):
    for rows, cols in [(1, 256), (5, 512), (72, 256)] + ([(3, 32), (4, 96)] if type_id not in K_QUANTS else []):
        m, blocks = matrix(type_id, rows, cols, seed=rows + cols, device="cpu")
        got = m.dequantize().numpy()
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        assert np.array_equal(got.view(np.uint32), reference(type_id, blocks, cols).view(np.uint32))
    # the planes are aligned views into ``data``, which holds nothing else
    layout = tw.LAYOUTS[type_id]
    planes = [m.codes, m.scales] + ([m.mins] if layout.has_min else [])
    assert (m.mins is not None) == layout.has_min
    base = m.data.data_ptr()
    for plane in planes:
        assert plane.is_contiguous() and plane.untyped_storage().data_ptr() == m.data.untyped_storage().data_ptr()
        assert (plane.data_ptr() - base) % tw.ALIGN == 0
    assert m.codes.shape == (rows, cols // 2 if layout.nibbles else cols)
    assert m.codes.dtype == (torch.int8 if layout.signed else torch.uint8)
    assert m.scales.shape == (rows, cols // layout.group)
    assert m.data.dtype == torch.uint8 and m.data.dim() == 1
    assert m.data.numel() < sum(p.numel() * p.element_size() for p in planes) + len(planes) * tw.ALIGN


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("type_id", list(TYPES), ids=NAMES)
def test_linear_matches_dequantize_then_matmul(type_id, dtype):
    """Decode (1, 3 tokens: the 16-token tile) and prefill (17, 70: 64-token tiles)
    shapes; 72 rows (a partial row tile); every column step."""
    gen = torch.Generator().manual_seed(type_id)
    for cols in widths(type_id):
        m, blocks = matrix(type_id, 72, cols, seed=cols)
        w = torch.from_numpy(reference(type_id, blocks, cols)).double()
        for tokens in (1, 3, 17, 70):
            x = torch.randn(tokens, cols, generator=gen).to(dtype)
            y = m.linear(x.to(DEVICE)).cpu()
            assert y.dtype == dtype and y.shape == (tokens, 72)
            assert torch.isfinite(y).all()
            exact = x.double() @ w.T
            err = ((y.double() - exact).norm() / exact.norm()).item()
            assert err < TOLERANCE[dtype], (cols, tokens, err)


def test_linear_keeps_leading_dims_and_ignores_dense():
    m, blocks = matrix(2, 40, 64)
    x = torch.randn(2, 3, 64)
    y = m.linear(x.to(DEVICE))
    assert y.shape == (2, 3, 40)
    assert torch.equal(m.linear(x.to(DEVICE), dense=True), y)
    exact = x.reshape(6, 64).double() @ torch.from_numpy(reference(2, blocks, 64)).double().T
    assert ((y.cpu().reshape(6, 40).double() - exact).norm() / exact.norm()) < 1e-5
    assert m.linear(torch.empty(0, 64, device=DEVICE)).shape == (0, 40)


@pytest.mark.parametrize("type_id", [3, 12], ids=["Q4_1", "Q4_K"])
def test_rows(type_id):
    m, blocks = matrix(type_id, 9, 256)
    ref = torch.from_numpy(reference(type_id, blocks, 256))
    ids = torch.tensor([4, 0, 8, 4])
    got = m.rows(ids)
    assert got.device == m.device and got.dtype == torch.float32
    assert torch.equal(got.cpu(), ref[ids])
    assert torch.equal(m.rows().cpu(), ref)
    assert m.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 256)
    for bad in ([9], [-1]):
        with pytest.raises(IndexError, match=r"row ids must be in \[0, 9\)"):
            m.rows(torch.tensor(bad))


def test_stack():
    a, blocks_a = matrix(14, 5, 256, seed=1)
    b, blocks_b = matrix(14, 70, 256, seed=2)
    s = TritonPackedMatrix.stack([a, b, a])
    assert s.shape == (80, 256) and s.type_name == "Q6_K"
    ref = np.concatenate([reference(14, blk, 256) for blk in (blocks_a, blocks_b, blocks_a)])
    assert np.array_equal(s.dequantize().cpu().numpy().view(np.uint32), ref.view(np.uint32))
    x = torch.randn(3, 256)
    exact = x.double() @ torch.from_numpy(ref).double().T
    assert ((s.linear(x.to(DEVICE)).cpu().double() - exact).norm() / exact.norm()) < 1e-5
    assert TritonPackedMatrix.stack([a, matrix(13, 5, 256)[0]]) is None  # types differ
    assert TritonPackedMatrix.stack([a, matrix(14, 5, 512)[0]]) is None  # widths differ


def test_attributes():
    m, _ = matrix(8, 3, 64)
    assert (m.type_id, m.type_name, m.cols, m.shape, m.paths_agree) == (8, "Q8_0", 64, (3, 64), True)
    assert repr(m) == f"TritonPackedMatrix(Q8_0, [3, 64], {m.device})"


def test_bad_blocks():
    blocks = torch.from_numpy(random_blocks(2, 4, 64))
    with pytest.raises(ValueError, match=r"Q4_0 blocks for 64 columns must be uint8 \[rows, 36\], got torch.uint8 \[4, 18\]"):
        TritonPackedMatrix.from_blocks(2, blocks[:, :18], 64, DEVICE)
    with pytest.raises(ValueError, match=r"must be uint8 \[rows, 36\], got torch.int8"):
        TritonPackedMatrix.from_blocks(2, blocks.view(torch.int8), 64, DEVICE)
    with pytest.raises(ValueError, match=r"a Q4_K row holds a multiple of 256 values, got 64"):
        TritonPackedMatrix.from_blocks(12, blocks, 64, DEVICE)
    with pytest.raises(ValueError, match=r"ggml type 10 is not supported natively"):
        TritonPackedMatrix.from_blocks(10, blocks, 64, DEVICE)


def test_bad_inputs():
    m, _ = matrix(7, 4, 64)
    expected = rf"input must be float32, bfloat16 or float16 \[\.\.\., 64\] on {m.device}"
    with pytest.raises(ValueError, match=expected + r", got torch.float64 \[2, 64\]"):
        m.linear(torch.zeros(2, 64, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=expected + r", got torch.float32 \[2, 32\]"):
        m.linear(torch.zeros(2, 32, device=DEVICE))
    with pytest.raises(ValueError, match=expected + r", got torch.float32 \[2, 64\] on meta"):
        m.linear(torch.zeros(2, 64, device="meta"))


# ---- ahead-of-time compiles for sm_90 (no GPU needed) ----

X_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def variants() -> list[tuple[int, str, int]]:
    """(type id, activation dtype, tokens): each code layout (every type) for each dtype
    with the decode tile, and each type with bf16 activations with the prefill tile."""
    return [(t, d, 1) for t in TYPES for d in X_TYPES.values()] + [(t, "bf16", 64) for t in TYPES]


def compile_variant(variant) -> None:
    """Compile ``_qlinear`` for sm_90 as ``linear`` launches it on a GPU (256 columns)."""
    type_id, dtype, tokens = variant
    layout, cols, tile = tw.LAYOUTS[type_id], 256, tw.tile(tokens)
    signature = {"x": f"*{dtype}", "codes": "*i8" if layout.signed else "*u8", "scales": "*fp32", "mins": "*fp32",
                 "out": f"*{dtype}", "M": "i32", "N": "i32"}  # fmt: skip
    constexprs = dict(K=cols, NIBBLES=layout.nibbles, GROUP=layout.group, OFFSET=layout.offset,
                      HAS_MIN=layout.has_min, NATIVE_DOT=dtype != "fp32", BLOCK_M=tile.block_m,
                      BLOCK_N=tile.block_n, BLOCK_K=tw.block_k(cols))  # fmt: skip
    signature.update({name: "constexpr" for name in constexprs})
    compile_sm90(tw._qlinear, signature, constexprs, {"num_warps": tile.warps, "num_stages": tile.stages})


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the script imports benchmarks.common
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"compiled {len(variants())} weight kernel variants for sm_90" in out.stdout


if __name__ == "__main__":
    print(f"compiled {compile_in_parallel(compile_variant, variants())} weight kernel variants for sm_90")
