"""The CPU backend's C decode kernel: values, routing of decode rows, its build and fallback."""

import platform

import numpy as np
import pytest
import torch
from test_attention import check_against_dense, dense_reference, int8_case, random_case, same_bytes

from radixkv.cache import KVPool, PoolConfig
from radixkv.cache.formats import kv_format
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.kernels import build, cpu_backend, get_backend
from radixkv.kernels.torch_ref import TorchBackend


def _has_compiler():
    try:
        build.compiler()
        return True
    except ImportError:
        return False


needs_compiler = pytest.mark.skipif(not _has_compiler(), reason="no C compiler")


@pytest.fixture(scope="module")
def cpu():
    try:
        return get_backend("cpu")
    except ImportError as e:  # no C compiler here
        pytest.skip(str(e))


@pytest.mark.parametrize("dim", [64, 128, 24])  # the two compiled-in head sizes, and the generic loop
@pytest.mark.parametrize("hq, hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_dense_reference(cpu, dim, hq, hkv, page_size):
    lens, prefixes = [1, 1, 1, 1], [0, 15, 16, 300]
    case = random_case(11, lens, prefixes, page_size, hq, hkv, torch.float32, dim=dim)
    check_against_dense(cpu, case, lens, scale=0.125)


@pytest.mark.parametrize("prefixes", [[3000], [3000, 40]])  # few sequences: contexts split into ranges
def test_long_context_window_and_softcap(cpu, prefixes):
    lens = [1] * len(prefixes)
    case = random_case(5, lens, prefixes, 16, 9, 3, torch.float32, dim=64)
    for window, softcap in [(None, None), (100, None), (None, 30.0), (7, 2.0), (1, None)]:
        check_against_dense(cpu, case, lens, scale=0.125, window=window, softcap=softcap)


def test_a_decode_row_is_the_same_bits_alone_in_any_batch_and_on_any_threads(cpu):
    """The kernel splits a long context into ranges by its own length (so one sequence
    still spreads over the threads), never by the batch or the thread count: a row's
    output does not depend on the rows beside it or on the threads."""
    lens, prefixes = [1, 1, 1, 1], [700, 300, 40, 1500]
    batch, q, k, v, kv, *_ = random_case(12, lens, prefixes, 16, 9, 3, torch.float32, dim=64)
    cpu.plan(batch)
    together = cpu.forward(q, k, v, kv, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cpu.plan(batch)
            assert torch.equal(cpu.forward(q, k, v, kv, 0.125), together)
            for i, p in enumerate(prefixes):
                pages = batch.kv_indices[batch.kv_indptr[i] : batch.kv_indptr[i + 1]].numpy()
                cpu.plan(ForwardBatch.build([SeqInput([0], p, pages)], 16))
                assert torch.equal(cpu.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], kv, 0.125)[0], together[i])
    finally:
        torch.set_num_threads(threads)


def spy_on_sdpa_path(impl, monkeypatch):
    """Record which sequences each call of the reference (SDPA) path leaves to the kernel."""
    calls = []
    original = impl.attend_sequences

    def spy(*args, **kwargs):
        calls.append(kwargs.get("skip", frozenset()))
        return original(*args, **kwargs)

    monkeypatch.setattr(impl, "attend_sequences", spy)
    return calls


def test_decode_rows_go_to_the_kernel_and_the_rest_to_sdpa(cpu, monkeypatch):
    calls = spy_on_sdpa_path(cpu, monkeypatch)
    check_against_dense(cpu, random_case(1, [1, 1, 1], [5, 40, 0], 4, 9, 3, torch.float32, dim=64), [1, 1, 1], 0.125)
    assert calls == []  # a pure decode batch never reaches SDPA
    lens = [1, 12, 1, 30]
    check_against_dense(cpu, random_case(2, lens, [50, 7, 3, 0], 4, 9, 3, torch.float32, dim=64), lens, 0.125)
    assert calls == []  # decode rows, the extend (12 new after 7 cached) and the prefill: all the kernels'
    lens = [1, 12]
    check_against_dense(cpu, random_case(3, lens, [50, 7], 4, 9, 3, torch.float32, dim=64), lens, 0.125, softcap=20.0)
    assert calls == [frozenset({0})]  # soft-capped: the decode kernel takes the row, SDPA the extend


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, hkv", [(9, 3), (4, 4), (8, 1)])
def test_extends_go_to_the_extend_kernel(cpu, monkeypatch, page_size, hq, hkv):
    """Sequences adding several tokens, after cached ones or from the start: the extend
    kernel, equal to dense attention (each new token causal, under a window too), ragged
    lengths across its blocks of 16 positions; decode rows and soft-capped logits go
    elsewhere."""
    calls = spy_on_sdpa_path(cpu, monkeypatch)
    lens, prefixes = [5, 1, 40, 2, 17, 33], [11, 20, 0, 1, 16, 130]
    case = random_case(6, lens, prefixes, page_size, hq, hkv, torch.float32, dim=64)
    check_against_dense(cpu, case, lens, 0.125)
    assert calls == []  # the prefill (index 2) too: nothing reached SDPA
    check_against_dense(cpu, case, lens, 0.125, window=7)
    calls.clear()
    check_against_dense(cpu, case, lens, 0.125, softcap=20.0)
    assert calls == [frozenset({1})]  # soft-capped: the extends take the reference path


def test_extends_with_a_head_size_the_kernel_does_not_take(cpu, monkeypatch):
    calls = spy_on_sdpa_path(cpu, monkeypatch)
    lens = [6, 1]
    check_against_dense(cpu, random_case(7, lens, [9, 4], 16, 9, 3, torch.float32, dim=24), lens, 0.125)
    assert calls == [frozenset({1})]  # head size 24: the extend goes through SDPA


# bf16 products against their oracle: float32 reassociation, and now and then a weight
# rounded to the other bf16 neighbour (2^-8 of it, times V: up to ~1e-3 measured)
BF16_PRODUCTS_TOL = 1e-2


def bf16_products_reference(q, k_all, v_all, n_new, scale, window=None, softcap=None):
    """What the extend kernel computes over bf16 pages with bf16 products (one sequence,
    shapes as dense_reference's): the queries scaled and rounded to bf16, float32 scores
    of them against the pages' K, an online softmax over blocks of 16 positions counted
    from 0, each block's weights (float32 exponentials against the running maximum)
    rounded to bf16 for V's sums while the normaliser adds them unrounded."""
    assert softcap is None
    total, group = k_all.shape[0], q.shape[1] // k_all.shape[1]
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    qb = (q.float() * scale).bfloat16().double()
    scores = torch.einsum("qhd,khd->hqk", qb, k).float()
    q_pos, kv_pos = torch.arange(total - n_new, total)[:, None], torch.arange(total)[None, :]
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= kv_pos > q_pos - window
    m = torch.full(scores.shape[:2], float("-inf"))
    l, acc = torch.zeros(scores.shape[:2]), torch.zeros(*scores.shape[:2], v.shape[2], dtype=torch.float64)
    for k0 in range(0, total, 16):
        seen = mask[:, k0 : k0 + 16]
        s = scores[..., k0 : k0 + 16].masked_fill(~seen, float("-inf"))
        top = torch.maximum(m, s.max(-1).values)
        alpha = torch.where(top == m, torch.ones_like(m), torch.exp(m - top))
        p = torch.exp(s - top[..., None]).masked_fill(~seen, 0.0)
        acc = acc * alpha[..., None].double() + torch.einsum("hqk,khd->hqd", p.bfloat16().double(), v[k0 : k0 + 16])
        l, m = l * alpha + p.sum(-1), top
    return (acc / l[..., None].double()).permute(1, 0, 2)


DCHUNK = 128  # cpu_decode.c's positions per range of a decode row's context, about


def bf16_decode_reference(q, k_all, v_all, n_new, scale, window=None, softcap=None):
    """What the decode kernel computes for a row over bf16 pages with bf16 products (head
    size 64; shapes as dense_reference's, one new token): the context (its last ``window``
    positions) split into ranges as the kernel splits it; the query scaled and rounded to
    bf16, float32 scores against the pages' K; per range, weights exp(score - the range's
    maximum) rounded to bf16 for V's sums while the normaliser adds them unrounded; the
    ranges merged by their maxima."""
    assert n_new == 1 and softcap is None
    total, group = k_all.shape[0], q.shape[1] // k_all.shape[1]
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    first = total - window if window is not None and total > window else 0
    parts = max(1, -(-(total - first) // DCHUNK))
    scores = torch.einsum("hd,khd->hk", (q[0].float() * scale).bfloat16().double(), k).float()
    ranges = []
    for p in range(parts):
        a, b = first + (total - first) * p // parts, first + (total - first) * (p + 1) // parts
        if a < b:
            m = scores[:, a:b].max(-1).values
            e = torch.exp(scores[:, a:b] - m[:, None])
            ranges.append((m, e.sum(-1).double(), torch.einsum("hk,khd->hd", e.bfloat16().double(), v[a:b])))
    top = torch.stack([m for m, _, _ in ranges]).max(0).values
    weights = [torch.exp(m - top).double() if len(ranges) > 1 else torch.ones_like(top).double() for m, _, _ in ranges]
    num = sum(w[:, None] * acc for w, (_, _, acc) in zip(weights, ranges))
    den = sum(w * l for w, (_, l, _) in zip(weights, ranges))
    return (num / den[:, None])[None]


def test_bf16_products_reference_is_near_dense_attention():
    """The oracles above depart from exact attention only by bf16's rounding."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((40, 9, 64), (300, 3, 64), (300, 3, 64)))
    k, v = k.bfloat16().float(), v.bfloat16().float()
    for window in (None, 7):
        err = (bf16_products_reference(q, k, v, 40, 0.125, window) - dense_reference(q, k, v, 40, 0.125, window))
        assert 1e-5 < err.abs().max() < 2e-2
        for n in (300, 129, 5):  # three ranges, two, one
            err = bf16_decode_reference(q[-1:], k[:n], v[:n], 1, 0.125, window) - dense_reference(
                q[-1:], k[:n], v[:n], 1, 0.125, window)
            assert 1e-5 < err.abs().max() < 2e-2


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, hkv, dim", [(9, 3, 64), (8, 1, 128), (4, 4, 32), (9, 3, 24)])
@pytest.mark.parametrize("kv_dtype, code", [(torch.bfloat16, 3), (torch.float16, 4)])
def test_sixteen_bit_pages_are_read_in_place(cpu, monkeypatch, page_size, hq, hkv, dim, kv_dtype, code):
    """bf16 and fp16 caches (float32 queries): decode rows, extends and a prefill through
    the C kernels, read as the pages hold them; windows too. fp16 rows are widened to
    float32 (exact), so they equal dense attention over the values the cache holds within
    fp32's tolerance. Where the CPU has AVX512-BF16, bf16 extends and prefills multiply in
    bf16 (the queries and softmax weights rounded: bf16_products_reference), and so do bf16
    decode rows of head size 64 (bf16_decode_reference), each up to float32's
    reassociation and an occasional weight rounded the other way; elsewhere bf16 rows are
    widened as fp16 ones. Soft-capped extends, and extends of a head size the extend kernel
    does not take (24), go to the reference path; decode rows always to the decode kernel
    (format code 3 for bf16, 4 for fp16)."""
    sdpa = spy_on_sdpa_path(cpu, monkeypatch)
    decode_formats, extend_calls = spy_on_kernels(cpu, monkeypatch)
    lens, prefixes = [5, 1, 40, 2, 17, 1, 33], [11, 20, 0, 1, 16, 700, 130]
    case = random_case(8, lens, prefixes, page_size, hq, hkv, torch.float32, dim=dim, kv_dtype=kv_dtype)
    bf16_extends = kv_dtype == torch.bfloat16 and cpu.bf16_products and dim % 32 == 0
    bf16_decode = kv_dtype == torch.bfloat16 and cpu.bf16_decode and dim == 64

    def in_bf16(n):  # whether a sequence of n new tokens multiplies in bf16
        return bf16_extends if n > 1 else bf16_decode

    def reference(q, kd, vd, n, scale, window, softcap):
        oracle = (bf16_products_reference if n > 1 else bf16_decode_reference) if in_bf16(n) else dense_reference
        return oracle(q, kd, vd, n, scale, window, softcap)

    for window in (None, 7):
        out = check_against_dense(cpu, case, lens, 0.125, window=window, tol=BF16_PRODUCTS_TOL, reference=reference)
        starts = np.cumsum([0] + lens[:-1])
        for start, n, kd, vd in zip(starts, lens, case[5], case[6]):  # every row within fp32's tolerance but bf16's
            err = (out[start : start + n].double() - reference(case[1][start : start + n], kd, vd, n, 0.125, window, None))
            assert err.abs().max() < (BF16_PRODUCTS_TOL if in_bf16(n) else 2e-5)
            if in_bf16(n):  # the bulk to fp32's tolerance: a rare weight rounded the other way aside
                assert (err.abs() < 2e-5).double().mean() > 0.95
    assert decode_formats == [code, code]
    if dim % 32 == 0:
        assert sdpa == [] and extend_calls == [code, code]
    else:
        assert sdpa == [frozenset({1, 5})] * 2 and extend_calls == []
    sdpa.clear()
    check_against_dense(cpu, case, lens, 0.125, softcap=20.0)
    assert sdpa == [frozenset({1, 5})]  # soft-capped: the extends take the reference path


HAS_AVX512F = "avx512f" in build.cpu_id().split()  # the flags -march=native builds with


@needs_compiler
@pytest.mark.skipif(not HAS_AVX512F, reason="no AVX-512 here: the AVX2 tiles are the only build")
def test_the_avx512_extend_tiles_give_the_avx2_tiles_bits(cpu, fresh_build, monkeypatch):
    """The extend kernel built with AVX-512 (16 rows a vector) and without it (-mno-avx512f:
    the AVX2 tiles) agree bit for bit on float32 and fp16 pages: ragged extends whose rows
    start mid-tile, a prefill, windows, pages of 1 and 16, two head shapes."""
    monkeypatch.setattr(cpu_backend, "FLAGS", cpu_backend.FLAGS + ("-mno-avx512f",))
    avx2 = get_backend("cpu")
    assert avx2._lib is not cpu._lib and not avx2.bf16_products  # a second library, without AVX-512
    lens, prefixes = [5, 40, 2, 17, 33], [11, 0, 1, 700, 130]  # extends only (decode rows: another kernel)
    for page_size in (1, 16):
        for hq, hkv, dim in ((9, 3, 64), (8, 1, 128)):
            for kv_dtype in (torch.float32, torch.float16):
                case = random_case(9, lens, prefixes, page_size, hq, hkv, torch.float32, dim=dim, kv_dtype=kv_dtype)
                for window in (None, 7, 100):
                    wide = check_against_dense(cpu, case, lens, 0.125, window=window)
                    assert same_bytes(wide, check_against_dense(avx2, case, lens, 0.125, window=window))


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is an x86 CPU name")
def test_radixkv_march_builds_the_kernels_for_another_cpu(cpu, fresh_build, monkeypatch):
    """$RADIXKV_MARCH replaces -march=native in every kernel build: x86-64-v3 (AVX2, FMA,
    F16C) gives a library of its own, without AVX-512's bf16 products, whose extends
    and decode rows still match the dense reference; with AVX-512 here, the same bits as
    the -mno-avx512f build. A value that is not a CPU name is refused naming the variable."""
    monkeypatch.setenv("RADIXKV_MARCH", "x86-64-v3")
    v3 = get_backend("cpu")
    assert v3._lib is not cpu._lib and not v3.bf16_products
    assert len(list(fresh_build.glob("cpu_decode-*.so"))) == 1
    lens, prefixes = [5, 40, 1, 17], [11, 0, 300, 130]  # extends and a decode row
    case = random_case(3, lens, prefixes, 16, 9, 3, torch.float32, dim=64, kv_dtype=torch.float32)
    out = check_against_dense(v3, case, lens, 0.125)
    if HAS_AVX512F:
        monkeypatch.delenv("RADIXKV_MARCH")
        monkeypatch.setattr(cpu_backend, "_library", None)
        monkeypatch.setattr(cpu_backend, "FLAGS", cpu_backend.FLAGS + ("-mno-avx512f",))
        assert same_bytes(out, check_against_dense(get_backend("cpu"), case, lens, 0.125))
    monkeypatch.setenv("RADIXKV_MARCH", "native -O0")
    with pytest.raises(ValueError, match="RADIXKV_MARCH must be a compiler CPU name"):
        build.build("cpu_decode", cpu_backend.SOURCE, cpu_backend.FLAGS)


def shared_prefix_decode_case(seed, prefix_pages, own, page_size, hq, hkv, dim):
    """Decode rows of sequences whose page tables begin with the same prefix_pages pages
    (a few-shot batch), then own[i] positions each in pages of their own, over a float32
    pool filled with random K/V; returns (batch, q, k, v, kv)."""
    g = torch.Generator().manual_seed(seed)
    own_pages = [-(-n // page_size) for n in own]
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, num_pages=prefix_pages + sum(own_pages)))
    kv = pool.view(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g)), kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    order = torch.randperm(prefix_pages + sum(own_pages), generator=g).numpy().astype(np.int32)
    common, rest = order[:prefix_pages], order[prefix_pages:]
    seqs, at = [], 0
    for n, p in zip(own, own_pages):
        pages = np.concatenate([common, rest[at : at + p]])
        at += p
        seqs.append(SeqInput([0], prefix_pages * page_size + n - 1, pages))
    batch = ForwardBatch.build(seqs, page_size)
    q = torch.randn(len(own), hq, dim, generator=g)
    k, v = torch.randn(2, len(own), hkv, dim, generator=g).unbind(0)
    return batch, q, k, v, kv


@needs_compiler
@pytest.mark.skipif(not HAS_AVX512F, reason="no AVX-512 here: the V sums stay in the loop")
def test_decode_rows_over_a_shared_prefix_keep_the_loops_bits(cpu, fresh_build, monkeypatch):
    """Decode rows whose sequences share their first pages take the V sums in registers
    (AVX-512, float32 pages, head sizes a multiple of 64): bit-equal to the build that keeps
    attend_part's loop (-DRADIXKV_V_SUMS_IN_MEMORY), for 1-4 query heads a KV head, 64 and
    128 dims, pages of 1 and 16, ranges that start and end inside pages; a batch with no
    shared first page too (the loop in both)."""
    monkeypatch.setattr(cpu_backend, "FLAGS", cpu_backend.FLAGS + ("-DRADIXKV_V_SUMS_IN_MEMORY",))
    loop = get_backend("cpu")
    assert loop._lib is not cpu._lib
    for page_size in (1, 16):
        for hq, hkv, dim in ((9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 64), (6, 3, 64)):
            for prefix_pages, own in ((37 * 16 // page_size, [1, 5, 40, 200]), (0, [3, 300])):
                batch, q, k, v, kv = shared_prefix_decode_case(5, prefix_pages, own, page_size, hq, hkv, dim)
                out = []
                for impl in (cpu, loop):
                    impl.plan(batch)
                    out.append(impl.forward(q, k, v, kv, 0.125))
                assert same_bytes(out[0], out[1]), (page_size, hq, hkv, dim, prefix_pages)


def test_half_precision_queries_take_the_reference_path(cpu):
    lens, prefixes = [1, 1], [20, 33]
    case = random_case(4, lens, prefixes, 16, 9, 3, torch.float16, dim=64)
    batch, q, k, v, kv, *_ = case
    ref = TorchBackend()
    ref.plan(batch)
    expected = ref.forward(q, k, v, kv, 0.125)
    cpu.plan(batch)
    assert torch.equal(cpu.forward(q, k, v, kv, 0.125), expected)


# -- int8 pages, read in place ----------------------------------------------------------

# The reference dequantizes in float32, the kernel folds the scales into its sums: the
# reassociation measures about 1e-6 on these unit-variance outputs; this leaves 20x.
INT8_TOL = 2e-5


def spy_on_kernels(impl, monkeypatch):
    """Record the KV format code of each call of the decode kernel and of the extend kernel."""
    decodes, extends, lib = [], [], impl._lib

    class Spy:
        def radixkv_paged_decode(self, *args):
            decodes.append(args[-1])
            return lib.radixkv_paged_decode(*args)

        def radixkv_paged_extend(self, *args):
            extends.append(args[-1])
            return lib.radixkv_paged_extend(*args)

    monkeypatch.setattr(impl, "_lib", Spy())
    return decodes, extends


def spy_on_kernel(impl, monkeypatch):
    """Record the KV format code of each call of the C decode kernel."""
    return spy_on_kernels(impl, monkeypatch)[0]


# head sizes: 64 compiled in, 24 a multiple of 8 (vector loops), 20 neither (scalar loops)
@pytest.mark.parametrize("page_size, hq, hkv, dim", [
    (16, 9, 3, 64), (1, 9, 3, 64), (16, 8, 1, 64), (1, 8, 1, 24), (16, 9, 3, 24), (16, 8, 1, 20), (1, 9, 3, 20),
])  # fmt: skip
def test_int8_decode_reads_pages_in_place(cpu, monkeypatch, page_size, hq, hkv, dim):
    """Ragged contexts: shorter than a block of 8 tokens, at page edges, whole blocks and a
    tail; unwritten slots hold NaN parameters, so a slot read past a context shows."""
    lens, prefixes = [1] * 6, [0, 7, 15, 16, 300, 77]
    case, _, _ = int8_case(11, lens, prefixes, page_size, hq, hkv, dim)
    formats = spy_on_kernel(cpu, monkeypatch)
    check_against_dense(cpu, case, lens, scale=0.125, tol=INT8_TOL)
    assert formats == [cpu_backend._KV_INT8]


@pytest.mark.parametrize("page_size, prefixes", [(16, [3000, 40]), (1, [3000])])  # few: contexts split in ranges
def test_int8_long_context_window_and_softcap(cpu, page_size, prefixes):
    lens = [1] * len(prefixes)
    case, _, _ = int8_case(5, lens, prefixes, page_size, 9, 3, 64)
    for window, softcap in [(None, None), (100, None), (None, 30.0), (7, 2.0), (1, None)]:
        check_against_dense(cpu, case, lens, scale=0.125, window=window, softcap=softcap, tol=INT8_TOL)


def test_int8_mixed_batch_sends_decode_rows_to_the_kernel(cpu, monkeypatch):
    lens, prefixes = [1, 12, 1, 30], [50, 7, 3, 0]  # the last one attends only to its own new K/V, as stored
    case, _, _ = int8_case(2, lens, prefixes, 4, 9, 3, 64)
    calls = spy_on_sdpa_path(cpu, monkeypatch)
    formats = spy_on_kernel(cpu, monkeypatch)
    check_against_dense(cpu, case, lens, scale=0.125, tol=INT8_TOL)
    assert calls == [frozenset({0, 2})] and formats == [cpu_backend._KV_INT8]


def test_int8_with_half_precision_queries_uses_the_reference_path(cpu, monkeypatch):
    (batch, q, k, v, kv, *_), _, _ = int8_case(4, [1, 1], [20, 33], 16, 9, 3, 64)
    q, k, v = q.half(), k.half(), v.half()
    ref = TorchBackend()
    ref.plan(batch)
    expected = ref.forward(q, k, v, kv, 0.125)
    formats = spy_on_kernel(cpu, monkeypatch)
    cpu.plan(batch)
    assert torch.equal(cpu.forward(q, k, v, kv, 0.125), expected) and formats == []


@pytest.mark.parametrize("dim", [64, 24])
def test_int8_row_map_is_what_dequantize_applies(dim):
    """The kernels read stored rows y = codes * log_scales[byte] and map q and the output
    through M = format.row_map, which must be the map from y to what dequantize returns
    (a rotation's transpose, or None for none)."""
    fmt = kv_format("int8")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (5, 3, dim), generator=g).to(torch.int8)
    params = torch.randint(0, 256, (5, 3, 1), generator=g).to(torch.uint8)
    y = codes.float() * 2.0 ** ((params.float() - 128) / 8)
    m = fmt.row_map(dim)
    assert m is not None and torch.allclose(m @ m.T, torch.eye(dim), atol=1e-5)  # orthonormal
    torch.testing.assert_close(y @ m, fmt.dequantize(codes, params, torch.float32))


# -- int4 pages, read in place -----------------------------------------------------------


def int4_decode_case(seed, prefixes, page_size, hq, hkv, dim, kv_dtype="int4", lens=None):
    """A ragged batch over an int4 pool as the engine leaves it before attention, its
    unwritten codes, parameters and staging rows poisoned (0xFF codes, NaN): each prefix
    written by two earlier forwards (cut at random: whole pages sealed, a partial last
    page staged), then the new tokens (``lens``, default one each) by this forward's."""
    lens = lens or [1] * len(prefixes)
    g = torch.Generator().manual_seed(seed)
    tables = [-(-(n + p) // page_size) + 2 for n, p in zip(lens, prefixes)]
    # an even page count: KVPool cannot build an int4 pool whose num_pages * page_size is odd
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, kv_dtype=kv_dtype, num_pages=2 * sum(tables)))
    pool.k[0].fill_(255), pool.v[0].fill_(255)
    pool.k_params[0].fill_(float("nan")), pool.v_params[0].fill_(float("nan"))
    seqs, exact_k, exact_v, cuts = [], [], [], []
    for n, p, count in zip(lens, prefixes, tables):
        pages = pool.alloc(count)[torch.randperm(count, generator=g).numpy()]
        exact_k.append(torch.randn(n + p, hkv, dim, generator=g) * 3)
        exact_v.append(torch.randn(n + p, hkv, dim, generator=g))
        seqs.append(SeqInput(list(range(n)), p, pages))
        cuts.append(int(torch.randint(0, p + 1, (1,), generator=g)))
    for part in (lambda c, p: (0, c), lambda c, p: (c, p)):  # two earlier forwards, every sequence in each
        spans = [(i, *part(c, p)) for i, (c, p) in enumerate(zip(cuts, prefixes))]
        spans = [(i, a, b) for i, a, b in spans if b > a]
        if spans:
            slots = torch.cat([pool.slots(seqs[i].pages, a, b) for i, a, b in spans])
            pool.store_kv(0, torch.cat([exact_k[i][a:b] for i, a, b in spans]),
                          torch.cat([exact_v[i][a:b] for i, a, b in spans]), slots)  # fmt: skip
    batch = ForwardBatch.build(seqs, page_size, "cpu")
    k_new = torch.cat([kd[p:] for kd, p in zip(exact_k, prefixes)])
    v_new = torch.cat([vd[p:] for vd, p in zip(exact_v, prefixes)])
    pool.store_kv(0, k_new, v_new, batch.out_slots)
    q = torch.randn(batch.num_tokens, hq, dim, generator=g)
    reads = [pool.read_kv(0, pool.slots(s.pages, 0, s.num_cached + n)) for s, n in zip(seqs, lens)]  # dequantized
    return pool, batch, q, k_new, v_new, exact_k, exact_v, reads


# The kernel folds int4's (scale, offset) into its sums, centring the codes: measured up to
# 5e-6 from the float64 reference here (the torch path: up to 3e-6); this leaves 4x.
INT4_TOL = 2e-5


def check_int4(impl, case, scale, window=None, softcap=None, tol=INT4_TOL):
    """Plan and run ``impl`` on an ``int4_decode_case``: each query within ``tol`` of dense
    attention over the pages before its own page as sealed (dequantized) and its own
    page's tokens up to itself exactly as computed; the pool and its staging untouched."""
    pool, batch, q, k_new, v_new, exact_k, exact_v, reads = case
    kv = pool.view(0)
    stage_k, stage_v, slot_of = pool.sealer.staging(0)
    before = [t.clone() for t in (kv.k, kv.v, kv.k_params, kv.v_params, stage_k, stage_v, slot_of)]
    impl.plan(batch)
    out = impl.forward(q, k_new, v_new, kv, scale, sliding_window=window, logit_softcap=softcap)
    start, ps = 0, pool.page_size
    for n, total, kd, vd, (k_read, v_read) in zip(batch.qo_lens, batch.seq_lens, exact_k, exact_v, reads):
        for pos in range(total - n, total):
            own = pos // ps * ps
            k_ref, v_ref = torch.cat([k_read[:own], kd[own : pos + 1]]), torch.cat([v_read[:own], vd[own : pos + 1]])
            ref = dense_reference(q[start : start + 1], k_ref, v_ref, 1, scale, window, softcap)
            assert (out[start].double() - ref[0]).abs().max() < tol
            start += 1
    after = (kv.k, kv.v, kv.k_params, kv.v_params, stage_k, stage_v, slot_of)
    assert all(same_bytes(a, b) for a, b in zip(before, after))
    return out


# head sizes: 64, 128 and 32 multiples of 16 (vector loops), 24 not (scalar loops)
@pytest.mark.parametrize("kv_dtype, page_size, hq, hkv, dim", [
    ("int4", 16, 9, 3, 64), ("int4", 1, 9, 3, 64), ("int4", 5, 6, 2, 64), ("int4", 16, 8, 1, 128),
    ("int4", 16, 4, 4, 32), ("int4", 5, 9, 3, 24), ("int4_norot", 16, 9, 3, 64), ("int4_norot", 5, 6, 2, 24),
    ("int4_norot", 1, 8, 1, 64),
])  # fmt: skip
def test_int4_decode_reads_pages_in_place(cpu, monkeypatch, kv_dtype, page_size, hq, hkv, dim):
    """Ragged contexts (empty, within one page, at page edges, whole blocks of 8 and
    tails) over shuffled poisoned pages: the kernel reads the earlier pages sealed, the
    own page's staged rows and the new token from k/v, and nothing unwritten."""
    case = int4_decode_case(11, [0, 7, 15, 16, 300, 77], page_size, hq, hkv, dim, kv_dtype)
    formats = spy_on_kernel(cpu, monkeypatch)
    check_int4(cpu, case, scale=0.125)
    assert formats == [cpu_backend._KV_INT4]


@pytest.mark.parametrize("page_size, prefixes", [(16, [3000, 40]), (1, [3000]), (16, [30])])  # few: split in ranges
def test_int4_long_context_window_and_softcap(cpu, page_size, prefixes):
    """Contexts split into ranges over the threads (at 31 tokens a range ends inside the own
    page, another holds only own-page rows), under sliding windows that start in a sealed
    page or in the own one."""
    case = int4_decode_case(5, prefixes, page_size, 9, 3, 64)
    for window, softcap in [(None, None), (100, None), (None, 30.0), (7, 2.0), (1, None), (20, None)]:
        check_int4(cpu, case, scale=0.125, window=window, softcap=softcap)


def test_int4_mixed_batch_sends_decode_rows_to_the_kernel(cpu, monkeypatch):
    case = int4_decode_case(2, [50, 7, 3, 0, 17], 4, 9, 3, 64, lens=[1, 12, 1, 30, 3])  # chunks that fill pages
    calls, original = [], cpu.attend_paged

    def spy(*args, **kwargs):
        calls.append(kwargs.get("skip", frozenset()))
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu, "attend_paged", spy)
    formats = spy_on_kernel(cpu, monkeypatch)
    check_int4(cpu, case, scale=0.125)
    assert calls == [frozenset({0, 2})] and formats == [cpu_backend._KV_INT4]


def test_int4_matches_the_reference_backend(cpu):
    """The kernel against torch's attend_paged on the same batch (the reference reads the
    own page through gather_own)."""
    pool, batch, q, k_new, v_new, *_ = int4_decode_case(8, [40, 33, 16, 5], 16, 9, 3, 64)
    ref = TorchBackend()
    ref.plan(batch)
    expected = ref.forward(q, k_new, v_new, pool.view(0), 0.125, logit_softcap=10.0)
    cpu.plan(batch)
    torch.testing.assert_close(cpu.forward(q, k_new, v_new, pool.view(0), 0.125, logit_softcap=10.0), expected,
                               atol=INT4_TOL, rtol=0)  # fmt: skip


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """No library loaded yet in this process, and an empty cache directory."""
    monkeypatch.setattr(cpu_backend, "_library", None)
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    return tmp_path


@needs_compiler
def test_the_build_is_cached_by_source(fresh_build, monkeypatch):
    cpu_backend.load_library()
    built = sorted(fresh_build.glob("cpu_decode-*.so"))
    assert len(built) == 1 and not list(fresh_build.glob("*.tmp*"))
    monkeypatch.setattr(cpu_backend, "_library", None)
    cpu_backend.load_library()  # loads the cached file
    assert sorted(fresh_build.glob("cpu_decode-*.so")) == built
    changed = fresh_build / "changed.c"
    changed.write_text(cpu_backend.SOURCE.read_text() + "\n/* a change */\n")
    header = fresh_build / "vexp.h"  # the source's local include, beside it
    header.write_text(cpu_backend.SOURCE.with_name("vexp.h").read_text())
    monkeypatch.setattr(cpu_backend, "SOURCE", changed)
    monkeypatch.setattr(cpu_backend, "_library", None)
    cpu_backend.load_library()
    assert len(list(fresh_build.glob("cpu_decode-*.so"))) == 2
    header.write_text(header.read_text() + "\n/* a change to the header alone */\n")
    monkeypatch.setattr(cpu_backend, "_library", None)
    cpu_backend.load_library()
    assert len(list(fresh_build.glob("cpu_decode-*.so"))) == 3


@needs_compiler
def test_a_failed_build_raises_importerror_and_auto_falls_back(fresh_build, monkeypatch):
    broken = fresh_build / "broken.c"
    broken.write_text("int radixkv_paged_decode( {\n")
    monkeypatch.setattr(cpu_backend, "SOURCE", broken)
    with pytest.raises(ImportError, match="building broken.c failed"):
        get_backend("cpu")
    assert list(fresh_build.glob("*.so")) == []  # nothing half-built left behind
    assert get_backend("auto").name == "torch"


def test_no_compiler_raises_importerror_and_auto_falls_back(fresh_build, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(ImportError, match="needs a C compiler"):
        get_backend("cpu")
    assert get_backend("auto").name == "torch"


@needs_compiler
def test_auto_picks_the_kernel_for_kv_on_the_cpu():
    assert get_backend("auto").name == "cpu"  # a GPU on the machine changes nothing for CPU KV


@needs_compiler
def test_an_unwritable_cache_directory_raises_importerror(fresh_build, monkeypatch):
    blocker = fresh_build / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(blocker / "cache"))  # a directory below a file
    with pytest.raises(ImportError, match="unavailable"):
        get_backend("cpu")


@needs_compiler
def test_a_build_without_native_instructions_reads_every_format(fresh_build, monkeypatch):
    """Without -march=native (x86-64: no AVX2, FMA or F16C) the kernel's portable loops
    and int4's fp16 conversion run: same results within the same tolerances."""
    monkeypatch.setattr(cpu_backend, "FLAGS", tuple(f for f in cpu_backend.FLAGS if f != "-march=native"))
    impl = get_backend("cpu")
    lens, prefixes = [1, 1], [40, 700]
    check_against_dense(impl, int8_case(3, lens, prefixes, 16, 9, 3, 64)[0], lens, 0.125, softcap=5.0, tol=INT8_TOL)
    check_against_dense(impl, random_case(3, lens, prefixes, 16, 9, 3, torch.float32, dim=24), lens, 0.125)
    check_int4(impl, int4_decode_case(3, prefixes, 16, 9, 3, 64), 0.125, softcap=5.0)
