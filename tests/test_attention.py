"""Attention backends against a dense float64 reference on random ragged paged batches."""

import numpy as np
import pytest
import torch

from radixkv.cache import PageAllocator
from radixkv.cache.formats import KVView, kv_format
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.kernels import get_backend


def dense_reference(q, k_all, v_all, n_new, scale, window=None, softcap=None):
    """One sequence: q [n, Hq, D]; k_all/v_all [L, Hkv, D] (cached then new)."""
    total = k_all.shape[0]
    group = q.shape[1] // k_all.shape[1]
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(total - n_new, total)[:, None]
    kv_pos = torch.arange(total)[None, :]
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= kv_pos > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_case(seed, lens, prefixes, page_size, hq, hkv, dtype, dim=16, device="cpu", kv_dtype=None):
    """A ragged batch over shuffled pages of a NaN-poisoned cache, with every sequence's
    prefix and new tokens already stored (as the pool's ``store_kv`` leaves them before
    attention). ``kv_dtype`` (default ``dtype``): the cache's format; the dense K/V
    are what it holds, while ``k``/``v`` are the new tokens before that rounding."""
    kv_dtype = kv_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    alloc = PageAllocator(4096)
    num_pages = 4096
    k_cache = torch.full((num_pages, page_size, hkv, dim), float("nan"), dtype=kv_dtype)  # poisoned
    v_cache = torch.full_like(k_cache, float("nan"))
    seqs, dense_k, dense_v, new_k, new_v = [], [], [], [], []
    for n, p in zip(lens, prefixes):
        total = n + p
        # Scatter pages: allocate extra and shuffle so page ids are not contiguous.
        pages = alloc.alloc(-(-total // page_size) + 2)[torch.randperm(-(-total // page_size) + 2, generator=g).numpy()]
        kd = torch.randn(total, hkv, dim, generator=g).to(dtype)
        vd = torch.randn(total, hkv, dim, generator=g).to(dtype)
        pos = np.arange(total)
        slots = torch.from_numpy(pages[pos // page_size].astype(np.int64) * page_size + pos % page_size)
        k_cache.view(-1, hkv, dim)[slots] = kd.to(kv_dtype)
        v_cache.view(-1, hkv, dim)[slots] = vd.to(kv_dtype)
        seqs.append(SeqInput(list(range(n)), p, pages))
        dense_k.append(kd.to(kv_dtype).to(dtype))
        dense_v.append(vd.to(kv_dtype).to(dtype))
        new_k.append(kd[p:])
        new_v.append(vd[p:])
    batch = ForwardBatch.build(seqs, page_size, device)
    q = torch.randn(batch.num_tokens, hq, dim, generator=g).to(dtype)
    q, k_new, v_new, k_cache, v_cache = (t.to(device) for t in (q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache))
    return batch, q, k_new, v_new, KVView(k_cache, v_cache, kv_format(kv_dtype)), dense_k, dense_v


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_against_dense(impl, case, lens, scale, window=None, softcap=None, tol=2e-5, reference=dense_reference):
    """Plan and run ``impl`` on a ``random_case``; every sequence's output within ``tol`` of
    the dense reference (or ``reference``, called as it is), and the KV untouched (backends
    only read it). Returns the output."""
    batch, q, k, v, kv, dense_k, dense_v = case
    before = kv.k.clone(), kv.v.clone()
    impl.plan(batch)
    out = impl.forward(q, k, v, kv, scale, sliding_window=window, logit_softcap=softcap)
    start = 0
    q_host, out_host = q.cpu(), out.cpu()
    for n, kd, vd in zip(lens, dense_k, dense_v):
        ref = reference(q_host[start : start + n], kd, vd, n, scale, window, softcap)
        assert (out_host[start : start + n].double() - ref).abs().max() < tol
        start += n
    assert same_bytes(kv.k, before[0]) and same_bytes(kv.v, before[1])
    return out


CASES = [
    # lens, prefixes
    ([1, 5, 37, 130], [0, 3, 100, 17]),
    ([1, 1, 1, 1, 1], [0, 9, 64, 130, 33]),  # pure decode: the padded path
    ([130], [0]),  # plain prefill
    ([7, 1], [40, 0]),
]


def device_for(name):
    """Where a backend's case lives: on the GPU when there is one (compiled Triton takes
    only CUDA tensors; without CUDA it runs in Triton's interpreter), the C kernel on
    the CPU."""
    return "cuda" if torch.cuda.is_available() and name != "cpu" else "cpu"


def available(name):
    if name == "triton":
        pytest.importorskip("triton")
    if name == "cpu":
        try:
            get_backend("cpu")
        except ImportError as e:  # no C compiler on this machine
            pytest.skip(str(e))
    return name


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("lens, prefixes", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
def test_backend_matches_dense_reference(backend, lens, prefixes, page_size, hq, hkv, dtype, tol):
    case = random_case(7, lens, prefixes, page_size, hq, hkv, dtype, device=device_for(backend))
    out = check_against_dense(get_backend(available(backend)), case, lens, scale=0.25, tol=tol)
    assert out.shape == case[1].shape and out.dtype == dtype


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("lens, prefixes", [([1, 5, 37], [30, 3, 20]), ([1, 1, 1], [30, 3, 20]), ([12], [0])])
def test_float32_queries_read_a_bf16_cache(backend, lens, prefixes):
    """The KV format is the pool's, apart from the model's dtype: every backend that reads
    fp32 queries attends over what the bf16 cache holds, not the unrounded new K/V."""
    case = random_case(9, lens, prefixes, 4, 6, 2, torch.float32, device=device_for(backend), kv_dtype=torch.bfloat16)
    check_against_dense(get_backend(available(backend)), case, lens, scale=0.25, tol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("lens, prefixes", [([1, 5, 37], [30, 3, 20]), ([1, 1, 1], [30, 3, 20])])
def test_sliding_window_and_softcap(backend, lens, prefixes):
    case = random_case(3, lens, prefixes, 4, 6, 2, torch.float32, device=device_for(backend))
    impl = get_backend(available(backend))
    for window, softcap in [(8, None), (None, 5.0), (8, 5.0)]:
        check_against_dense(impl, case, lens, scale=0.25, window=window, softcap=softcap)


# The interpreter pays per program and loop step (minutes for small tiles): one tile there.
EXTEND_TILES = [(16, 16), (64, 32), (128, 64), (128, 128)] if torch.cuda.is_available() else [(64, 32)]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("tiles", EXTEND_TILES)
def test_triton_extend_tiles_and_head_packing(pack, tiles):
    """The extend kernel's row/column tiles and its two row layouts (one query head per
    program, or a KV head's whole group packed into the rows) agree with the reference,
    with contexts that span whole unmasked blocks, the causal diagonal and windows."""
    impl = get_backend(available("triton"))
    impl.PACK_GQA = pack
    impl.EXTEND_HALF = impl.EXTEND_FP32 = tiles
    lens, prefixes = [37, 130, 1, 5], [100, 0, 40, 3]
    case = random_case(5, lens, prefixes, 16, 9, 3, torch.float16, device=device_for("triton"))
    for window, softcap in [(None, None), (8, None), (64, 5.0)]:
        check_against_dense(impl, case, lens, scale=0.25, window=window, softcap=softcap, tol=3e-3)


def test_auto_follows_the_kv_device_and_dtype():
    pytest.importorskip("triton")
    assert get_backend("auto", "cuda", torch.float32).name == "triton"  # FlashInfer reads no fp32 KV
    try:
        import flashinfer  # noqa: F401

        half = "flashinfer"
    except ImportError:
        half = "triton"
    assert get_backend("auto", "cuda:0", torch.bfloat16).name == half
    # float32 queries over a bf16 cache: FlashInfer wants them equal, Triton reads both
    assert get_backend("auto", "cuda", torch.bfloat16, torch.float32).name == "triton"
    assert get_backend("auto", "cpu", torch.bfloat16).name in ("cpu", "torch")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_backend("cudnn")


def test_positions_are_kept_apart_from_kv_indices():
    """A sequence may attend to fewer KV entries than its position says (long-context
    eviction): RoPE positions come from ``positions``, KV slots from ``num_cached``."""
    pages = np.array([7, 2], dtype=np.int32)
    b = ForwardBatch.build([SeqInput([5, 6], 3, pages, positions=[10, 11])], page_size=4)
    assert b.positions.tolist() == [10, 11]
    assert b.out_slots.tolist() == [7 * 4 + 3, 2 * 4 + 0]  # KV entries 3 and 4
    assert b.seq_lens == (5,) and b.kv_last_page_len.tolist() == [1]
    default = ForwardBatch.build([SeqInput([5, 6], 3, pages)], page_size=4)
    assert default.positions.tolist() == [3, 4] and default.out_slots.tolist() == b.out_slots.tolist()
    with pytest.raises(ValueError, match="sequence 0: positions must be 2 ints >= 0"):
        ForwardBatch.build([SeqInput([5, 6], 3, pages, positions=[1])], 4)


def test_batch_metadata_follows_the_csr_convention():
    b = ForwardBatch.build(
        [SeqInput([5, 6], 3, np.array([7, 2], dtype=np.int32)), SeqInput([9], 0, np.array([4], dtype=np.int32))],
        page_size=4,
    )
    assert b.qo_indptr.tolist() == [0, 2, 3]
    assert b.kv_indptr.tolist() == [0, 2, 3]
    assert b.kv_indices.tolist() == [7, 2, 4]
    assert b.kv_last_page_len.tolist() == [1, 1]  # 5 tokens in pages of 4; 1 token
    assert b.positions.tolist() == [3, 4, 0]
    assert b.out_slots.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 0]
    assert b.input_ids.tolist() == [5, 6, 9]
    with pytest.raises(ValueError, match="sequence 0: pages holds 1 ids, 5 tokens need 2"):
        ForwardBatch.build([SeqInput([5, 6], 3, np.array([7], dtype=np.int32))], 4)
    with pytest.raises(ValueError, match="sequence 0: new_tokens must not be empty"):
        ForwardBatch.build([SeqInput([], 3, np.array([7], dtype=np.int32))], 4)


def int8_case(seed, lens, prefixes, page_size, hq, hkv, dim=16):
    """``quantized_case`` for int8."""
    return quantized_case(seed, lens, prefixes, page_size, hq, hkv, dim, "int8")


def quantized_case(seed, lens, prefixes, page_size, hq, hkv, dim=16, kv_dtype="int8"):
    """A ragged batch whose K/V went through a ``KVPool`` of ``kv_dtype`` (``store_kv``;
    fp8 with random per-head scales), over shuffled pages whose unwritten slots are
    poisoned (int8: the largest code at the largest scale, ~7.6e6; fp8: NaN). The dense K/V are what
    the pool holds, dequantized (``read_kv``); also returns the K/V before quantizing."""
    from radixkv.cache import KVPool, PoolConfig
    from radixkv.cache.formats import KVScales

    g = torch.Generator().manual_seed(seed)
    scales = None
    if kv_dtype.startswith("fp8"):
        k_s, v_s = torch.rand(2, 1, hkv, generator=g) * 0.05 + 0.03  # K reaches ~13, V ~4.5: within 448 * 0.03
        scales = KVScales(k_s, v_s, "test")
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, kv_dtype=kv_dtype, num_pages=4096, kv_scales=scales))
    if scales is None:  # poisoned: a slot read but never written shows up
        for t in (pool.k[0], pool.v[0], pool.k_params[0], pool.v_params[0]):
            t.fill_(127 if t.dtype == torch.int8 else 255)
    else:
        for t in (pool.k[0], pool.v[0]):
            t.view(torch.uint8).fill_(0x7F)  # NaN in both fp8 formats
    seqs, dense_k, dense_v, exact_k, exact_v, new_k, new_v = [], [], [], [], [], [], []
    for n, p in zip(lens, prefixes):
        total = n + p
        count = -(-total // page_size) + 2
        pages = pool.alloc(count)[torch.randperm(count, generator=g).numpy()]
        kd, vd = torch.randn(total, hkv, dim, generator=g) * 3, torch.randn(total, hkv, dim, generator=g)
        slots = pool.slots(pages, 0, total)
        pool.store_kv(0, kd, vd, slots)
        k_read, v_read = pool.read_kv(0, slots)
        seqs.append(SeqInput(list(range(n)), p, pages))
        dense_k.append(k_read), dense_v.append(v_read), exact_k.append(kd), exact_v.append(vd)
        new_k.append(kd[p:]), new_v.append(vd[p:])
    batch = ForwardBatch.build(seqs, page_size, "cpu")
    q = torch.randn(batch.num_tokens, hq, dim, generator=g)
    return (batch, q, torch.cat(new_k), torch.cat(new_v), pool.view(0), dense_k, dense_v), exact_k, exact_v


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("lens, prefixes", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_int8_kv_matches_dequantize_then_attend(backend, lens, prefixes, page_size):
    """int8 pages (a log-scale byte per token and KV head) read by every backend that reads
    them: equal to dense attention over the dequantized cache, new tokens included (a
    prefill attends to its own K/V as stored, so cache on = off within the format), and
    within quantization error of the unquantized K/V."""
    case, exact_k, exact_v = int8_case(11, lens, prefixes, page_size, 6, 2)
    out = check_against_dense(get_backend(available(backend)), case, lens, scale=0.25, tol=2e-5)
    start, q = 0, case[1]
    for n, kd, vd in zip(lens, exact_k, exact_v):
        exact = dense_reference(q[start : start + n], kd, vd, n, 0.25)
        assert (out[start : start + n].double() - exact).abs().max() < 0.1  # unit-variance V, peaked scores
        start += n


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_kv_matches_dequantize_then_attend(kv_dtype, backend, page_size):
    """fp8 pages (x / a fixed scale per KV head) read by the backends that read them:
    equal to dense attention over the dequantized cache, and near the unquantized K/V."""
    lens, prefixes = CASES[-1]
    case, exact_k, exact_v = quantized_case(13, lens, prefixes, page_size, 6, 2, 16, kv_dtype)
    out = check_against_dense(get_backend(available(backend)), case, lens, scale=0.25, tol=2e-5)
    start, q = 0, case[1]
    for n, kd, vd in zip(lens, exact_k, exact_v):
        exact = dense_reference(q[start : start + n], kd, vd, n, 0.25)
        assert (out[start : start + n].double() - exact).abs().max() < 0.5  # 3-bit (e4m3) / 2-bit (e5m2) mantissas
        start += n


def test_int8_pages_cost_a_quarter_and_triton_reads_them():
    from radixkv.cache import PoolConfig

    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, num_pages=1)
    int8, fp32 = PoolConfig(**shape, kv_dtype="int8"), PoolConfig(**shape, kv_dtype="fp32")
    assert int8.bytes_per_page == 2 * 30 * 16 * 3 * (64 + 1)  # int8 elements + a scale byte per token-head
    assert int8.bytes_per_page / fp32.bytes_per_page <= 0.255
    assert get_backend(available("triton"), dtype=torch.int8).name == "triton"  # reads int8 in its tiles


# -- int4: quantized on seal (radixkv.cache.sealing) -------------------------------------------


def int4_case(seed, lens, prefixes, page_size, hq, hkv, dim=16):
    """A ragged batch over an int4 pool as the engine leaves it before attention: each
    sequence's prefix stored by an earlier write (its full pages sealed, its partial
    last page staged), then the new tokens by this forward's write."""
    from radixkv.cache import KVPool, PoolConfig

    g = torch.Generator().manual_seed(seed)
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, kv_dtype="int4", num_pages=4096))
    seqs, exact_k, exact_v, tables = [], [], [], []
    for n, p in zip(lens, prefixes):
        total = n + p
        count = -(-total // page_size) + 2
        pages = pool.alloc(count)[torch.randperm(count, generator=g).numpy()]
        kd, vd = torch.randn(total, hkv, dim, generator=g) * 3, torch.randn(total, hkv, dim, generator=g)
        if p:
            pool.store_kv(0, kd[:p], vd[:p], pool.slots(pages, 0, p))
        seqs.append(SeqInput(list(range(n)), p, pages))
        exact_k.append(kd), exact_v.append(vd), tables.append(pages)
    batch = ForwardBatch.build(seqs, page_size, "cpu")
    k_new = torch.cat([kd[p:] for kd, p in zip(exact_k, prefixes)])
    v_new = torch.cat([vd[p:] for vd, p in zip(exact_v, prefixes)])
    pool.store_kv(0, k_new, v_new, batch.out_slots)
    q = torch.randn(batch.num_tokens, hq, dim, generator=g)
    return pool, batch, q, k_new, v_new, exact_k, exact_v, tables


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("lens, prefixes", CASES + [([1, 3, 20], [15, 14, 31])])  # decodes and chunks that fill pages
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_int4_reads_earlier_pages_sealed_and_its_own_page_in_full(backend, lens, prefixes, page_size):
    """A query reads the pages before its own page as sealed (int4, dequantized) and its
    own page's tokens up to itself exactly as computed, whether they came in this
    forward or were staged by an earlier one."""
    pool, batch, q, k_new, v_new, exact_k, exact_v, tables = int4_case(5, lens, prefixes, page_size, 6, 2)
    impl = get_backend(available(backend))
    impl.plan(batch)
    out = impl.forward(q, k_new, v_new, pool.view(0), 0.25)
    start = 0
    for n, p, kd, vd, pages in zip(lens, prefixes, exact_k, exact_v, tables):
        total = n + p
        k_read, v_read = pool.read_kv(0, pool.slots(pages, 0, total))  # sealed pages dequantized
        for j in range(n):
            pos = p + j
            own = pos // page_size * page_size
            k_ref = torch.cat([k_read[:own], kd[own : pos + 1]])
            v_ref = torch.cat([v_read[:own], vd[own : pos + 1]])
            ref = dense_reference(q[start + j : start + j + 1], k_ref, v_ref, 1, 0.25)
            assert (out[start + j].double() - ref[0]).abs().max() < 2e-5
        full = total // page_size * page_size  # every whole page is sealed: within 4-bit error of the truth
        assert full == 0 or (k_read[:full] - kd[:full]).abs().max() < 3 * 6 / 15
        assert torch.equal(k_read[full:], kd[full:])
        start += n
    pool.check_integrity()


def test_int4_page_bytes_depend_only_on_its_tokens_and_staging_is_returned():
    """Quantize on seal: a page written in one pass, token by token, or in uneven chunks
    holds the same bytes; partial pages hold a staging slot until they fill (and one
    forward more) or go free."""
    from radixkv.cache import KVPool, PoolConfig

    g = torch.Generator().manual_seed(3)
    pool = KVPool(PoolConfig(2, 2, 8, 4, kv_dtype="int4", num_pages=64))
    k, v = torch.randn(11, 2, 8, generator=g), torch.randn(11, 2, 8, generator=g)

    def write(cuts):
        pages = pool.alloc(3)
        for a, b in zip(cuts, cuts[1:]):
            for layer in (0, 1):
                pool.store_kv(layer, k[a:b], v[a:b], pool.slots(pages, a, b))
        return pages

    tables = [write([0, 11]), write(list(range(12))), write([0, 3, 5, 9, 11])]
    stored = [[t[layer][pages[:2]] for t in (pool.k, pool.k_params, pool.v, pool.v_params) for layer in (0, 1)]
              for pages in tables]  # fmt: skip
    for other in stored[1:]:
        assert all(torch.equal(a, b) for a, b in zip(stored[0], other))
    assert pool.sealer.staged_pages() == 3  # each table's partial third page
    for pages in tables:
        pool.free(pages)
    assert pool.sealer.staged_pages() == 0
    pool.check_integrity()
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, num_pages=1)
    fp32 = PoolConfig(**shape, page_size=16).bytes_per_page
    assert PoolConfig(**shape, page_size=16, kv_dtype="int4").bytes_per_page == 30 * 3 * (16 * 64 + 4 * (64 + 16))
    assert PoolConfig(**shape, page_size=64, kv_dtype="int4").bytes_per_page / (4 * fp32) == 4.5 / 32  # q4_0's bits
    with pytest.raises(ValueError, match="head_dim must be even"):
        PoolConfig(1, 1, 7, 4, kv_dtype="int4", num_pages=1)
    assert get_backend(available("triton"), dtype=torch.uint8).name == "triton"  # reads int4 in its tiles
