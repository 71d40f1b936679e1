"""The page loops (radixkv.kernels.pages): the compiled module and its numpy twin keep
one contract, byte for byte, and the build falls back to numpy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import PageAllocator, RadixCache
from radixkv.kernels import build, pages

SIZE = 12


def _compiled():
    impl = pages.native()
    if impl is pages.NumpyPages:
        pytest.skip("no C compiler here: only the numpy twin runs")
    return impl


ids_lists = st.lists(st.integers(-3, SIZE + 2), max_size=10).map(lambda v: np.array(v, dtype=np.int32))
states = st.lists(st.integers(0, 2), min_size=SIZE, max_size=SIZE).map(lambda v: np.array(v, dtype=np.int32))


def _both(op, *arrays_then_args):
    """Run ``op`` on copies of the arrays through each implementation; the statuses
    and the arrays afterwards."""
    out = []
    for impl in (_compiled(), pages.NumpyPages):
        copies = [a.copy() if isinstance(a, np.ndarray) else a for a in arrays_then_args]
        status = getattr(impl, op)(*copies)
        out.append((status, [c for c in copies if isinstance(c, np.ndarray)]))
    return out


@settings(max_examples=300, deadline=None)
@given(arr=states, ids=ids_lists, value=st.integers(0, 3))
def test_fill_agrees(arr, ids, value):
    (s_c, a_c), (s_n, a_n) = _both("fill", arr, ids, value)
    assert s_c == s_n and all(np.array_equal(x, y) for x, y in zip(a_c, a_n))
    if s_c:
        assert np.array_equal(a_c[0], arr)  # refused: nothing written


@settings(max_examples=300, deadline=None)
@given(held=states.map(lambda a: (a == 2).astype(np.int32)), refs=states, ids=ids_lists, owned=st.booleans())
def test_hold_agrees(held, refs, ids, owned):
    (s_c, (h_c, r_c, _)), (s_n, (h_n, r_n, _)) = _both("hold", held, refs, ids, owned)
    assert s_c == s_n
    assert np.array_equal(h_c != 0, h_n != 0) and np.array_equal(r_c, refs) and np.array_equal(r_n, refs)
    if s_c:
        assert np.array_equal(h_c, held)
    else:
        assert set(np.flatnonzero(h_c).tolist()) == set(np.flatnonzero(held).tolist()) | set(ids.tolist())


@settings(max_examples=300, deadline=None)
@given(refs=states, ids=ids_lists, top=st.integers(-1, SIZE))
def test_free_sole_agrees(refs, ids, top):
    stack = np.arange(SIZE, dtype=np.int32)
    (s_c, a_c), (s_n, a_n) = _both("free_sole", refs, stack, top, ids)
    assert s_c == s_n and all(np.array_equal(x, y) for x, y in zip(a_c, a_n))
    if s_c >= 0:
        assert s_c == top + ids.size and a_c[1][top : top + ids.size].tolist() == ids[::-1].tolist()
        assert not a_c[0][ids].any()
    else:
        assert np.array_equal(a_c[0], refs) and np.array_equal(a_c[1], stack)


def test_wrong_arrays_are_a_type_error_not_a_crash():
    impl = _compiled()
    with pytest.raises(TypeError, match="int32"):
        impl.fill(np.zeros(4, np.int64), np.zeros(1, np.int32), 1)
    with pytest.raises(TypeError, match="int32"):
        impl.fill(np.zeros(4, np.int32), np.zeros((1, 1), np.int32), 1)
    with pytest.raises((BufferError, ValueError)):
        impl.fill(np.zeros(8, np.int32)[::2], np.zeros(1, np.int32), 1)
    with pytest.raises(TypeError):
        impl.free_sole(np.zeros(4, np.int32), np.zeros(4, np.int32), 0)
    frozen = np.zeros(4, np.int32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        impl.fill(frozen, np.zeros(1, np.int32), 1)


def test_an_allocator_and_tree_on_each_implementation_serve_the_same_pages():
    runs = []
    for impl in (_compiled(), pages.NumpyPages):
        alloc = PageAllocator(16, impl)
        tree = RadixCache(alloc, 2)
        a = alloc.alloc(5)
        tree.insert(list(range(10)), a, adopt=True)
        b = alloc.alloc(3)
        alloc.free(b[::-1].copy())
        tree.evict(2)
        runs.append((alloc.alloc(6).tolist(), tree.match_prefix(list(range(10))).pages.tolist()))
        tree.check_integrity(external_refs={p: 1 for p in runs[-1][0]})
    assert runs[0] == runs[1]


def test_without_a_compiler_or_when_told_the_numpy_twin_serves(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pages, "_native", None)
    monkeypatch.setenv("RADIXKV_NATIVE_PAGES", "0")
    assert pages.native() is pages.NumpyPages
    monkeypatch.setattr(pages, "_native", None)
    monkeypatch.delenv("RADIXKV_NATIVE_PAGES")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert pages.native() is pages.NumpyPages
    assert PageAllocator(4).loops is pages.NumpyPages
    assert list(tmp_path.iterdir()) == []


def test_the_compiled_module_is_built_once_into_the_cache(monkeypatch, tmp_path):
    _compiled()
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pages, "_native", None)
    first = pages.native()
    assert first.name == "c" and len(list(tmp_path.glob("pages-*.so"))) == 1
    monkeypatch.setattr(pages, "_native", None)
    assert pages.native().name == "c" and len(list(tmp_path.glob("pages-*.so"))) == 1
