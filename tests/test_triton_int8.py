"""The Triton kernels over int8 KV pages (codes + a log-scale byte per token and KV
head, rows stored rotated), read in place with the scales folded in: against dense
attention over the dequantized cache, under the interpreter on the CPU (small cases:
the interpreter pays per program and per loop step)."""

import dataclasses

import pytest
import torch

from test_attention import available, check_against_dense, dense_reference, device_for, int8_case
from radixkv.kernels import get_backend

DEVICE = device_for("triton")  # compiled Triton takes CUDA tensors; the interpreter CPU ones
triton = pytest.importorskip("triton")
tl = triton.language

from radixkv.kernels.triton_backend import _int8_to_half, _log_scale  # noqa: E402


@triton.jit
def _scales_of_bytes(b_ptr, out_ptr):
    """``out[i] = _log_scale(b[i])`` for 256 bytes."""
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, _log_scale(tl.load(b_ptr + i)))


@triton.jit
def _codes_as_half(c_ptr, out_ptr):
    """``out[i] = _int8_to_half(c[i])`` for 256 codes, in ``out``'s dtype (GPU only)."""
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, _int8_to_half(tl.load(c_ptr + i), out_ptr.dtype.element_ty))


# lens, prefixes, page size, query heads, KV heads, head dim
INT8_CASES = [
    ([1, 1, 1, 1], [0, 9, 70, 33], 1, 6, 2, 16),  # decode (split-K), page size 1
    ([1, 1, 1], [15, 40, 3], 16, 9, 3, 64),  # decode, GQA 9/3, head dim 64
    ([5, 20, 1], [40, 3, 17], 16, 6, 2, 64),  # extend over cached prefixes (and a 1-token row)
    ([9, 3], [20, 0], 1, 9, 3, 16),  # extend, page size 1
    ([30], [0], 16, 9, 3, 24),  # plain prefill; 24: a QR rotation, head dim below its block
]


def triton_backend():
    return get_backend(available("triton"), dtype=torch.int8)


def on_device(case):
    """An ``int8_case`` (built on the CPU) with its batch, queries and KV on ``DEVICE``."""
    batch, q, k, v, kv, dense_k, dense_v = case
    if DEVICE == "cpu":
        return case
    moved = {f.name: getattr(batch, f.name).to(DEVICE) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}  # fmt: skip
    kv = dataclasses.replace(kv, **{name: getattr(kv, name).to(DEVICE) for name in ("k", "v", "k_params", "v_params")})
    return dataclasses.replace(batch, **moved), q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv, dense_k, dense_v


@pytest.mark.parametrize("lens, prefixes, page_size, hq, hkv, dim", INT8_CASES)
def test_int8_matches_dequantize_then_attend(lens, prefixes, page_size, hq, hkv, dim):
    """Equal to dense attention over the dequantized cache (new tokens as stored), with
    and without a sliding window and soft cap, and within quantization error of the
    unquantized K/V."""
    case, exact_k, exact_v = int8_case(11, lens, prefixes, page_size, hq, hkv, dim)
    case = on_device(case)
    impl = triton_backend()
    out = check_against_dense(impl, case, lens, scale=dim**-0.5, tol=2e-5)
    start, q = 0, case[1].cpu()
    for n, kd, vd in zip(lens, exact_k, exact_v):
        exact = dense_reference(q[start : start + n], kd, vd, n, dim**-0.5)
        assert (out[start : start + n].cpu().double() - exact).abs().max() < 0.1
        start += n
    for window, softcap in [(8, None), (None, 5.0), (8, 5.0)]:
        check_against_dense(impl, case, lens, scale=dim**-0.5, window=window, softcap=softcap, tol=2e-5)


def test_decode_takes_its_kinds_tile():
    """Decode runs with the tile of the KV kind it reads (``DECODE_BY_KIND``): another
    block, another split count, and the answers stay those of the dense reference."""
    from radixkv.kernels.triton_backend import DecodeTile

    lens, prefixes = [1, 1, 1], [70, 9, 33]
    case = on_device(int8_case(5, lens, prefixes, 1, 6, 2, 16)[0])
    for tile, per_split, splits in ((DecodeTile(16, 4, 1, 4), 16, 4), (DecodeTile(32, 4, 2, 8), 256, 1)):
        impl = triton_backend()
        impl.DECODE_BY_KIND = {"int8": tile}
        impl.TOKENS_PER_SPLIT = per_split
        check_against_dense(impl, case, lens, scale=0.25, tol=2e-5)
        assert impl._splits(tile.max_splits) == splits  # the longest context, 71 positions, in this many


def test_int8_extend_one_query_head_per_program():
    """The extend kernel's other row layout (one query head per program, no GQA packing)."""
    lens, prefixes = [5, 20], [40, 3]
    case = on_device(int8_case(4, lens, prefixes, 16, 6, 2, 16)[0])
    impl = triton_backend()
    impl.PACK_GQA = False
    check_against_dense(impl, case, lens, scale=0.25, window=16, tol=2e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_half_queries_over_int8(dtype, tol):
    """The model's half-precision queries over an int8 cache (rotated in float32, rounded
    back to their dtype); the output in that dtype."""
    lens, prefixes = [1, 6], [20, 9]
    case = on_device(int8_case(6, lens, prefixes, 16, 6, 2, 16)[0])
    batch, q, k, v, kv, dense_k, dense_v = case
    case = (batch, q.to(dtype), k.to(dtype), v.to(dtype), kv, dense_k, dense_v)
    out = check_against_dense(triton_backend(), case, lens, scale=0.25, tol=tol)
    assert out.dtype == dtype and out.shape == q.shape


def test_computed_scales_equal_the_table_bit_for_bit():
    """The kernels compute a scale byte's value (``_log_scale``) instead of reading the
    format's table: every one of the 256 bytes gives the table's float32 exactly, so the
    kernels and the torch path scale rows alike."""
    from radixkv.cache.formats import kv_format

    table = kv_format("int8").log_scales(DEVICE)
    out = torch.full((256,), float("nan"), device=DEVICE)
    _scales_of_bytes[(1,)](torch.arange(256, dtype=torch.uint8, device=DEVICE), out)
    assert torch.equal(out.view(torch.int32), table.view(torch.int32))


@pytest.mark.skipif(DEVICE == "cpu", reason="PTX: compiled Triton on a GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codes_convert_to_half_exactly(dtype):
    """The GPU kernels turn int8 codes into the queries' half dtype with byte permutes
    (``_int8_to_half``) instead of conversion instructions: every code -128..127 comes out
    as the value itself."""
    codes = torch.arange(-128, 128, dtype=torch.int8, device=DEVICE)
    out = torch.full((256,), float("nan"), dtype=dtype, device=DEVICE)
    _codes_as_half[(1,)](codes, out)
    assert torch.equal(out, codes.to(dtype))


def test_new_tokens_are_read_as_stored():
    """The kernels read the new tokens' K/V from the pool (as stored, quantized), never
    the ``k``/``v`` arguments: a prefill over a cached prefix gives the same rows as the
    whole sequence prefilled from nothing (cache on = cache off), with garbage passed."""
    from radixkv.cache import KVPool, PoolConfig
    from radixkv.model.batch import ForwardBatch, SeqInput

    g = torch.Generator().manual_seed(2)
    page_size, hq, hkv, dim, total, new = 4, 6, 2, 16, 37, 10
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, kv_dtype="int8", num_pages=64, device=DEVICE))
    pages = pool.alloc(-(-total // page_size))
    k, v = (torch.randn(total, hkv, dim, generator=g).to(DEVICE) for _ in range(2))
    pool.store_kv(0, k * 3, v, pool.slots(pages, 0, total))
    q = torch.randn(total, hq, dim, generator=g).to(DEVICE)
    garbage = torch.full((total, hkv, dim), float("nan"), device=DEVICE)
    impl = triton_backend()
    outs = []
    for cached in (0, total - new):
        impl.plan(ForwardBatch.build([SeqInput(list(range(total - cached)), cached, pages)], page_size, DEVICE))
        outs.append(impl.forward(q[cached:], garbage[cached:], garbage[cached:], pool.view(0), 0.25))
    assert torch.isfinite(outs[1]).all()
    assert (outs[0][total - new :] - outs[1]).abs().max() < 1e-5
    k_read, v_read = (t.cpu() for t in pool.read_kv(0, pool.slots(pages, 0, total)))
    ref = dense_reference(q[total - new :].cpu(), k_read, v_read, new, 0.25)
    assert (outs[1].cpu().double() - ref).abs().max() < 2e-5


def test_registry_reads_int8_and_int4_on_triton_and_refuses_fp8():
    for dtype in (torch.int8, torch.uint8):  # int8; int4 (codes two to a uint8)
        assert get_backend("triton", dtype=dtype).name == "triton"
        assert get_backend("auto", "cuda", dtype).name == "triton"
        assert get_backend("auto", "cuda:0", dtype, torch.bfloat16).name == "triton"
        assert get_backend("auto", "cuda", dtype, torch.float32).name == "triton"
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        message = f"attention_backend 'triton' cannot read {dtype} KV yet: use torch or cpu"
        with pytest.raises(ValueError, match=message):
            get_backend("triton", dtype=dtype)
        assert get_backend("auto", "cuda", dtype, torch.float32).name == "torch"
    assert get_backend("torch", dtype=torch.uint8).name == "torch"


def test_forward_refuses_a_view_it_cannot_read():
    """Handed an fp8 view directly (no registry in between), ``forward`` says so rather
    than reading fp8 bytes as elements."""
    from test_attention import quantized_case

    lens, prefixes = [1], [5]
    case, _, _ = quantized_case(1, lens, prefixes, 4, 2, 2, 16, "fp8_e4m3")
    batch, q, k, v, kv, _, _ = case
    impl = get_backend(available("triton"))
    impl.plan(batch)
    with pytest.raises(ValueError, match="cannot read torch.float8_e4m3fn KV"):
        impl.forward(q, k, v, kv, 0.25)

