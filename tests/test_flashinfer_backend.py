"""FlashInfer backend against the torch reference on fresh random ragged paged batches.

Needs a CUDA GPU and flashinfer-python (``pip install 'radixkv[gpu]'``); skipped otherwise.
The reference is ``TorchBackend`` run in float32 on float32 copies of the same (already
rounded) inputs. Every cache slot that no sequence owns holds NaN, so a kernel that reads
past a sequence's last token, or a page it does not own, poisons its output.
"""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the flashinfer backend needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (pip install 'radixkv[gpu]')")

from radixkv.cache.formats import KVView, kv_format  # noqa: E402
from radixkv.model.batch import ForwardBatch, SeqInput  # noqa: E402
from radixkv.kernels.flashinfer_backend import FlashInferBackend, window_left  # noqa: E402
from radixkv.kernels.torch_ref import TorchBackend  # noqa: E402

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}  # atol = rtol, against a float32 reference


class Case:
    """One random batch: pages shuffled over a pool with spare (NaN) pages, the cached
    prefix of every sequence already in the pool, the new tokens' q/k/v alongside.
    ``fill(seed)`` gives the same batch fresh contents, as the next layer would see."""

    def __init__(self, seed, lens, prefixes, page_size, hq, hkv, dtype, dim=128):
        g = torch.Generator().manual_seed(seed)
        need = [-(-(n + p) // page_size) for n, p in zip(lens, prefixes)]
        self.num_pages = sum(need) + 7
        order = torch.randperm(self.num_pages, generator=g).numpy().astype(np.int32)
        seqs, self.prefix_slots, start = [], [], 0
        for n, p, m in zip(lens, prefixes, need):
            pages = order[start : start + m]
            start += m
            pos = np.arange(p)
            slots = pages[pos // page_size].astype(np.int64) * page_size + pos % page_size
            self.prefix_slots.append(torch.from_numpy(slots))
            seqs.append(SeqInput(list(range(n)), p, pages))
        self.batch = ForwardBatch.build(seqs, page_size, device="cuda")
        self.shape = (hq, hkv, dim, page_size, dtype)
        self.fill(seed)

    def fill(self, seed):
        g = torch.Generator().manual_seed(seed)
        hq, hkv, dim, page_size, dtype = self.shape
        k_cache = torch.full((self.num_pages, page_size, hkv, dim), float("nan"), dtype=dtype)  # poisoned
        v_cache = torch.full_like(k_cache, float("nan"))
        for slots in self.prefix_slots:
            k_cache.view(-1, hkv, dim)[slots] = torch.randn(len(slots), hkv, dim, generator=g).to(dtype)
            v_cache.view(-1, hkv, dim)[slots] = torch.randn(len(slots), hkv, dim, generator=g).to(dtype)
        t = self.batch.num_tokens
        self.q = torch.randn(t, hq, dim, generator=g).to(dtype).cuda()
        self.k = torch.randn(t, hkv, dim, generator=g).to(dtype).cuda()
        self.v = torch.randn(t, hkv, dim, generator=g).to(dtype).cuda()
        self.k_cache, self.v_cache = k_cache.cuda(), v_cache.cuda()
        # the new tokens at their slots, as the pool's store_kv leaves them before attention
        hkv_, dim_ = k_cache.shape[2:]
        self.k_cache.view(-1, hkv_, dim_)[self.batch.out_slots] = self.k
        self.v_cache.view(-1, hkv_, dim_)[self.batch.out_slots] = self.v
        self.kv = KVView(self.k_cache, self.v_cache, kv_format(dtype))
        # float32 copies for the reference, and to prove the backend wrote nothing
        self.ref_k_cache, self.ref_v_cache = self.k_cache.float(), self.v_cache.float()
        self.ref_kv = KVView(self.ref_k_cache, self.ref_v_cache, kv_format(torch.float32))

    def reference(self, scale, window=None, softcap=None):
        ref = TorchBackend()
        ref.plan(self.batch)
        q, k, v = self.q.float(), self.k.float(), self.v.float()
        return ref.forward(q, k, v, self.ref_kv, scale, window, softcap)

    def check(self, impl, scale, window=None, softcap=None):
        out = impl.forward(self.q, self.k, self.v, self.kv, scale, window, softcap)
        assert out.shape == self.q.shape and out.dtype == self.q.dtype
        assert not out.isnan().any()
        tol = TOL[self.q.dtype]
        torch.testing.assert_close(out.float(), self.reference(scale, window, softcap), atol=tol, rtol=tol)
        # the backend only read the pool: every value (NaN poison included) as it was
        for cache, ref in ((self.k_cache, self.ref_k_cache), (self.v_cache, self.ref_v_cache)):
            assert torch.equal(cache.isnan(), ref.isnan())
            assert torch.equal(cache.float().nan_to_num(), ref.nan_to_num())


def random_lens(seed, n=6):
    rng = np.random.default_rng(seed)
    return rng.choice([1, 5, 37, 130], n).tolist(), rng.integers(0, 101, n).tolist()


CASES = [
    ([1, 5, 37, 130], [0, 3, 100, 17]),  # extend: ragged new tokens on ragged prefixes
    ([1, 1, 1, 1, 1], [0, 9, 64, 100, 33]),  # pure decode: the decode wrapper
    ([130], [0]),  # plain prefill
    ([1], [77]),  # a single decode
    random_lens(1),
    random_lens(2),
]


@pytest.mark.parametrize("lens, prefixes", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_reference(lens, prefixes, page_size, hq, hkv, dtype):
    case = Case(11, lens, prefixes, page_size, hq, hkv, dtype)
    impl = FlashInferBackend()
    impl.plan(case.batch)
    case.check(impl, scale=128**-0.5)
    case.fill(12)  # the next layer: same batch and plan, other caches and inputs
    case.check(impl, scale=128**-0.5)


@pytest.mark.parametrize("lens, prefixes", [([1, 5, 37, 130], [40, 3, 100, 0]), ([1, 1, 1, 1], [40, 3, 100, 0])])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sliding_window_and_softcap(lens, prefixes, dtype):
    """Settings change between forwards on one plan: each change re-plans."""
    case = Case(5, lens, prefixes, 16, 12, 4, dtype)
    impl = FlashInferBackend()
    impl.plan(case.batch)
    for window, softcap in [(8, None), (1, None), (64, None), (None, 5.0), (8, 5.0), (None, None)]:
        case.check(impl, 0.3, window, softcap)


def test_head_dim_64_with_three_queries_per_kv_head():
    """The default model's shape: 9 query heads on 3 KV heads of 64."""
    for lens, prefixes in CASES[:2]:
        case = Case(3, lens, prefixes, 16, 9, 3, torch.bfloat16, dim=64)
        impl = FlashInferBackend()
        impl.plan(case.batch)
        case.check(impl, scale=0.125)


def test_one_instance_serves_successive_batches():
    impl = FlashInferBackend()
    workspace = None
    for seed, (lens, prefixes) in enumerate([CASES[1], CASES[0], CASES[1], CASES[2]]):
        case = Case(seed, lens, prefixes, 16, 12, 4, torch.float16)
        impl.plan(case.batch)
        case.check(impl, scale=128**-0.5)
        workspace = workspace if workspace is not None else impl._workspace
        assert impl._workspace is workspace  # allocated once


def test_window_left_follows_flashinfer_inclusive_convention():
    assert window_left(None) == -1
    assert window_left(1) == 0  # only the query's own position
    assert window_left(8) == 7
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        window_left(0)


def test_cpu_batch_is_refused():
    case_batch = ForwardBatch.build([SeqInput([1], 0, np.array([0], dtype=np.int32))], 16)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        FlashInferBackend().plan(case_batch)
