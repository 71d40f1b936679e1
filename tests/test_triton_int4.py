"""The Triton kernels over int4 pages (quantized on seal: 4-bit codes two to a byte, K's
scale and offset per channel of a page, V's per token; ``int4`` rotated, ``int4_norot``
not), read in place in tiles, each query's own page in full precision from staging and
this call's K/V: equal to the torch reference (``attend_paged``) over the same pool,
under the interpreter on the CPU (small cases: the interpreter pays per program and per
loop step)."""

import pytest
import torch

from test_attention import available, dense_reference, device_for
from radixkv.kernels import get_backend

DEVICE = device_for("triton")  # compiled Triton takes CUDA tensors; the interpreter CPU ones

# lens, prefixes, page size, query heads, KV heads, head dim
INT4_CASES = [
    ([1, 1, 1], [15, 40, 3], 16, 6, 2, 16),  # decode: a page filled by its last token, staged own pages
    ([1, 1, 1, 1], [0, 9, 70, 33], 1, 6, 2, 16),  # decode, page size 1 (nothing staged), two blocks
    ([5, 20, 1], [40, 13, 17], 16, 6, 2, 32),  # extend: a chunk over a partly staged page, a page written whole
    ([9, 3], [20, 0], 1, 9, 3, 16),  # extend, page size 1
    ([30], [0], 16, 9, 3, 24),  # plain prefill; 24: a QR rotation, head dim below its block
    ([6, 1], [5, 10], 3, 4, 4, 16),  # page size 3: K's parameters loaded per position (no run of pages)
]


def int4_case(seed, lens, prefixes, page_size, hq, hkv, dim, kv_dtype):
    """A ragged batch over a ``kv_dtype`` pool as the engine leaves it before attention:
    each prefix written by earlier forwards (in two chunks: whole pages sealed, a partial
    last page staged), then the new tokens by this one; over shuffled pages whose
    unwritten slots hold code 15 and NaN parameters (a read of one shows). Returns the
    pool, the batch, the queries and the new tokens' K/V, and the exact K/V."""
    from radixkv.cache import KVPool, PoolConfig
    from radixkv.model.batch import ForwardBatch, SeqInput

    g = torch.Generator().manual_seed(seed)
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, kv_dtype=kv_dtype, num_pages=256, device=DEVICE))
    for t in (pool.k[0], pool.v[0]):
        t.fill_(255)
    for t in (pool.k_params[0], pool.v_params[0]):
        t.fill_(float("nan"))
    seqs, exact = [], []
    for n, p in zip(lens, prefixes):
        total = n + p
        count = -(-total // page_size) + 2
        pages = pool.alloc(count)[torch.randperm(count, generator=g).numpy()]
        kd, vd = torch.randn(total, hkv, dim, generator=g) * 3, torch.randn(total, hkv, dim, generator=g)
        for a, b in ((0, p // 2), (p // 2, p)):
            if b > a:
                pool.store_kv(0, kd[a:b].to(DEVICE), vd[a:b].to(DEVICE), pool.slots(pages, a, b))
        seqs.append(SeqInput(list(range(n)), p, pages))
        exact.append((kd, vd))
    batch = ForwardBatch.build(seqs, page_size, DEVICE)
    k_new = torch.cat([kd[p:] for (kd, _), p in zip(exact, prefixes)]).to(DEVICE)
    v_new = torch.cat([vd[p:] for (_, vd), p in zip(exact, prefixes)]).to(DEVICE)
    pool.store_kv(0, k_new, v_new, batch.out_slots)
    q = torch.randn(batch.num_tokens, hq, dim, generator=g).to(DEVICE)
    return pool, batch, q, k_new, v_new, exact


def attend(impl, case, scale, window=None, softcap=None, dtype=None):
    """``impl`` planned and run on an ``int4_case`` (queries and new K/V in ``dtype``);
    the pool's bytes untouched."""
    pool, batch, q, k_new, v_new, _ = case
    if dtype is not None:
        q, k_new, v_new = q.to(dtype), k_new.to(dtype), v_new.to(dtype)
    before = [t[0].clone() for t in (pool.k, pool.v, pool.k_params, pool.v_params)] + [pool.sealer.k[0].clone()]
    impl.plan(batch)
    out = impl.forward(q, k_new, v_new, pool.view(0), scale, sliding_window=window, logit_softcap=softcap)
    after = [t[0] for t in (pool.k, pool.v, pool.k_params, pool.v_params)] + [pool.sealer.k[0]]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))
    return out


def reference(case, scale, window=None, softcap=None):
    """The torch backend's ``attend_paged`` over the same pool, in float32."""
    return attend(get_backend("torch"), case, scale, window, softcap).cpu()


def triton_backend():
    return get_backend(available("triton"), dtype=torch.uint8)


@pytest.mark.parametrize("kv_dtype", ["int4", "int4_norot"])
@pytest.mark.parametrize("lens, prefixes, page_size, hq, hkv, dim", INT4_CASES)
def test_int4_matches_the_torch_reference(kv_dtype, lens, prefixes, page_size, hq, hkv, dim):
    """Equal to ``attend_paged`` over the same pool (pages before a query's own page
    sealed, its own page in full precision), and within 4-bit error of the exact K/V."""
    case = int4_case(5, lens, prefixes, page_size, hq, hkv, dim, kv_dtype)
    scale = dim**-0.5
    impl = triton_backend()
    out = attend(impl, case, scale).cpu()
    assert out.dtype == torch.float32 and out.shape == case[2].shape and torch.isfinite(out).all()
    assert (out - reference(case, scale)).abs().max() < 2e-5
    start, q = 0, case[2].cpu()
    for n, (kd, vd) in zip(lens, case[5]):
        exact = dense_reference(q[start : start + n], kd, vd, n, scale)
        assert (out[start : start + n].double() - exact).abs().max() < 0.5  # 4-bit K and V
        start += n


@pytest.mark.parametrize("kv_dtype", ["int4", "int4_norot"])
def test_int4_window_softcap_and_one_head_per_program(kv_dtype):
    """A sliding window and a soft cap (decode and extend in one batch: the extend kernel),
    and the extend kernel's other row layout (no GQA packing)."""
    case = int4_case(8, [1, 18], [37, 14], 4, 6, 2, 16, kv_dtype)
    impl = triton_backend()
    for window, softcap in [(6, None), (None, 5.0), (9, 5.0)]:
        out = attend(impl, case, 0.25, window, softcap).cpu()
        assert (out - reference(case, 0.25, window, softcap)).abs().max() < 2e-5
    impl.PACK_GQA = False
    assert (attend(impl, case, 0.25, 6).cpu() - reference(case, 0.25, 6)).abs().max() < 2e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_half_queries_over_int4(dtype, tol):
    """The model's half-precision queries and new K/V over an int4 cache; the output in
    their dtype, near the float32 reference of the same (rounded) inputs."""
    case = int4_case(6, [1, 6], [20, 9], 16, 6, 2, 16, "int4")
    pool, batch, q, k_new, v_new, exact = case
    out = attend(triton_backend(), case, 0.25, dtype=dtype)
    assert out.dtype == dtype and out.shape == q.shape
    rounded = (pool, batch, q.to(dtype).float(), k_new.to(dtype).float(), v_new.to(dtype).float(), exact)
    assert (out.cpu().float() - reference(rounded, 0.25)).abs().max() < tol
