"""Attention mass (``batch.observe``, ``backend.mass``) against explicit softmax matrices,
and attention over a page table that keeps only some pages of a longer history."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixkv.cache import KVPool, PoolConfig
from radixkv.kernels import get_backend
from radixkv.model.batch import ForwardBatch, SeqInput

LAYERS = 2


def backend(name):
    try:
        return get_backend(name)
    except ImportError as e:  # the cpu backend without a C compiler
        pytest.skip(str(e))


def spy_on_kernel(impl, monkeypatch):
    """Record, per call of the C kernel, whether it was given a mass buffer."""
    calls, lib = [], impl._lib

    class Spy:
        def radixkv_paged_decode(self, *args):
            calls.append(args[17] != 0)  # the mass pointer
            return lib.radixkv_paged_decode(*args)

    monkeypatch.setattr(impl, "_lib", Spy())
    return calls


def mass_case(seed, lens, prefixes, observe, page_size, hq, hkv, dim, kv_dtype, device="cpu"):
    """A ragged batch over a ``LAYERS``-layer pool of ``kv_dtype`` as the engine leaves it
    before attention: each sequence's pages shuffled among spare ones (a page table with
    holes), unwritten codes and parameters poisoned; each prefix written by two earlier
    forwards (cut at random: a paged format's whole pages sealed, a partial last page
    staged), the new tokens by this one. ``observe``: per sequence, its first observed new
    token or None. Returns the pool, the batch, per layer the queries and new K/V, and per
    layer and sequence a function giving the keys [L, Hkv, D] the query at KV index p
    reads (on the CPU; the rest on ``device``)."""
    g = torch.Generator().manual_seed(seed)
    tables = [-(-(n + p) // page_size) + 2 for n, p in zip(lens, prefixes)]
    pool = KVPool(PoolConfig(LAYERS, hkv, dim, page_size, kv_dtype=kv_dtype, num_pages=2 * sum(tables), device=device))
    params = [] if pool.k_params is None else pool.k_params + pool.v_params
    for t in pool.k + pool.v + params:  # poison: NaN, the largest int8 code, 4-bit codes 15, scale byte 255
        t.fill_(float("nan") if t.is_floating_point() else 127 if t.dtype == torch.int8 else 255)
    seqs, cuts = [], []
    for n, p, count, f in zip(lens, prefixes, tables, observe):
        pages = pool.alloc(count)[torch.randperm(count, generator=g).numpy()]
        seqs.append(SeqInput(list(range(n)), p, pages, observe_from=f))
        cuts.append(int(torch.randint(0, p + 1, (1,), generator=g)))
    batch = ForwardBatch.build(seqs, page_size, device)
    exact = [[(torch.randn(n + p, hkv, dim, generator=g) * 2, torch.randn(n + p, hkv, dim, generator=g))
              for n, p in zip(lens, prefixes)] for _ in range(LAYERS)]  # [layer][sequence] (K, V)  # fmt: skip
    for part in (lambda c, p: (0, c), lambda c, p: (c, p)):  # two earlier forwards, each writing every layer
        spans = [(i, *part(c, p)) for i, (c, p) in enumerate(zip(cuts, prefixes))]
        spans = [(i, a, b) for i, a, b in spans if b > a]
        if spans:
            slots = torch.cat([pool.slots(seqs[i].pages, a, b) for i, a, b in spans])
            for layer, kv in enumerate(exact):
                pool.store_kv(layer, torch.cat([kv[i][0][a:b] for i, a, b in spans]).to(device),
                              torch.cat([kv[i][1][a:b] for i, a, b in spans]).to(device), slots)  # fmt: skip
    layers = []
    for layer, kv in enumerate(exact):  # this forward
        k_new = torch.cat([kd[p:] for (kd, _), p in zip(kv, prefixes)]).to(device)
        v_new = torch.cat([vd[p:] for (_, vd), p in zip(kv, prefixes)]).to(device)
        pool.store_kv(layer, k_new, v_new, batch.out_slots)
        q = torch.randn(batch.num_tokens, hq, dim, generator=g).to(device)
        keys = []
        for s, n, (kd, _) in zip(seqs, lens, kv):
            k_read = pool.read_kv(layer, pool.slots(s.pages, 0, s.num_cached + n))[0].cpu()  # dequantized
            if pool.format.paged:  # sealed pages before the query's own page, the own page exact
                keys.append(lambda pos, k_read=k_read, kd=kd: torch.cat(
                    [k_read[: pos // page_size * page_size], kd[pos // page_size * page_size :]]))  # fmt: skip
            else:
                keys.append(lambda pos, k_read=k_read: k_read)
        layers.append((q, k_new, v_new, keys))
    return pool, batch, layers


def reference_mass(batch, layers, scale, window=None, softcap=None):
    """Per observed sequence, float64: its observed queries' full softmax matrix over the
    keys each reads (causal, windowed, soft-capped), summed over query heads, queries and
    layers."""
    out = []
    starts = np.concatenate([[0], np.cumsum(batch.qo_lens)])
    for i, first in batch.observe:
        n, total = batch.qo_lens[i], batch.seq_lens[i]
        pos = torch.arange(total - n + first, total)[:, None]  # the observed queries' KV indices
        visible = torch.arange(total)[None, :] <= pos
        if window is not None:
            visible &= torch.arange(total)[None, :] > pos - window
        mass = torch.zeros(total, dtype=torch.float64)
        for q, _, _, keys in layers:
            k = torch.stack([keys[i](int(p)) for p in pos[:, 0]]).double()  # [queries, L, Hkv, D]
            k = k.repeat_interleave(q.shape[1] // k.shape[2], dim=2)
            s = torch.einsum("thd,tkhd->thk", q[starts[i] + first : starts[i] + n].double().cpu(), k) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            mass += s.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1).sum((0, 1))
        out.append(mass)
    return out


def run_layers(impl, batch, pool, layers, scale, window=None, softcap=None):
    """Plan ``impl`` and run every layer; the outputs per layer."""
    impl.plan(batch)
    return [impl.forward(q, k, v, pool.view(layer), scale, sliding_window=window, logit_softcap=softcap)
            for layer, (q, k, v, _) in enumerate(layers)]  # fmt: skip


def check_mass(impl, case, scale, window=None, softcap=None, tol=1e-5):
    """``impl``'s mass within ``tol`` (per unit of mass) of the explicit reference; each
    layer adding heads x observed queries to each observed sequence's total (every query's
    probabilities sum to 1 per head); the outputs equal to those of the same batch
    unobserved."""
    pool, batch, layers = case
    impl.plan(batch)
    assert len(impl.mass) == len(batch.observe)
    outs, hq = [], layers[0][0].shape[1]
    for layer, (q, k, v, _) in enumerate(layers):
        outs.append(impl.forward(q, k, v, pool.view(layer), scale, sliding_window=window, logit_softcap=softcap))
        for (i, first), got in zip(batch.observe, impl.mass):
            expected = hq * (batch.qo_lens[i] - first) * (layer + 1)
            assert abs(float(got.double().sum()) - expected) < 1e-5 * expected
    for (i, first), got, ref in zip(batch.observe, impl.mass, reference_mass(batch, layers, scale, window, softcap)):
        assert got.dtype == torch.float32 and got.shape == (batch.seq_lens[i],) and got.device == pool.k[0].device
        assert (got.cpu().double() - ref).abs().max() < tol * max(1.0, float(ref.max()))
    tables, ptr = batch.kv_indices.cpu().numpy(), batch.kv_indptr.tolist()
    plain = ForwardBatch.build([SeqInput(list(range(n)), total - n, tables[ptr[i] : ptr[i + 1]])
                                for i, (n, total) in enumerate(zip(batch.qo_lens, batch.seq_lens))],
                               batch.page_size, batch.kv_indices.device)  # fmt: skip
    assert torch.equal(plain.out_slots, batch.out_slots)
    for out, unobserved in zip(outs, run_layers(impl, plain, pool, layers, scale, window, softcap)):
        assert torch.equal(out, unobserved)
    assert impl.mass == []


# mixed rows: decode (observed or not), extend observed from its first or a later new
# token, plain prefill; three decode rows, so on a few cores the C kernel splits each
# context into ranges
LENS, PREFIXES = [1, 6, 1, 20, 1, 3, 9], [40, 13, 0, 0, 77, 30, 17]
OBSERVE = [0, 2, None, 0, 0, None, 8]


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
# head sizes: 64 the kernel's compiled-in size, 24 its generic loops (and int4's scalar ones)
@pytest.mark.parametrize("page_size, hq, hkv, dim", [(16, 9, 3, 64), (5, 4, 4, 24)])
def test_mass_matches_explicit_softmax(name, kv_dtype, page_size, hq, hkv, dim):
    case = mass_case(1, LENS, PREFIXES, OBSERVE, page_size, hq, hkv, dim, kv_dtype)
    check_mass(backend(name), case, scale=dim**-0.5)


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_mass_under_window_and_softcap(name, kv_dtype):
    case = mass_case(2, LENS, PREFIXES, OBSERVE, 1, 6, 2, 32, kv_dtype)  # pages of one token
    impl = backend(name)
    for window, softcap in [(8, None), (5, 2.0)]:
        check_mass(impl, case, scale=0.3, window=window, softcap=softcap)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int4"])
def test_triton_observes_through_the_generic_path(kv_dtype):
    """Triton (compiled on a GPU, else its interpreter) adds the generic path's mass."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = mass_case(5, [1, 5, 1], [20, 3, 9], [0, 1, None], 16, 4, 2, 16, kv_dtype, device)
    check_mass(backend("triton"), case, scale=0.25, window=6, softcap=4.0)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("lens, prefixes, observe", [
    ([1] * 12, [30 + 11 * i for i in range(12)], [0, None] * 6),  # many rows: a range per context (a few cores)
    ([1], [900], [0]),  # one long row: its context split into ranges, merged
])  # fmt: skip
def test_kernel_adds_decode_mass_in_place(monkeypatch, kv_dtype, lens, prefixes, observe):
    """Observed decode rows get their mass from the C kernel (the generic path skips them),
    whether it keeps each context in one range or splits it, windowed or not."""
    impl = backend("cpu")
    case = mass_case(3, lens, prefixes, observe, 16, 9, 3, 64, kv_dtype)
    calls = spy_on_kernel(impl, monkeypatch)
    skips, generic = [], impl._observe

    def spy(*args, skip=frozenset()):
        skips.append(skip)
        return generic(*args, skip=skip)

    monkeypatch.setattr(impl, "_observe", spy)
    for window, softcap in [(None, None), (100, 5.0)]:
        check_mass(impl, case, scale=0.125, window=window, softcap=softcap)
    assert calls == [True, True, False, False] * 2  # per setting: two layers observed, then two not
    assert skips == [frozenset(i for i, f in enumerate(observe) if f is not None)] * 4  # all left to the kernel


# -- a page table that keeps only some pages of a longer history ---------------------------


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_dropped_pages_attend_exactly_to_the_kept_pages(name, page_size):
    """Sequences whose page tables list only some pages of their history (the others
    dropped and poisoned, as after eviction and reuse), with positions past their KV
    length: attention (and its mass) covers exactly the kept pages' K/V and the new
    tokens, as SDPA over those rows says."""
    hq, hkv, dim, scale = 6, 2, 32, 32**-0.5
    g = torch.Generator().manual_seed(4)
    # per sequence: history pages, the kept ones, new tokens
    layout = [(10, [0, 3, 4, 8], 1), (6, [1, 5], 7), (12, [2, 3, 6, 7, 11], 1), (8, [0], 2 * page_size + 3)]
    pool = KVPool(PoolConfig(1, hkv, dim, page_size, num_pages=64))
    seqs, refs = [], []
    for history, kept, n in layout:
        pages = pool.alloc(history)[torch.randperm(history, generator=g).numpy()]
        hist_k, hist_v = torch.randn(2, history * page_size, hkv, dim, generator=g).unbind(0)
        pool.store_kv(0, hist_k, hist_v, pool.slots(pages, 0, history * page_size))
        dropped = [p for j, p in enumerate(pages) if j not in kept]
        pool.k[0][dropped], pool.v[0][dropped] = float("nan"), float("nan")
        new_pages = pool.alloc(-(-n // page_size))
        rows = torch.cat([torch.arange(j * page_size, (j + 1) * page_size) for j in kept])
        k_new, v_new = torch.randn(2, n, hkv, dim, generator=g).unbind(0)
        cached = len(kept) * page_size
        table = np.concatenate([pages[kept], new_pages]).astype(np.int32)
        seqs.append(SeqInput(list(range(n)), cached, table, positions=list(range(history * page_size,
                                                                                 history * page_size + n)),
                             observe_from=0))  # fmt: skip
        refs.append((torch.cat([hist_k[rows], k_new]), torch.cat([hist_v[rows], v_new]), k_new, v_new))
    batch = ForwardBatch.build(seqs, page_size)
    k_new, v_new = torch.cat([r[2] for r in refs]), torch.cat([r[3] for r in refs])
    pool.store_kv(0, k_new, v_new, batch.out_slots)
    q = torch.randn(batch.num_tokens, hq, dim, generator=g)
    impl = backend(name)
    impl.plan(batch)
    out = impl.forward(q, k_new, v_new, pool.view(0), scale)
    start = 0
    for (k_ref, v_ref, _, _), n, total, mass in zip(refs, batch.qo_lens, batch.seq_lens, impl.mass):
        assert batch.positions[start] > total  # RoPE positions past the KV kept
        mask = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[start : start + n], k_ref, v_ref))
        ref = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[start : start + n], ref[0].transpose(0, 1), atol=2e-5, rtol=0)
        weights = ((qi @ ki.repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * scale).masked_fill(~mask, -torch.inf)
        torch.testing.assert_close(mass, weights.softmax(-1).sum((0, 1, 2)), atol=1e-5, rtol=0)
        start += n
