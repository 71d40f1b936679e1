"""radixkv's GGUF reader against the ``gguf`` package's GGUFReader.

The same metadata (every key and value, as ``ReaderField.contents()`` gives it) and
the same tensors (name, shape, type, data view) for the embedded SmolLM2 GGUF and for
small files written here with ``gguf.GGUFWriter`` (every value type, nested and empty
arrays, F32/F16/I32 and quantized tensors, a non-default alignment); broken files
(missing, bad magic, truncated anywhere, big-endian, unknown version, corrupted bytes)
raise ModelLoadError naming the file and the problem.
"""

import struct
import time

import numpy as np
import pytest

from radixkv.errors import ModelLoadError
from radixkv.model.gguf_file import metadata, open_gguf
from radixkv.model.registry import resolve_model

gguf = pytest.importorskip("gguf")
T = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def fresh_cache():
    open_gguf.cache_clear()
    yield
    open_gguf.cache_clear()


def assert_same_as_gguf(path, full_data=None, reader=None):
    """Ours equals GGUFReader's: metadata (keys in order, values and their Python
    types), and each tensor's name, shape, type, offset, sizes and data view (shape,
    dtype, bytes; the bytes of ``full_data`` tensors only, when given)."""
    reader = reader or gguf.GGUFReader(str(path))
    ref = {name: field.contents() for name, field in reader.fields.items()}
    ours = metadata(path)
    assert list(ours) == list(ref)
    for key, value in ref.items():
        assert ours[key] == value, key
        assert type(ours[key]) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in ours[key]] == [type(v) for v in value], key
    f = open_gguf(str(path))
    assert f.data_offset == reader.data_offset and f.alignment == reader.alignment
    assert [t.name for t in f.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(f.tensors, reader.tensors):
        assert a.tensor_type is b.tensor_type, a.name
        assert np.array_equal(a.shape, b.shape) and a.shape.dtype == np.uint64, a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert not a.data.flags.writeable
        if full_data is None or a.name in full_data:
            assert a.data.tobytes() == b.data.tobytes(), a.name


# --- the embedded model ----------------------------------------------------------------


def test_embedded_model_reads_as_gguf_reads_it():
    path = resolve_model().path
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    t1 = time.perf_counter()
    open_gguf(str(path))
    t2 = time.perf_counter()
    print(f"\n{path.name}: GGUFReader {t1 - t0:.3f} s, open_gguf {t2 - t1:.3f} s")
    tensors = [t.name for t in open_gguf(str(path)).tensors]
    sample = set(tensors[::17]) | {"token_embd.weight", "output_norm.weight"}  # every type, first and last layers
    open_gguf.cache_clear()
    assert_same_as_gguf(path, full_data=sample, reader=reader)
    meta = metadata(path)
    assert len(meta["tokenizer.ggml.tokens"]) == meta["llama.vocab_size"] == 49152
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert {t.tensor_type.name for t in open_gguf(str(path)).tensors} == {"F32", "Q4_1", "Q8_0"}


def test_metadata_is_a_fresh_copy_each_call():
    path = resolve_model().path
    meta = metadata(path)
    meta["tokenizer.ggml.tokens"].append("x")
    meta["general.name"] = "changed"
    again = metadata(path)
    assert len(again["tokenizer.ggml.tokens"]) == 49152 and again["general.name"] != "changed"


def test_cache_clear_unmaps_the_file(tmp_path):
    path = write(tmp_path / "m.gguf", tensors=True)
    maps = lambda: open("/proc/self/maps").read()  # noqa: E731
    assert open_gguf(str(path)).tensors[0].data.sum() is not None
    assert str(path) in maps()
    open_gguf.cache_clear()
    assert str(path) not in maps()


# --- small files written here ----------------------------------------------------------


def write(path, alignment=None, tensors=False, kv=True, tokens=True, endianess=gguf.GGUFEndian.LITTLE):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if kv:
        w.add_uint8("t.u8", 255)
        w.add_int8("t.i8", -128)
        w.add_uint16("t.u16", 65535)
        w.add_int16("t.i16", -32768)
        w.add_uint32("t.u32", 2**32 - 1)
        w.add_int32("t.i32", -(2**31))
        w.add_uint64("t.u64", 2**64 - 1)
        w.add_int64("t.i64", -(2**63))
        w.add_float32("t.f32", 0.1)  # read back as float32's nearest double, as GGUFReader gives it
        w.add_float64("t.f64", 1 / 3)
        w.add_bool("t.true", True)
        w.add_bool("t.false", False)
        w.add_string("t.str", "héllo ▁ 東京 😀\n\x00end")
        w.add_string("t.empty_str", "")
        w.add_array("t.strs", ["a", "", "Ġ t", "<0x0A>", "😀" * 100])
        w.add_array("t.strs_with_nul", ["a\x00b", "\x00", "c"])  # read one by one, not joined by NUL
        w.add_array("t.ints", [1, -2, 3])
        w.add_array("t.floats", [0.5, -1.25, 3.1])
        w.add_array("t.bools", [True, False, True])
        for vtype in (T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64, T.FLOAT32,
                      T.FLOAT64, T.BOOL):  # fmt: skip
            values = [True, False] if vtype == T.BOOL else [0, 1, 100, 7]
            w.add_key_value(f"t.array_{vtype.name.lower()}", values, T.ARRAY, sub_type=vtype)
        w.add_array("t.nested_ints", [[1, 2], [3], [4, 5, 6]])
        w.add_array("t.nested_strs", [["x", "y"], ["z"]])
        w.add_array("t.nested_deep", [[[1.5], [2.5, 3.5]], [[4.5]]])
        if tokens:
            w.add_array("t.tokens", [f"tok{i}" for i in range(3000)])
    if tensors:
        w.add_tensor("f32", np.arange(24, dtype=np.float32).reshape(2, 3, 4))
        w.add_tensor("f16", np.linspace(-1, 1, 10, dtype=np.float16))
        w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(3, 2))
        rng = np.random.default_rng(0)
        block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_0]
        q8 = rng.integers(0, 256, size=(4, 64 // block_size * type_size), dtype=np.uint8)  # 4 rows of 64
        w.add_tensor("q8_0", q8, raw_dtype=Q.Q8_0)
        block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q4_K]
        w.add_tensor("q4_k", rng.integers(0, 256, size=(2, type_size), dtype=np.uint8), raw_dtype=Q.Q4_K)
        w.add_tensor("scalar", np.array([7.0], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 1, 4096])
def test_written_files_read_as_gguf_reads_them(tmp_path, alignment):
    path = write(tmp_path / "m.gguf", alignment=alignment, tensors=True)
    assert_same_as_gguf(path)
    f, meta = open_gguf(str(path)), metadata(path)
    assert f.alignment == (alignment or 32) and f.data_offset % f.alignment == 0
    assert meta["t.str"] == "héllo ▁ 東京 😀\n\x00end" and meta["t.u64"] == 2**64 - 1
    assert meta["t.f32"] == float(np.float32(0.1)) and meta["t.true"] is True
    assert meta["t.nested_ints"] == [1, 2, 3, 4, 5, 6]  # flattened, as ReaderField.contents() gives them
    assert meta["t.strs_with_nul"] == ["a\x00b", "\x00", "c"]
    assert meta["t.nested_strs"] == ["x", "y", "z"] and meta["t.nested_deep"] == [1.5, 2.5, 3.5, 4.5]
    tensors = {t.name: t for t in f.tensors}
    assert tensors["f32"].shape.tolist() == [4, 3, 2]  # GGUF order: ne0 first
    assert np.array_equal(tensors["f32"].data, np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    assert tensors["f16"].data.dtype == np.float16 and tensors["i32"].data.dtype == np.int32
    assert tensors["q8_0"].tensor_type is Q.Q8_0 and tensors["q8_0"].shape.tolist() == [64, 4]
    assert tensors["q8_0"].data.shape == (4, 68) and tensors["q8_0"].data.dtype == np.uint8


def test_metadata_only_and_tensors_only_files(tmp_path):
    assert_same_as_gguf(write(tmp_path / "kv.gguf"))
    path = write(tmp_path / "t.gguf", kv=False, tensors=True)
    assert_same_as_gguf(path)
    assert set(metadata(path)) == {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def raw_gguf(kvs: bytes, n_kv: int, version=3) -> bytes:
    return struct.pack("<4sIQQ", b"GGUF", version, 0, n_kv) + kvs


def gstr(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def test_empty_arrays_and_version_2(tmp_path):
    """What GGUFWriter will not write: empty arrays (top level and nested), a v2 file."""
    kvs = gstr("empty") + struct.pack("<IIQ", T.ARRAY, T.STRING, 0)
    kvs += gstr("empty_ints") + struct.pack("<IIQ", T.ARRAY, T.INT32, 0)
    kvs += gstr("nested") + struct.pack("<IIQ", T.ARRAY, T.ARRAY, 2)
    kvs += struct.pack("<IQ", T.INT32, 1) + struct.pack("<i", 5) + struct.pack("<IQ", T.INT32, 0)
    for version in (2, 3):
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(raw_gguf(kvs, 3, version))
        assert_same_as_gguf(path)
        meta = metadata(path)
        assert meta["GGUF.version"] == version
        assert (meta["empty"], meta["empty_ints"], meta["nested"]) == ([], [], [5])


# --- broken files ----------------------------------------------------------------------


def expect_error(path, match):
    open_gguf.cache_clear()
    with pytest.raises(ModelLoadError, match=match) as e:
        metadata(path)
    assert str(path) in str(e.value)


def test_missing_file_and_directory(tmp_path):
    expect_error(tmp_path / "nope.gguf", "not found")
    expect_error(tmp_path, "not found")


def test_bad_magic_and_empty_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    expect_error(path, r"not a GGUF file: bad magic b'PK\\x03\\x04'")
    path.write_bytes(b"")
    expect_error(path, "truncated header")
    path.write_bytes(b"GGUF\x03\x00")
    expect_error(path, "truncated header")


@pytest.mark.parametrize("version", [1, 4, 0x10000])
def test_unknown_version(tmp_path, version):
    path = write(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", version)
    path.write_bytes(bytes(data))
    expect_error(path, f"GGUF version {version} is not supported")


def test_big_endian(tmp_path):
    path = write(tmp_path / "m.gguf", tensors=True, endianess=gguf.GGUFEndian.BIG)
    expect_error(path, "big-endian GGUF .* not supported")


def test_truncated_anywhere(tmp_path):
    """Every cut of a file with metadata and tensors, from the header to the end of
    its last tensor, is refused as truncated."""
    path = write(tmp_path / "m.gguf", tensors=True, tokens=False)
    data = path.read_bytes()
    f = open_gguf(str(path))
    end = max(t.data_offset + t.data.nbytes for t in f.tensors)
    del f
    cut_path = tmp_path / "cut.gguf"
    for cut in [*range(0, header_end(path) + 1), *range(end - 40, end)]:
        cut_path.write_bytes(data[:cut])
        expect_error(cut_path, "truncated")
    cut_path.write_bytes(data[: end - 1])
    expect_error(cut_path, "tensor 'scalar' .* runs past the end of the file")


def header_end(path):
    open_gguf.cache_clear()
    return open_gguf(str(path)).data_offset


def test_corrupted_bytes_raise_model_load_error_or_read(tmp_path):
    """Any one header byte set to 0x00, 0x7f, 0x80 or 0xff: the file reads or is refused
    with ModelLoadError (never another exception, a hang or a huge allocation)."""
    path = write(tmp_path / "m.gguf", tensors=True, tokens=False)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    for i in range(header_end(path)):
        for value in (0x00, 0x7F, 0x80, 0xFF):
            if data[i] == value:
                continue
            bad.write_bytes(data[:i] + bytes([value]) + data[i + 1 :])
            open_gguf.cache_clear()
            try:
                metadata(bad)
            except ModelLoadError:
                pass


def test_bad_values_name_the_problem(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(raw_gguf(gstr("k") + struct.pack("<I", 13), 1))
    expect_error(path, "metadata value 'k' has unknown GGUF type 13")
    path.write_bytes(raw_gguf(gstr("k") + struct.pack("<IIQ", T.ARRAY, 42, 1), 1))
    expect_error(path, "'k' is an array of unknown GGUF type 42")
    path.write_bytes(raw_gguf(gstr("k") + struct.pack("<I", T.STRING) + gstr("a")[:8] + b"\xff", 1))
    expect_error(path, "'k' holds a string that is not utf-8")
    path.write_bytes(raw_gguf(gstr("k") + struct.pack("<IIQ", T.ARRAY, T.STRING, 3) + gstr("a") + struct.pack("<Q", 1) + b"\xff"
                              + gstr("c"), 1))  # fmt: skip
    expect_error(path, "'k' holds a string that is not utf-8")
    path.write_bytes(raw_gguf((gstr("k") + struct.pack("<IB", T.UINT8, 1)) * 2, 2))
    expect_error(path, "duplicate metadata key 'k'")
    path.write_bytes(raw_gguf(gstr("general.alignment") + struct.pack("<II", T.UINT32, 48), 1))
    expect_error(path, "general.alignment must be a power of two, got 48")
    path.write_bytes(raw_gguf(gstr("k") + struct.pack("<IIQ", T.ARRAY, T.STRING, 2**40), 1))
    expect_error(path, "truncated GGUF file: metadata value 'k' runs past its end")
