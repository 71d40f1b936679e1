"""The CPU backend's C decode kernel: values, routing of decode rows, its build and fallback."""

import pytest
import torch
from test_attention import check_against_dense, int8_case, random_case

from radixkv.cache.formats import kv_format
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
    assert calls == [frozenset({0, 2})]  # the two decode rows skipped there, computed by the kernel


def test_half_precision_cache_uses_the_reference_path(cpu):
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


def spy_on_kernel(impl, monkeypatch):
    """Record the KV format code of each call of the C kernel."""
    formats, lib = [], impl._lib

    class Spy:
        def radixkv_paged_decode(self, *args):
            formats.append(args[-1])
            return lib.radixkv_paged_decode(*args)

    monkeypatch.setattr(impl, "_lib", Spy())
    return formats


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
    monkeypatch.setattr(cpu_backend, "SOURCE", changed)
    monkeypatch.setattr(cpu_backend, "_library", None)
    cpu_backend.load_library()
    assert len(list(fresh_build.glob("cpu_decode-*.so"))) == 2


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
def test_a_build_without_native_instructions_reads_both_formats(fresh_build, monkeypatch):
    """Without -march=native (x86-64: no AVX2, FMA or F16C) the kernel's portable loops
    and fp16 conversion run: same results within the same tolerances."""
    monkeypatch.setattr(cpu_backend, "FLAGS", tuple(f for f in cpu_backend.FLAGS if f != "-march=native"))
    impl = get_backend("cpu")
    lens, prefixes = [1, 1], [40, 700]
    check_against_dense(impl, int8_case(3, lens, prefixes, 16, 9, 3, 64)[0], lens, 0.125, softcap=5.0, tol=INT8_TOL)
    check_against_dense(impl, random_case(3, lens, prefixes, 16, 9, 3, torch.float32, dim=24), lens, 0.125)
