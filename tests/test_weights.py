"""Native quantized weights (``radixkv.kernels.weights``, ``--weights native``).

The kernel against gguf's own numpy dequantization (an independent implementation) on
random blocks of every type, in the AVX2 build and the portable C build; batch
invariance and the thread count; the prefill path against the kernel; the embedded
model's layers; the native model against the exact fp32 model (KL on chat prompts);
the engine's greedy contract (cache on = off, batched = alone) with native weights;
8-bit activations (the byte panels' bits, their KL against fp32, their own namespace);
weights settings and their errors; memory after load.
"""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import radixkv.kernels.weights as weights
from benchmarks.common import random_blocks  # random bytes in a type's block layout, finite fp16 scales
from radixkv.cache import KVPool, PoolConfig
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling import SamplingParams
from radixkv.kernels import get_backend
from radixkv.kernels.weights import TYPES, PackedMatrix
from radixkv.model import load_model, resolve_model
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.model.chat_template import ChatTemplate
from radixkv.model.tokenizer import Tokenizer

def reference(type_id: int, blocks: np.ndarray, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType(type_id)).reshape(-1, cols).astype(np.float64))


def rounded(x: torch.Tensor) -> torch.Tensor:
    """Activations rounded as the kernel rounds them: 16-bit codes per block of 32."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    return (torch.round(blocks / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


@pytest.mark.parametrize("portable", [False, True], ids=["native-isa", "portable"])
@pytest.mark.parametrize("type_id", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
def test_kernel_matches_dequantize_then_matmul(type_id, portable):
    # 32-value types: 11 blocks a row, so the AVX2 dot takes eight at a time and three alone
    rows, cols = 37, 512 if TYPES[type_id][1] == 256 else 352
    blocks = random_blocks(type_id, rows, cols, seed=type_id)
    w = reference(type_id, blocks, cols)
    m = PackedMatrix(type_id, torch.from_numpy(blocks), cols, portable=portable)
    assert torch.equal(m.blocks(), torch.from_numpy(blocks))  # the layout is rearranged, never changed
    assert torch.equal(m.rows().double(), w)  # dequantization: bit for bit gguf's
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(m.rows(ids).double(), w[ids])
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(type_id))
    x[0, 3] = 40.0  # an outlier channel, as real activations have
    y = m.linear(x).double()
    exact = rounded(x) @ w.T  # what the kernel computes, in float64
    assert ((y - exact).norm() / exact.norm()) < 3e-6
    assert ((y - x.double() @ w.T).norm() / exact.norm()) < 1e-4  # the rounding itself is small
    dense = m.linear(x, dense=True).double()  # the prefill path: the same product in float32
    assert ((dense - exact).norm() / exact.norm()) < 3e-6


@pytest.mark.parametrize("type_id", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
def test_a_token_gets_the_same_bits_alone_or_in_any_batch_on_any_thread_count(type_id):
    cols = 512
    m = PackedMatrix(type_id, torch.from_numpy(random_blocks(type_id, 70, cols, seed=1)), cols)
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(2))
    together = m.linear(x, threads=2)
    assert torch.equal(together, m.linear(x, threads=1))
    for i in range(len(x)):
        assert torch.equal(m.linear(x[i : i + 1], threads=2)[0], together[i])
    assert torch.equal(m.linear(x[3:9]), together[3:9])


@pytest.mark.parametrize("cols", [576, 100])  # a multiple of 16, and a tail of 4
def test_float32_decode_products_are_exact_sums_and_batch_invariant(cols):
    """The exact mode's decode-sized products (``small_matmul``): within float32 rounding
    of float64, and a token's bits the same alone, in any batch, on any thread count."""
    g = torch.Generator().manual_seed(cols)
    w, x = torch.randn(67, cols, generator=g), torch.randn(9, cols, generator=g)
    together = weights.small_matmul(x, w, threads=2)
    exact = x.double() @ w.double().T
    assert ((together.double() - exact).abs().max() / exact.abs().max()) < 1e-6
    assert torch.equal(weights.small_matmul(x, w, threads=1), together)
    for i in range(len(x)):
        assert torch.equal(weights.small_matmul(x[i : i + 1], w)[0], together[i])
    assert torch.equal(weights.small_matmul(x[2:7], w), together[2:7])


def test_the_native_steps_match_torch():
    """The C steps between a native model's products: SwiGLU (a vectorized exp, within
    float32 rounding of torch's silu, finite at the extremes, the last columns scalar),
    RMSNorm with the residual added, RoPE."""
    g = torch.Generator().manual_seed(5)
    gate = torch.cat([torch.linspace(-120, 120, 301), torch.randn(2 * 301) * 4]).reshape(3, 301)
    up = torch.randn(3, 301, generator=g)
    out = weights.Steps().silu_mul(torch.cat([gate, up], 1).contiguous())
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).abs() <= 1e-6 * expected.abs() + 1e-30).all()
    x, add, w = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    residual = x + add
    normed = weights.Steps().add_rms_norm(x, add, w, 1e-5)
    assert torch.equal(x, residual)  # the residual added in place
    expected = w * residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(normed, expected, rtol=1e-5, atol=1e-6)
    qk = torch.randn(2, 3 * 8, generator=g)
    angle = torch.randn(2, 4, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = qk.clone()
    weights.Steps().rope_(rotated, 2, 8, cos, sin)  # the first two heads of three
    heads = qk.view(2, 3, 8)
    half = torch.cat([-heads[..., 4:], heads[..., :4]], -1)
    expected = torch.cat([(heads * cos[:, None] + half * sin[:, None])[:, :2], heads[:, 2:]], 1).reshape(2, -1)
    assert torch.allclose(rotated, expected, atol=1e-6)
    partial = qk.clone()  # partial rotary (Phi-3): the first 4 of each head's 8 dims, halves of 2
    weights.Steps().rope_(partial, 3, 8, cos[:, :4], sin[:, :4])
    lead = heads[..., :4]
    swapped = torch.cat([-lead[..., 2:], lead[..., :2]], -1)
    expected = torch.cat([lead * cos[:, None, :4] + swapped * sin[:, None, :4], heads[..., 4:]], -1).reshape(2, -1)
    assert torch.allclose(partial, expected, atol=1e-6)
    qk_normed = qk.clone()  # q/k norms (Qwen3): 2 query heads with one weight, the next with the other
    qn, kn = torch.randn(8, generator=g), torch.randn(8, generator=g)
    weights.Steps().qk_norm_(qk_normed, (2, 1), 8, qn, kn, 1e-6)
    rms = torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (heads * rms * torch.stack([qn, qn, kn])).reshape(2, -1)
    assert torch.allclose(qk_normed, expected, rtol=1e-5, atol=1e-6)


def test_the_thread_count_is_honoured():
    m = PackedMatrix(3, torch.from_numpy(random_blocks(3, 64, 256)), 256)
    for threads in (1, 2, 3):
        m.linear(torch.randn(2, 256), threads=threads)
        assert m._lib.radixkv_qmatmul_last_threads() == threads


@pytest.mark.parametrize("cols", [512, 352])  # whole groups of eight blocks, and 11 blocks (a group of three)
def test_the_prefill_path_computes_the_same_product(cols):
    """From DENSE_FROM tokens on, panels of 16 rows and tiles of 6 tokens: integer codes for
    the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), the kernel's float steps in the
    kernel's order, so the kernel's bits; rounded activations times dequantized weights in
    float32 for the K-quants (Q6_K), float32 rounding away from the kernel's result. Both
    within float32 rounding of a float64 product of the same operands, and batch-invariant:
    every token's row the same bits alone, in a partial tile and in any batch (301 rows: a
    partial panel, and an odd last row beside the kernel's pairs of rows; 1 and 2 threads),
    and the portable build's the same bits."""
    k_quants = (14,) if cols % 256 == 0 else ()  # Q6_K's blocks hold 256 values
    for type_id in (2, 3, 6, 7, 8, *k_quants):  # the 32-value types through the integer panels, Q6_K through float32
        m = PackedMatrix(type_id, torch.from_numpy(random_blocks(type_id, 301, cols)), cols)
        x = torch.randn(weights.DENSE_FROM + 5, cols)
        kernel = torch.cat([m.linear(x[i : i + 1]) for i in range(len(x))])
        dense = m.linear(x)
        if TYPES[type_id][1] == 32:
            assert torch.equal(dense, kernel)  # either path, the same bits: decode rows may take the panels
            assert torch.equal(m.linear(x[:9], dense=False), kernel[:9])  # the kernel's call on panels (9 >= 8 rows)
            assert torch.equal(m.linear(x[:5], dense=False), kernel[:5])  # and on its own loop
        else:
            assert ((dense - kernel).norm() / kernel.norm()) < 2e-6
        rounded = torch.empty_like(x)
        m._lib.radixkv_round_activations(x.data_ptr(), len(x), cols, rounded.data_ptr(), m.act_max, 1)
        exact = rounded.double() @ m.rows().double().t()
        assert ((dense.double() - exact).norm() / exact.norm()) < 1e-6
        for i in (0, 7, len(x) - 1):
            assert torch.equal(m.linear(x[i : i + 1], dense=True)[0], dense[i])
        assert torch.equal(m.linear(x[3:11], dense=True, threads=1), dense[3:11])
        assert torch.equal(m.linear(x[:4], dense=True, threads=2), dense[:4])
        # the portable loops take the same steps (fmaf: one rounding, as the AVX2 lanes)
        portable = PackedMatrix(type_id, m.blocks(), cols, portable=True)
        assert torch.equal(portable.linear(x, dense=True), dense)
        if TYPES[type_id][1] == 32:
            assert torch.equal(portable.linear(x[:3], dense=False), kernel[:3])


def panels_built() -> bool:
    return weights.load_library().radixkv_panel_bytes(3 | weights.PANELS, 16, 32) > 0


@pytest.mark.skipif(not panels_built(), reason="this build has no stored panels (they need AVX2 and F16C)")
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("type_id", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_stored_panels_hold_the_blocks_and_give_the_split_layouts_bits(type_id, bits):
    """Q4_0, Q4_1 and Q8_0 are stored as panels by default (the 4-bit types at 8-bit
    activations in the byte tiles' order): the same blocks (GGUF's bytes back, the same
    rows dequantized) and, at every batch size on either path, the same bits as the split
    layout, whose tiles they replace (37 rows: a partial last panel; 11 blocks a row; from
    48 tokens the threads claim the panels' tiles 96 tokens at a time: 203 is two whole
    spans and a part)."""
    rows, cols = 37, 352
    blocks = torch.from_numpy(random_blocks(type_id, rows, cols, seed=7))
    panels = PackedMatrix(type_id, blocks, cols, activation_bits=bits)
    split = PackedMatrix(type_id, blocks, cols, activation_bits=bits, layout="split")
    assert (panels.layout, split.layout) == ("panels", "split")
    assert torch.equal(panels.blocks(), blocks)
    assert panels.data.numel() == -(-rows // 16) * 16 * (cols // 32) * TYPES[type_id][2]  # ggml's bytes, padded rows
    ids = torch.tensor([36, 0, 17, 36])
    assert torch.equal(panels.rows(), split.rows()) and torch.equal(panels.rows(ids), split.rows(ids))
    x = torch.randn(203, cols, generator=torch.Generator().manual_seed(3))
    x[:, 5] *= 50  # an outlier channel
    for n in (1, 2, 5, 6, 7, 8, 13, weights.DENSE_FROM + 3, 47, 48, 96, 97, len(x)):
        for dense in (False, True):
            assert torch.equal(panels.linear(x[:n], dense=dense), split.linear(x[:n], dense=dense)), (n, dense)
    # stacking: whole panels are concatenated, a partial one goes back through the blocks
    whole = PackedMatrix(type_id, torch.from_numpy(random_blocks(type_id, 32, cols, seed=8)), cols, activation_bits=bits)
    for parts in ([whole, panels], [panels, whole]):
        stacked = PackedMatrix.stack(parts)
        assert stacked.layout == "panels" and stacked.shape == (69, cols)
        assert torch.equal(stacked.blocks(), torch.cat([p.blocks() for p in parts]))
        assert torch.equal(stacked.linear(x[:3]), torch.cat([p.linear(x[:3]) for p in parts], dim=1))


@pytest.mark.skipif("avx512_vnni" not in weights.build.cpu_id().split(), reason="the zmm tiles need AVX512-VNNI")
def test_the_avx512_tiles_give_the_avx2_tiles_bits(monkeypatch):
    """With AVX512-VNNI the byte tiles take 16 rows a zmm (vpdpbusd) and go lane by lane,
    and the 16-bit tiles sum pairs with vpdpwssd; built without AVX-512 (-mno-avx512f: the
    AVX2 tiles, pmaddubsw and pmaddwd) every product is the same bits, at 8- and 16-bit
    activations, on the stored panels (Q4_0, Q4_1, Q8_0) and the split layout's panels
    (Q5_0, Q5_1), from one token to spans of 96 that the threads claim (37 rows: a partial
    panel; 11 blocks: lanes of one and two blocks)."""
    rows, cols = 37, 352
    x = torch.randn(203, cols, generator=torch.Generator().manual_seed(5))
    x[:, 9] *= 40  # an outlier channel
    blocks = {t: torch.from_numpy(random_blocks(t, rows, cols, seed=t)) for t in (2, 3, 8, 6, 7)}
    cases = [(t, bits) for bits in (8, 16) for t in blocks]
    native = {c: PackedMatrix(c[0], blocks[c[0]], cols, activation_bits=c[1]) for c in cases}
    monkeypatch.setattr(weights, "FLAGS", weights.FLAGS + ("-mno-avx512f",))
    monkeypatch.setattr(weights, "_libraries", {})
    avx2 = {c: PackedMatrix(c[0], blocks[c[0]], cols, activation_bits=c[1]) for c in cases}
    assert avx2[(3, 8)]._lib is not native[(3, 8)]._lib
    assert [m.layout for m in avx2.values()] == [m.layout for m in native.values()] == (["panels"] * 3 + ["split"] * 2) * 2
    for c in cases:
        for n in (1, 6, 7, weights.DENSE_FROM + 3, 97, len(x)):
            assert torch.equal(avx2[c].linear(x[:n], dense=True), native[c].linear(x[:n], dense=True)), (c, n)
            assert torch.equal(avx2[c].linear(x[:n], dense=False), native[c].linear(x[:n], dense=False)), (c, n)


@pytest.mark.skipif(not panels_built(), reason="this build has no stored panels (they need AVX2 and F16C)")
def test_a_matrix_that_cannot_be_panels_keeps_the_split_layout_or_says_why():
    for type_id, bits in ((6, 16), (7, 8)):  # Q5_0, Q5_1 (their fifth bits: the split layout's byte panels)
        blk = torch.from_numpy(random_blocks(type_id, 3, 64))
        assert PackedMatrix(type_id, blk, 64, activation_bits=bits).layout == "split"
        with pytest.raises(ValueError, match="cannot be stored as panels"):
            PackedMatrix(type_id, blk, 64, activation_bits=bits, layout="panels")
    with pytest.raises(ValueError, match="layout must be one of split, panels"):
        PackedMatrix(3, torch.from_numpy(random_blocks(3, 3, 64)), 64, layout="rows")


@pytest.mark.parametrize("cols", [512, 352])
def test_eight_bit_activations_keep_every_path_on_the_same_bits(cols):
    """activation_bits 8 rounds inputs to codes within +-127 per block of 32 (llama.cpp's
    activation precision). The Q4 and Q5 types then take byte panels on AVX2 (pmaddubsw on the
    codes as bytes), the other 32-value types the 16-bit panels with those codes; every
    path's integer sums are exact, so the panels, the kernel, the portable build and any
    batch give a token the same bits, within float32 rounding of the float64 product of
    the 8-bit-rounded activations, and further from the unrounded product than 16-bit's."""
    k_quants = (14,) if cols % 256 == 0 else ()
    x = torch.randn(weights.DENSE_FROM + 9, cols, generator=torch.Generator().manual_seed(cols))
    x[1, 5] = 30.0  # an outlier channel: its block's other codes get coarse
    for type_id in (2, 3, 6, 7, 8, *k_quants):
        blocks = torch.from_numpy(random_blocks(type_id, 301, cols, seed=type_id))
        m8, m16 = PackedMatrix(type_id, blocks, cols, activation_bits=8), PackedMatrix(type_id, blocks, cols)
        assert (m8.act_max, m16.act_max) == (127, 32767)
        dense = m8.linear(x)
        kernel = torch.cat([m8.linear(x[i : i + 1]) for i in range(len(x))])
        if TYPES[type_id][1] == 32:
            assert torch.equal(dense, kernel)
            assert torch.equal(m8.linear(x[:9], dense=False), kernel[:9])
        codes = torch.empty_like(x)
        m8._lib.radixkv_round_activations(x.data_ptr(), len(x), cols, codes.data_ptr(), m8.act_max, 1)
        d = x.double().reshape(len(x), -1, 32).abs().amax(-1, keepdim=True) / 127
        q = torch.round(x.double().reshape(len(x), -1, 32) / d)
        assert q.abs().max() <= 127 and (codes.double() - (q * d).reshape(x.shape)).abs().max() < 1e-6
        w = m8.rows().double()
        exact = codes.double() @ w.t()
        assert ((dense.double() - exact).norm() / exact.norm()) < 1e-6
        unrounded = x.double() @ w.t()
        err8 = (dense.double() - unrounded).norm() / unrounded.norm()
        err16 = (m16.linear(x).double() - unrounded).norm() / unrounded.norm()
        assert err16 * 20 < err8 < 2e-2  # 8-bit codes: coarser, still close
        for i in (0, 1, len(x) - 1):
            assert torch.equal(m8.linear(x[i : i + 1], dense=True)[0], dense[i])
        assert torch.equal(m8.linear(x[3:17], dense=True, threads=1), dense[3:17])
        portable = PackedMatrix(type_id, blocks, cols, portable=True, activation_bits=8)
        assert torch.equal(portable.linear(x, dense=True), dense)
        stacked = PackedMatrix.stack([m8, m8])
        assert stacked.activation_bits == 8 and torch.equal(stacked.linear(x)[:, :301], dense)
        assert PackedMatrix.stack([m8, m16]) is None  # never one matrix of two precisions
    with pytest.raises(ValueError, match="activation_bits must be one of 16, 8, got 4"):
        PackedMatrix(3, torch.from_numpy(random_blocks(3, 4, 64)), 64, activation_bits=4)


# where each type's codes lie in a GGUF block: (first byte, last byte + 1) of qh (5-bit types) and qs
CODE_BYTES = {2: [(2, 18)], 3: [(4, 20)], 6: [(2, 22)], 7: [(4, 24)]}


def test_the_byte_panels_hold_the_largest_sums_without_overflow():
    """Every code at its largest (15, or 31 for Q5) against every activation code at 127:
    a block's sums are the 16-bit lanes' worst case (Q4: 30,480, within int16; Q5: twice
    that, which the byte tile widens halfway). The byte panels must still give the 16-bit
    kernel's bits."""
    cols = 256
    x = torch.full((weights.DENSE_FROM + 1, cols), 0.75)
    x[1] = -0.75
    for type_id, spans in CODE_BYTES.items():
        blocks = random_blocks(type_id, 32, cols, seed=type_id).reshape(32, cols // 32, -1)
        for a, b in spans:
            blocks[:, :, a:b] = 0xFF
        m8 = PackedMatrix(type_id, torch.from_numpy(blocks.reshape(32, -1)), cols, activation_bits=8)
        assert int(m8.blocks().view(32, cols // 32, -1)[0, 0, spans[0][0]]) == 0xFF
        kernel = torch.cat([m8.linear(x[i : i + 1]) for i in range(len(x))])  # 16-bit madd on the same codes
        assert torch.equal(m8.linear(x, dense=True), kernel)


def test_bad_input_is_refused_with_its_limits():
    with pytest.raises(ValueError, match="not supported natively"):
        PackedMatrix(10, torch.zeros(2, 84, dtype=torch.uint8), 256)  # Q2_K
    with pytest.raises(ValueError, match="multiple of 256"):
        weights.row_bytes(12, 300)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 20\]"):
        PackedMatrix(3, torch.zeros(2, 21, dtype=torch.uint8), 32)
    m = PackedMatrix(3, torch.from_numpy(random_blocks(3, 4, 64)), 64)
    with pytest.raises(ValueError, match=r"float32 \[\.\.\., 64\]"):
        m.linear(torch.zeros(2, 32))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        m.rows(torch.tensor([4]))


# ---------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def native():
    return load_model(native=True)


@pytest.fixture(scope="module")
def exact():
    return load_model()


def test_embedded_layers_match_their_dequantized_weights(native, exact):
    """Every packed matrix of layer 0 and the Q8_0 head (tied to the embedding) against
    the fp32 model's expanded copy of the same file."""
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for packed, dense in [(native.layers[0].qkv, exact.layers[0].qkv), (native.layers[0].o, exact.layers[0].o),
                          (native.layers[0].gate_up, exact.layers[0].gate_up), (native.lm_head, exact.lm_head)]:  # fmt: skip
        assert isinstance(packed, PackedMatrix)
        assert torch.equal(packed.rows(), dense)  # the same values, rows reordered as the loader reorders them
        assert (packed.linear(x) - x @ dense.T).norm() / (x @ dense.T).norm() < 1e-4
    h = torch.randn(3, 1536)
    y, ref = native.layers[0].down.linear(h), h @ exact.layers[0].down.T
    assert (y - ref).norm() / ref.norm() < 1e-4
    assert native.lm_head is native.embed  # one copy of the tied embedding and head
    assert {t.type_name for t in (native.layers[0].qkv, native.embed)} == {"Q4_1", "Q8_0"}


CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child in two "
         "sentences.", "List three prime numbers."]  # fmt: skip
KL_BOUND = 1e-4  # native vs fp32 weights, per next-token distribution (README states it)


@functools.cache
def chat_ids(question: str) -> list[int]:
    source = resolve_model("smollm2-135m-instruct")
    tok = Tokenizer.load(source)
    return ChatTemplate.from_tokenizer(tok).encode(tok, [{"role": "user", "content": question}],
                                                   add_generation_prompt=True)  # fmt: skip


def all_logits(model, ids):
    c = model.config
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=64))
    table = pool.alloc(-(-len(ids) // 16))
    return model.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 16), pool, get_backend("torch"), all_logits=True)


@pytest.mark.parametrize("backend, kv_dtype, bits", [("auto", "fp32", 16), ("auto", "bf16", 16), ("auto", "fp16", 16),
                                                     ("auto", "int8", 16), ("torch", "fp32", 16), ("auto", "bf16", 8)])  # fmt: skip
def test_a_step_in_one_call_gives_the_bits_of_the_layer_loop(request, backend, kv_dtype, bits, monkeypatch):
    """A native model's steps skip the Python layer loop: over float32, bfloat16 or half
    pages with the CPU attention kernels the whole step is one C call (its K/V stores
    round to 16 bits as torch does), whether it holds prefills (only their last rows past
    the last layer), decode rows, extends read on every row or decode rows beside an
    extend; else one C call per layer's stretch between attentions. Both must give the
    bits of the step-by-step loop: every step's logits and the KV written. With 8-bit
    activations too (each norm and SwiGLU row rounded into the byte tiles' order as it is
    computed, where the loop rounds a product's whole input)."""
    native = request.getfixturevalue("native") if bits == 16 else load_model(native=True, activation_bits=8)
    c = native.config
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (20, 33, 7)]
    runs, whole_steps = [], []
    steps = native._steps
    monkeypatch.setattr(steps, "native_forward", lambda *a, f=steps.native_forward: whole_steps.append(1) or f(*a))
    assert native._one_call_layers  # the embedded model takes the one-call paths
    for one_call in (True, False):
        native._one_call_layers = one_call
        pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, kv_dtype=kv_dtype, num_pages=16))
        tables = [pool.alloc(4) for _ in prompts]
        first = native.forward(ForwardBatch.build([SeqInput(p, 0, t) for p, t in zip(prompts, tables)], 16), pool,
                               get_backend(backend))  # fmt: skip
        tokens, logits = [1, 2, 3], []
        for step in range(3):
            seqs = [SeqInput([tok], len(p) + step, t) for tok, p, t in zip(tokens, prompts, tables)]
            logits.append(native.forward(ForwardBatch.build(seqs, 16), pool, get_backend(backend)))
            tokens = logits[-1].argmax(-1).tolist()
        seqs = [SeqInput([tok, 5, 6, 7, 8], len(p) + 3, t) for tok, p, t in zip(tokens, prompts, tables)]
        extend = native.forward(ForwardBatch.build(seqs, 16), pool, get_backend(backend), all_logits=True)
        # decode rows beside extends, the extends' last rows alone past the last layer
        seqs = [SeqInput([9], len(prompts[0]) + 8, tables[0]), SeqInput([10, 11, 12], len(prompts[1]) + 8, tables[1]),
                SeqInput([13], len(prompts[2]) + 8, tables[2])]  # fmt: skip
        mixed = native.forward(ForwardBatch.build(seqs, 16), pool, get_backend(backend))
        seqs[0], seqs[2] = SeqInput([14, 15], len(prompts[0]) + 9, tables[0]), SeqInput([16], len(prompts[2]) + 9, tables[2])
        mixed2 = native.forward(ForwardBatch.build(seqs[::2], 16), pool, get_backend(backend))
        runs.append((torch.cat([first, torch.cat(logits), extend, mixed, mixed2]),
                     pool.read_pages(np.concatenate(tables))))  # fmt: skip
        pool.decref(np.concatenate(tables))
        pool.check_integrity()
        native._one_call_layers = True
    assert len(whole_steps) == (7 if backend == "auto" and kv_dtype in ("fp32", "bf16", "fp16") else 0)
    assert torch.equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])


def test_a_mixed_batch_is_one_product_where_both_paths_give_the_same_bits(native, monkeypatch):
    """A batch of decode rows beside an extend: for the 32-value types (the embedded
    model's Q4_1 and Q8_0) every row goes through the panels in one product, and each
    sequence's logits and KV are the bits it gets alone; a K-quant's rows are still split
    by sequence (its two paths round differently)."""
    from radixkv.model import llama

    c = native.config
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (40, 21)]
    extend = rng.integers(0, c.vocab_size, 37).tolist()
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=64))
    tables = [pool.alloc(4) for _ in prompts]
    native.forward(ForwardBatch.build([SeqInput(p, 0, t) for p, t in zip(prompts, tables)], 16), pool)
    decode = [SeqInput([7], len(p), t) for p, t in zip(prompts, tables)]
    alone = [native.forward(ForwardBatch.build([s], 16), pool) for s in decode]
    ext_table = pool.alloc(3)
    ext_alone = native.forward(ForwardBatch.build([SeqInput(extend, 0, ext_table)], 16), pool)
    kv_alone = pool.read_pages(np.concatenate([*tables, ext_table]))
    calls, stretches = [], []
    monkeypatch.setattr(weights.PackedMatrix, "linear", lambda self, x, threads=None, dense=None,
                        f=weights.PackedMatrix.linear: calls.append((len(x), dense)) or f(self, x, threads, dense))  # fmt: skip
    steps = native._steps
    monkeypatch.setattr(steps, "native_layer", lambda x, *a, f=steps.native_layer: stretches.append(len(x)) or f(x, *a))
    assert native._no_routing
    for one_call in (True, False):  # a layer's stretch in one C call, or step by step
        monkeypatch.setattr(native, "_no_routing", one_call)
        calls.clear(), stretches.clear()
        mixed = native.forward(ForwardBatch.build([*decode, SeqInput(extend, 0, ext_table)], 16), pool)
        assert torch.equal(mixed, torch.cat([*alone, ext_alone]))
        assert np.array_equal(pool.read_pages(np.concatenate([*tables, ext_table])), kv_alone)
        layer_calls = calls[:-1]  # the head takes one row per sequence
        if one_call:  # every row of the batch in each stretch, the last one past its attention: the rows read
            assert layer_calls == [] and stretches == [len(extend) + 2] * c.num_layers + [3]
            continue
        assert len(layer_calls) == 4 * c.num_layers and set(layer_calls[:-3]) == {(len(extend) + 2, True)}
        assert layer_calls[-3:] == [(3, True)] * 3  # the last layer past its attention: the rows read
    pool.decref(np.concatenate([*tables, ext_table]))
    pool.check_integrity()
    # the K-quants: the same batch shape, rows routed by their own sequence
    q6 = PackedMatrix(14, torch.from_numpy(random_blocks(14, 48, 256)), 256)
    assert not llama._paths_agree(q6) and llama._paths_agree(native.layers[0].qkv)
    assert not llama._paths_agree(llama.Stacked([native.layers[0].o, q6])) and not llama._paths_agree(torch.ones(2, 2))
    x = torch.randn(len(extend) + 2, 256, generator=torch.Generator().manual_seed(1))
    routed = llama._routed_linear(ForwardBatch.build([*decode, SeqInput(extend, 0, ext_table)], 16))(x, q6)
    assert torch.equal(routed[:2], q6.linear(x[:2], dense=False)) and torch.equal(routed[2:], q6.linear(x[2:], dense=True))
    assert not torch.equal(q6.linear(x, dense=True)[:2], routed[:2])  # the two paths differ for it


def test_a_layer_stretch_keeps_its_buffers_from_call_to_call(native):
    """A prefill's stretch buffers (tens of MB at a 2,048-token step) are kept by the
    model's steps and grown only when a larger batch needs more, not mapped afresh (and
    faulted in again) at every layer; a smaller batch reuses them, with its own bits."""
    c = native.config
    steps, rng = native._steps, np.random.default_rng(4)
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=16))

    def prefill(n):
        table = pool.alloc((n + 15) // 16)
        ids = rng.integers(0, c.vocab_size, n).tolist()
        logits = native.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 16), pool)
        pool.decref(table)
        return ids, logits

    prefill(100)
    need = 100 * (2 * c.hidden_size + 3 * c.intermediate_size)
    assert steps._scratch.numel() == need
    kept = steps._scratch.data_ptr()
    ids, small = prefill(40)
    assert steps._scratch.data_ptr() == kept and steps._scratch.numel() == need
    steps._scratch = torch.empty(0)  # the same prefill with buffers of its own size
    table = pool.alloc(3)
    assert torch.equal(native.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 16), pool), small)
    pool.decref(table)
    pool.check_integrity()


@pytest.mark.parametrize("mode", ["step", "stretch", "loop"])
def test_the_last_layer_past_attention_runs_only_the_rows_whose_logits_are_read(native, monkeypatch, mode):
    """Every new token's K/V is written in every layer, but only a sequence's last row is
    read past the last layer: its attention (the CPU kernels), output projection and MLP
    take those rows alone (a decode row, an extend's last, a prefill's last), and the
    logits are the bits every row's forward gives those rows; the pool's pages are the
    same too. Whether the whole step is one C call, a layer's stretch between attentions
    is one, or the steps go one by one."""
    c = native.config
    monkeypatch.setattr(native, "_no_routing", mode != "loop")
    backend = get_backend("cpu")
    if mode == "stretch":  # no kernels for the model to call itself: a call per stretch
        monkeypatch.setattr(backend, "step_kernels", lambda kv, q_heads: None)
    attended = []  # rows of each attention call
    monkeypatch.setattr(type(backend), "forward", lambda self, q, *a, f=type(backend).forward, **kw:
                        attended.append(len(q)) or f(self, q, *a, **kw))  # fmt: skip
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (40, 70, 33)]

    def run(all_rows: bool):
        pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, num_pages=32))
        tables = [pool.alloc(5) for _ in prompts]
        cached = [SeqInput(prompts[0][:-1], 0, tables[0]), SeqInput(prompts[1][:30], 0, tables[1])]
        native.forward(ForwardBatch.build(cached, 16), pool, backend)
        seqs = [SeqInput(prompts[0][-1:], 39, tables[0]), SeqInput(prompts[1][30:], 30, tables[1]),
                SeqInput(prompts[2], 0, tables[2])]  # a decode row, an extend, a prefill
        batch = ForwardBatch.build(seqs, 16)
        calls.clear()
        attended.clear()
        logits = native.forward(batch, pool, backend, all_logits=all_rows)
        kv = pool.read_pages(np.concatenate(tables))
        pool.decref(np.concatenate(tables))
        pool.check_integrity()
        return (logits[(batch.qo_indptr[1:] - 1).long()] if all_rows else logits), kv, list(calls), list(attended)

    calls = []  # rows of each product called from Python, or of each one-call stretch or step
    monkeypatch.setattr(weights.PackedMatrix, "linear", lambda self, x, threads=None, dense=None,
                        f=weights.PackedMatrix.linear: calls.append(len(x)) or f(self, x, threads, dense))  # fmt: skip
    steps = native._steps
    monkeypatch.setattr(steps, "native_layer", lambda x, *a, f=steps.native_layer: calls.append(("stretch", len(x)))
                        or f(x, *a))  # fmt: skip
    monkeypatch.setattr(steps, "native_forward", lambda x, *a, f=steps.native_forward: calls.append(
        ("step", len(x), None if a[-1] is None else len(a[-1]))) or f(x, *a))  # fmt: skip
    read, kv_read, calls_read, attended_read = run(False)
    every, kv_every, calls_every, attended_every = run(True)
    assert torch.equal(read, every) and np.array_equal(kv_read, kv_every)
    rows = 1 + 40 + 33
    if mode == "step":  # the attention kernels called from C; then the head
        assert attended_every == attended_read == []
        assert calls_every == [("step", rows, None), rows] and calls_read == [("step", rows, 3), 3]
        assert read.shape[0] == 3
        return
    assert attended_every == [rows] * c.num_layers
    assert attended_read == [rows] * (c.num_layers - 1)  # the last layer's three rows: forward_rows, in the kernels
    if mode == "stretch":  # the first layer's norm and q/k/v, each stretch after an attention; the head
        assert calls_every == [("stretch", rows)] * (c.num_layers + 1) + [rows]
        assert calls_read == [("stretch", rows)] * c.num_layers + [("stretch", 3), 3]
        return
    assert calls_every[: 4 * c.num_layers] == [rows] * (4 * c.num_layers)
    assert calls_read == [rows] * (4 * c.num_layers - 3) + [3, 3, 3] + [3]  # the last o, gate_up, down; the head


# activation_bits 8 against fp32 weights (README states them): per next-token distribution over the chat
# prompts' positions, the mean KL and the largest, and the share of positions whose argmax agrees
KL_ACT8_MEAN, KL_ACT8_MAX, TOP1_ACT8 = 2e-2, 0.1, 0.85


def test_eight_bit_activations_stay_within_their_stated_kl_of_fp32(exact):
    n8 = load_model(native=True, activation_bits=8)
    kls, agree = [], []
    for q in CHATS:
        ids = chat_ids(q)
        p = torch.log_softmax(all_logits(exact, ids).double(), -1)
        r = torch.log_softmax(all_logits(n8, ids).double(), -1)
        kls.append((p.exp() * (p - r)).sum(-1))
        agree.append(p.argmax(-1) == r.argmax(-1))
    kl, agree = torch.cat(kls), torch.cat(agree).double()
    assert float(kl.mean()) < KL_ACT8_MEAN and float(kl.max()) < KL_ACT8_MAX and float(agree.mean()) >= TOP1_ACT8
    assert float(kl.mean()) > 10 * KL_BOUND  # the coarser mode: 16-bit codes stay below KL_BOUND everywhere


def test_native_logits_stay_within_the_stated_kl_of_fp32(native, exact):
    worst = 0.0
    for q in CHATS:
        ids = chat_ids(q)
        p = torch.log_softmax(all_logits(exact, ids).double(), -1)
        r = torch.log_softmax(all_logits(native, ids).double(), -1)
        kl = (p.exp() * (p - r)).sum(-1)
        worst = max(worst, float(kl.max()))
        assert int(p[-1].argmax()) == int(r[-1].argmax())
    assert worst < KL_BOUND


# ---------------------------------------------------------------- the engine


def test_auto_runs_the_quantized_gguf_natively_and_fp32_stays_exact():
    source = resolve_model("smollm2-135m-instruct")
    assert EngineConfig().native_weights(source)
    assert not EngineConfig(weights="fp32").native_weights(source)
    assert not EngineConfig(dtype="bfloat16").native_weights(source)  # auto expands where native cannot run
    assert EngineConfig(weights="bf16").dtype == "bfloat16"


@pytest.mark.parametrize("settings, match", [
    ({"weights": "int4"}, "weights must be one of auto, native, fp32, bf16, fp16"),
    ({"weights": "native", "dtype": "bfloat16"}, "weights native computes in float32 on the CPU"),
    ({"weights": "native", "device": "mps"}, "float32, bfloat16, float16 on a CUDA device, not float32 on mps"),
    ({"weights": "native", "tp": 3}, "weights native does not support tp > 1"),
    ({"weights": "fp32", "dtype": "bfloat16"}, "weights fp32 expands the weights to float32, but dtype is bfloat16"),
    ({"activation_bits": 12}, "activation_bits must be one of 16, 8, got 12"),
    ({"activation_bits": 8, "weights": "fp32"}, "activation_bits 8 needs weights native .or auto. on the CPU"),
    ({"activation_bits": 8, "device": "cuda"}, "activation_bits 8 needs weights native .or auto. on the CPU"),
])  # fmt: skip
def test_weights_settings_errors_name_the_field(settings, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**settings)


def test_eight_bit_activations_need_native_weights_and_name_their_own_pages():
    with pytest.raises(ValueError, match="activation_bits 8 needs weights native on the CPU"):
        load_model(activation_bits=8)
    with pytest.raises(ValueError, match="activation_bits 8 needs native weights"):
        Engine(activation_bits=8, dtype="bfloat16")  # auto expands a bfloat16 model: nothing rounds activations
    from radixkv.cache.tiers import weights_fingerprint

    n8, n16 = load_model(native=True, activation_bits=8), load_model(native=True)
    assert n8.activation_bits == 8 and n8.weights_summary()["activation_bits"] == 8
    assert weights_fingerprint(n8) != weights_fingerprint(n16)  # the same blocks, other KV: never one namespace


def test_one_checkpoint_has_one_fingerprint_whatever_layout_its_matrices_take():
    """A CPU whose kernels store matrices as panels and one that keeps GGUF's rows (the
    portable build) compute the same values from the same file: their pages share a key."""
    import copy
    from dataclasses import fields, replace

    from radixkv.cache.tiers import weights_fingerprint
    from radixkv.model.llama import Stacked

    def as_rows(m):  # a new matrix in the split layout; the loaded (shared, cached) model stays as it is
        if isinstance(m, Stacked):
            return Stacked([as_rows(p) for p in m.parts])
        if not isinstance(m, PackedMatrix):
            return m
        return PackedMatrix(m.type_id, m.blocks(), m.cols, activation_bits=m.activation_bits, layout="split")

    panels = load_model(native=True)
    rows = copy.copy(panels)
    rows.embed = as_rows(panels.embed)
    rows.lm_head = rows.embed if panels.lm_head is panels.embed else as_rows(panels.lm_head)
    rows.layers = [replace(layer, **{f.name: as_rows(getattr(layer, f.name)) for f in fields(layer)})
                   for layer in panels.layers]  # fmt: skip
    stored = dict(panels.tensors()), dict(rows.tensors())
    assert stored[0].keys() == stored[1].keys()
    moved = [k for k in stored[0] if not torch.equal(stored[0][k], stored[1][k])]
    if panels.layers[3].o.layout == "panels":  # this CPU's kernels: other bytes, the same values
        assert len(moved) >= 4 * len(panels.layers)
    assert weights_fingerprint(panels) == weights_fingerprint(rows)
    rows.layers[3].o.data[0, 0] ^= 1  # one weight's bits (of the copy's own matrix): another model
    assert weights_fingerprint(panels) != weights_fingerprint(rows)


def test_native_weights_refuse_a_model_that_is_not_gguf(tmp_path):
    from tests.test_model_hf_dir import write_checkpoint

    write_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(tmp_path, native=True)
    assert not EngineConfig().native_weights(resolve_model(str(tmp_path)))  # auto expands it


@pytest.mark.parametrize("activation_bits", [16, 8])
def test_greedy_tokens_with_native_weights_do_not_depend_on_cache_or_batch(activation_bits):
    prompts = [chat_ids(q) for q in CHATS[:3]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    settings = dict(kv_cache_tokens=4096, page_size=4, activation_bits=activation_bits)
    with Engine(**settings, enable_prefix_cache=False) as cold:
        alone = [cold.generate(p, greedy).outputs[0].token_ids for p in prompts]
    with Engine(**settings) as warm:
        assert warm.model.native and warm.stats()["weights"]["mode"] == "native"
        assert warm.stats()["weights"]["activation_bits"] == activation_bits
        # a cached prefix, then an extend shorter than DENSE_FROM; one token sampled, so the tree
        # holds the prompt's own KV only (generated tokens' KV is a decode row's: the model
        # may well generate this prompt's last three tokens, whose cold bits are a prefill's)
        warm.generate(prompts[0][:-3], SamplingParams(max_new_tokens=1, temperature=0))
        batched = [o.outputs[0].token_ids for o in warm.generate(prompts, greedy)]
        again = [warm.generate(p, greedy) for p in prompts]
        warm.check_integrity()
    assert batched == alone
    assert [o.outputs[0].token_ids for o in again] == alone
    assert all(o.cached_tokens > 0 for o in again)


def test_rss_after_loading_native_weights_stays_near_the_packed_bytes():
    """A fresh process: torch imported, then the native model loaded. What loading adds
    stays within the packed weights' bytes + 40 MB (no float copy of any matrix), and the
    file is no longer mapped (its pages would count too)."""
    code = """
import json
import torch
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
before = rss()
from radixkv.model import load_model, resolve_model
m = load_model(native=True)
packed = sum(t.numel() * t.element_size() for _, t in m.tensors())
mapped = str(resolve_model("smollm2-135m-instruct").path) in open("/proc/self/maps").read()
print(json.dumps({"before": before, "after": rss(), "weights": packed, "mapped": mapped}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["weights"] < 120e6  # 4.5 to 8.5 bits a weight for 135M weights (fp32 would be 540 MB)
    assert r["after"] - r["before"] < r["weights"] + 40e6, r
    assert not r["mapped"]
