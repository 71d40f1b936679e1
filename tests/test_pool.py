import numpy as np
import pytest
import torch

from radixkv.cache import KVPool, PageAllocator, PoolConfig
from radixkv.errors import IntegrityError, OutOfPagesError
from radixkv.kernels import pages as page_loops


@pytest.fixture(autouse=True, params=["native", "numpy"])
def loops(request, monkeypatch):
    """Every allocator test runs on the compiled page loops and on their numpy twin."""
    if request.param == "numpy":
        monkeypatch.setattr(page_loops, "_native", page_loops.NumpyPages)
    elif page_loops.native() is page_loops.NumpyPages:
        pytest.skip("no C compiler here")
    return page_loops.native()


def test_alloc_hands_out_ascending_ids_with_one_reference():
    a = PageAllocator(8)
    pages = a.alloc(3)
    assert pages.dtype == np.int32
    assert pages.tolist() == [0, 1, 2]
    assert a.refcount(pages).tolist() == [1, 1, 1]
    assert a.num_free() == 5 and a.num_used() == 3
    assert a.alloc(2).tolist() == [3, 4]
    assert a.alloc(0).tolist() == []
    a.check_integrity()


def test_out_of_pages_raises_and_changes_nothing():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPagesError) as err:
        a.alloc(2)
    assert (err.value.requested, err.value.free) == (2, 1)
    assert "2 pages" in str(err.value) and "1 are free" in str(err.value)
    assert a.num_free() == 1
    assert a.alloc(1).tolist() == [3]
    a.check_integrity()


def test_freed_pages_are_reused_last_in_first_out_in_the_order_freed():
    a = PageAllocator(6)
    a.alloc(6)
    assert a.decref([4, 1]) == 2
    assert a.num_free() == 2
    assert a.alloc(1).tolist() == [4]
    assert a.alloc(1).tolist() == [1]
    assert a.free([2, 5, 0]) == 3 and a.alloc(3).tolist() == [2, 5, 0]  # freeing then allocating: same list
    a.incref([3])
    assert a.decref([3, 1, 3]) == 2 and a.alloc(2).tolist() == [3, 1]  # a repeated id goes free once, where first listed
    a.check_integrity()


def test_shared_page_is_freed_only_when_the_last_owner_drops_it():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.incref(p[:1])
    assert a.refcount(p).tolist() == [2, 1]
    assert a.decref(p) == 1  # page 1 freed, page 0 still owned once
    assert a.refcount([0]).tolist() == [1]
    assert a.num_free() == 3
    assert a.decref([0]) == 1
    assert a.num_free() == 4
    a.check_integrity()


def test_repeated_ids_count_once_per_listing():
    a = PageAllocator(4)
    p = a.alloc(1)
    a.incref([p[0], p[0]])
    assert a.refcount(p).tolist() == [3]
    assert a.decref([p[0], p[0], p[0]]) == 1
    assert a.num_free() == 4
    a.check_integrity()


@pytest.mark.parametrize("op", ["incref", "decref"])
def test_pages_nobody_owns_are_rejected_without_change(op):
    a = PageAllocator(4)
    a.alloc(2)
    before = (a.refcount([0, 1, 2, 3]).tolist(), a.num_free())
    with pytest.raises(ValueError, match="owned"):
        getattr(a, op)([1, 2])
    assert (a.refcount([0, 1, 2, 3]).tolist(), a.num_free()) == before
    a.check_integrity()


def test_over_release_with_repeats_rolls_back():
    a = PageAllocator(4)
    a.alloc(2)
    with pytest.raises(ValueError, match="released more often"):
        a.decref([0, 1, 1])
    assert a.refcount([0, 1]).tolist() == [1, 1]
    assert a.num_free() == 2
    a.check_integrity()


@pytest.mark.parametrize("bad", [[-1], [4], [2**40], [1.5], [[0, 1]]])
def test_bad_page_ids_are_rejected(bad):
    a = PageAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError):
        a.decref(bad)
    with pytest.raises(ValueError):
        a.incref(bad)
    assert a.num_free() == 0
    a.check_integrity()


@pytest.mark.parametrize("n", [0, -3, 2**31])
def test_pool_size_must_be_positive_and_int32(n):
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(n)


def test_alloc_rejects_negative_and_non_int():
    a = PageAllocator(4)
    with pytest.raises(ValueError, match="n must be >= 0"):
        a.alloc(-1)
    with pytest.raises(TypeError):
        a.alloc(1.0)


def test_check_integrity_catches_corruption():
    a = PageAllocator(4)
    p = a.alloc(2)
    a._refs[p[0]] = 0  # referenced count lost: page neither free nor owned
    with pytest.raises(IntegrityError, match="free .* referenced"):
        a.check_integrity()
    b = PageAllocator(4)
    b._refs[3] = 1  # page 3 still on the free stack
    with pytest.raises(IntegrityError, match="both free and referenced"):
        b.check_integrity()


def test_kv_pool_layout_and_slot_writes():
    cfg = PoolConfig(num_layers=2, num_kv_heads=3, head_dim=4, page_size=2, num_pages=5)
    pool = KVPool(cfg)
    assert pool.num_pages == 5 and len(pool.k) == 2 and len(pool.v) == 2
    assert pool.k[0].shape == (5, 2, 3, 4)  # [num_pages, page_size, H, D]
    pages = pool.alloc(2)  # pages 0, 1
    pool.decref(pages[:1])
    table = np.array([1, 3], dtype=np.int32)  # a sequence living in pages 1 and 3
    slots = pool.slots(table, 1, 4)  # positions 1, 2, 3
    assert slots.tolist() == [1 * 2 + 1, 3 * 2 + 0, 3 * 2 + 1]
    k = torch.arange(3, dtype=torch.float32).view(3, 1, 1).expand(3, 3, 4)
    pool.store_kv(1, k, -k, slots)
    assert torch.equal(pool.k[1][1, 1], torch.zeros(3, 4))
    assert torch.equal(pool.k[1][3, 0], torch.ones(3, 4))
    assert torch.equal(pool.k[1][3, 1], torch.full((3, 4), 2.0))
    assert torch.equal(pool.v[1][3, 1], torch.full((3, 4), -2.0))
    assert pool.k[0].abs().sum() == 0 and pool.v[0].abs().sum() == 0  # other layers untouched
    k_back, v_back = pool.read_kv(1, slots)
    assert torch.equal(k_back, k) and torch.equal(v_back, -k)
    view = pool.view(1)  # what a backend gets: the layer's pages and the format
    assert view.k is pool.k[1] and view.v is pool.v[1] and view.format.name == "fp32" and view.page_size == 2
    with pytest.raises(ValueError, match="past the page table"):
        pool.slots(table, 0, 5)


def test_kv_format_is_the_pools_not_the_writers():
    """A bf16 pool stores what it is given rounded to bf16, and sizes pages by its format."""
    pool = KVPool(PoolConfig(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, kv_dtype="bf16", num_pages=2))
    assert pool.k[0].dtype == torch.bfloat16 and pool.format.name == "bf16"
    assert pool.config.bytes_per_page == 2 * 1 * 2 * 1 * 4 * 2
    x = torch.tensor([[[1.0 + 2**-10, 3.0, -0.1, 1e-3]]], dtype=torch.float32)
    slots = pool.slots(pool.alloc(1), 1, 2)
    pool.store_kv(0, x, x, slots)
    k_back, _ = pool.read_kv(0, slots)
    assert k_back.dtype == torch.bfloat16 and torch.equal(k_back, x.to(torch.bfloat16))
    assert not torch.equal(k_back.float(), x)  # 1 + 2**-10 does not survive bf16


@pytest.mark.parametrize("spec, name", [("fp16", "fp16"), ("float16", "fp16"), (torch.bfloat16, "bf16"), ("float32", "fp32")])
def test_kv_dtype_names_and_aliases(spec, name):
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, kv_dtype=spec, num_pages=1)
    assert cfg.format.name == name


def test_kv_pool_sized_from_a_byte_budget():
    cfg = PoolConfig(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, kv_dtype=torch.float16, memory_bytes=1000)
    assert cfg.bytes_per_page == 2 * 2 * 4 * 1 * 8 * 2  # K and V, layers, tokens, heads, dim, fp16
    assert KVPool(cfg).num_pages == 1000 // 256


@pytest.mark.skipif(KVPool(PoolConfig(1, 1, 8, num_pages=1)).resident_bytes() is None, reason="needs mincore")
def test_commit_writes_the_pool_once_so_its_memory_is_resident_at_start():
    """commit=True: every page's memory is written at construction (resident now, content
    zero, commit_seconds set); without it the pool is reserved, not resident, and its
    pages become resident as they are written. Each part is 48 MiB, above any malloc
    threshold, so its memory comes fresh from the system."""
    cfg = dict(num_layers=1, num_kv_heads=3, head_dim=64, page_size=16, num_pages=4096, kv_dtype="fp32")
    nbytes = 2 * 4096 * 16 * 3 * 64 * 4
    lazy = KVPool(PoolConfig(**cfg))
    assert lazy.commit_seconds is None and lazy.resident_bytes() < nbytes // 100
    lazy.k[0][:2048] = 1.0  # half of K: a quarter of the pool
    assert 0.24 * nbytes < lazy.resident_bytes() < 0.3 * nbytes  # (a huge page may round it up)
    del lazy
    pool = KVPool(PoolConfig(**cfg, commit=True))
    assert nbytes <= pool.resident_bytes() <= nbytes + 2 * 2 * 4096 and pool.commit_seconds > 0  # + partial OS pages
    assert not pool.k[0].any() and not pool.v[0].any()
    slots = torch.tensor([5, 17], dtype=torch.int64)
    pool.alloc(2)
    pool.store_kv(0, torch.ones(2, 3, 64), torch.full((2, 3, 64), 2.0), slots)
    assert pool.k[0].view(-1, 3, 64)[slots].eq(1).all() and pool.v[0].view(-1, 3, 64)[slots].eq(2).all()
    pool.check_integrity()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_pages=None), "exactly one"),
        (dict(num_pages=4, memory_bytes=10**6), "exactly one"),
        (dict(num_pages=None, memory_bytes=10), "at least one page"),
        (dict(page_size=0, num_pages=4), "page_size"),
        (dict(head_dim=-1, num_pages=4), "head_dim"),
        (dict(kv_dtype="int3", num_pages=4), "kv_dtype must be one of"),
        (dict(kv_dtype=torch.int8, num_pages=4), "kv_dtype must be one of"),
    ],
)
def test_pool_config_errors_name_the_field(kwargs, message):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=message):
        PoolConfig(**{**base, **kwargs})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kv_pool_on_cuda():
    pool = KVPool(PoolConfig(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, num_pages=8, device="cuda"))
    pages = pool.alloc(2)
    slots = pool.slots(pages, 0, 5)
    assert slots.device.type == "cuda"
    pool.store_kv(0, torch.ones(5, 2, 8, device="cuda"), torch.ones(5, 2, 8, device="cuda"), slots)
    assert pool.k[0][pages[0]].sum().item() == 4 * 2 * 8
    pool.decref(pages)
    pool.check_integrity()


def test_free_takes_only_sole_owned_distinct_pages_and_changes_nothing_else():
    alloc = PageAllocator(8)
    pages = alloc.alloc(4)  # 0 1 2 3
    alloc.incref([pages[1], pages[1]])  # a repeat is two references
    assert alloc.refcount(pages).tolist() == [1, 3, 1, 1]
    with pytest.raises(ValueError, match=rf"exactly one owner.*\[{pages[1]}\]"):
        alloc.free([pages[0], pages[1]])
    with pytest.raises(ValueError, match=rf"pages lists ids twice: \[{pages[2]}\]"):
        alloc.free([pages[2], pages[0], pages[2]])
    with pytest.raises(ValueError, match="must lie in"):
        alloc.free([pages[0], 8])
    assert alloc.refcount(pages).tolist() == [1, 3, 1, 1] and alloc.num_free() == 4
    assert alloc.free([pages[3], pages[0]]) == 2 and alloc.refcount(pages).tolist() == [0, 3, 1, 0]
    assert alloc.alloc(2).tolist() == [3, 0]  # in the order they were freed
    alloc.check_integrity()


def test_release_frees_sole_owned_pages_and_drops_shared_ones_by_one():
    alloc = PageAllocator(8)
    pages = alloc.alloc(3)
    alloc.incref([pages[1]])
    assert alloc.release(pages) == 2 and alloc.refcount(pages).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="more often than owned"):
        alloc.release(np.array([pages[1], pages[1]], dtype=np.int32))
    assert alloc.refcount(pages).tolist() == [0, 1, 0] and alloc.num_free() == 7
    alloc.check_integrity()


def test_int4_pool_with_an_odd_number_of_slots():
    """Packed 4-bit codes: a pool of 5 pages of 3 tokens (15 slots) builds, stores and reads back."""
    pool = KVPool(PoolConfig(1, 2, 8, 3, kv_dtype="int4", num_pages=5))
    pages = pool.alloc(5)
    k = torch.randn(15, 2, 8)
    pool.store_kv(0, k, k, pool.slots(pages, 0, 15))
    back, _ = pool.read_kv(0, pool.slots(pages, 0, 15))
    assert (back - k).abs().max() < 0.5 * k.abs().max()
    pool.check_integrity()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_copy_rows_copies_a_pages_leading_slots_in_every_layer_and_nothing_else(kv_dtype):
    cfg = PoolConfig(num_layers=2, num_kv_heads=3, head_dim=32, page_size=4, kv_dtype=kv_dtype, num_pages=3)
    pool = KVPool(cfg)
    src, dst = pool.alloc(2).tolist()
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        k, v = torch.randn(8, 3, 32, generator=g), torch.randn(8, 3, 32, generator=g)
        pool.store_kv(layer, k, v, pool.slots([src, dst], 0, 8))
    parts = pool.k + pool.v + (pool.k_params + pool.v_params if pool.k_params else [])  # per layer, and int8's scales
    before = [t[dst].clone() for t in parts]
    pool.copy_rows(src, dst, 3)
    for t, old in zip(parts, before):
        assert torch.equal(t[dst, :3].view(torch.uint8), t[src, :3].view(torch.uint8))  # the same bytes
        assert torch.equal(t[dst, 3], old[3])  # slot 3 kept its own
    assert not torch.equal(pool.k[0][dst, 3], pool.k[0][src, 3])
    with pytest.raises(ValueError, match=r"count must be in \[1, 4\]"):
        pool.copy_rows(src, dst, 5)


def test_copy_rows_refuses_pages_sealed_whole():
    pool = KVPool(PoolConfig(num_layers=1, num_kv_heads=1, head_dim=32, page_size=4, kv_dtype="int4", num_pages=2))
    assert not pool.copies_rows
    with pytest.raises(ValueError, match="seals whole pages"):
        pool.copy_rows(0, 1, 2)
