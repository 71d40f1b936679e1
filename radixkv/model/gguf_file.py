"""Reading GGUF files: metadata as plain Python values, tensors by name.

Our own reader of the GGUF v2/v3 format (little-endian), parsed from a read-only mmap
with ``struct.unpack_from``. The ``gguf`` package's ``GGUFReader`` builds a numpy view
per value, which for a tokenizer of ~49k strings and merges takes seconds; this one reads
the same file's header in tens of milliseconds (string arrays in one tight loop, numeric
arrays with ``np.frombuffer``) and gives the same values: ``metadata`` equals
``{name: field.contents()}`` of ``GGUFReader.fields`` and each tensor's name, shape,
type and data view equal ``GGUFReader.tensors``'. Tensor data is not read at opening:
each tensor's ``data`` views the mapped file. Shared by the weight loader and the
tokenizer.

Layout: magic ``GGUF``, version uint32, tensor count and KV count uint64; KV pairs (key
string = uint64 length + utf-8 bytes, value type uint32, value); tensor infos (name,
n_dims uint32, dims uint64 each, ggml type uint32, offset uint64); tensor data from the
next multiple of ``general.alignment`` (default 32), each tensor at its offset there.
"""

from __future__ import annotations

import math
import mmap
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from radixkv.errors import ModelLoadError

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType): scalars by struct format, numeric arrays by numpy dtype
_UINT32, _STRING, _ARRAY = 4, 8, 9
_SCALARS = {0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
            4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
            10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d")}  # fmt: skip
_DTYPES = {k: np.dtype(s.format) for k, s in _SCALARS.items()}
_U32, _U64 = _SCALARS[_UINT32], _SCALARS[10]
_HEADER = struct.Struct("<4sIQQ")
_ARRAY_HEADER = struct.Struct("<IQ")
_TENSOR_TAIL = struct.Struct("<IQ")  # ggml type, offset (after the dims)
# ggml types whose data GGUFReader views as their element type; every other type as bytes
_ELEMENT_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


class GGUFTensor(NamedTuple):
    """One tensor as ``gguf.ReaderTensor`` has it: ``shape`` in GGUF order (ne0, the
    contiguous dimension, first; uint64); ``data`` views the mapped file, read-only,
    shaped ``reversed(shape)`` in the element type for F32/F16/F64/I8..I64 and as
    uint8 with the last dimension in bytes for every other (quantized) type."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Truncated(Exception):
    pass


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> Python value, in file order, with
    ``GGUF.version``, ``GGUF.tensor_count`` and ``GGUF.kv_count`` first as GGUFReader
    has them), ``tensors`` (in file order), ``alignment`` and ``data_offset``. The file
    stays mapped as long as this object or any tensor's ``data`` is alive."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        if not p.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        try:
            with open(p, "rb") as f:
                size = p.stat().st_size
                if size < _HEADER.size:
                    raise ModelLoadError(f"{path} is not a GGUF file: truncated header ({size} bytes)")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None
        try:
            self._parse(mm)
        except BaseException:
            try:
                mm.close()
            except BufferError:  # an array still views it: unmapped when that goes
                pass
            raise

    def _parse(self, mm: mmap.mmap) -> None:
        path, size = self.path, len(mm)
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(mm, 0)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file: bad magic {magic!r} (expected b'GGUF')")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                raise ModelLoadError(f"{path}: big-endian GGUF (version {swapped}) is not supported, "
                                     "only little-endian")  # fmt: skip
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        self.version = version
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        off = _HEADER.size
        what = "metadata"
        try:
            for _ in range(n_kv):
                key, off = _string(mm, off, size, path)
                what = f"metadata value {key!r}"
                (vtype,), off = _U32.unpack_from(mm, off), off + 4
                if key in meta:
                    raise ModelLoadError(f"{path}: duplicate metadata key {key!r}")
                meta[key], off = _value(mm, off, size, vtype, path, key)
            what = "tensor infos"
            infos = []
            for _ in range(n_tensors):
                name, off = _string(mm, off, size, path)
                what = f"tensor info of {name!r}"
                (n_dims,), off = _U32.unpack_from(mm, off), off + 4
                if off + 8 * n_dims > size:
                    raise _Truncated
                dims = np.frombuffer(mm, "<u8", n_dims, off).astype(np.uint64)
                ggml_type, offset = _TENSOR_TAIL.unpack_from(mm, off + 8 * n_dims)
                off += 8 * n_dims + _TENSOR_TAIL.size
                infos.append((name, dims, ggml_type, offset))
        except (_Truncated, struct.error, OverflowError):  # an offset past the end, or past any file size
            raise ModelLoadError(f"{path}: truncated GGUF file: {what} runs past its end ({size} bytes)") from None
        self.metadata = meta
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):  # any integer type
            raise ModelLoadError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
        self.alignment = alignment
        self.data_offset = off + (-off) % alignment
        self.tensors = self._tensors(mm, infos)
        self._mmap = mm

    def _tensors(self, mm: mmap.mmap, infos: list) -> list[GGUFTensor]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        path, size, placed = self.path, len(mm), []
        names = set()
        for name, dims, ggml_type, offset in infos:
            if name in names:
                raise ModelLoadError(f"{path}: duplicate tensor {name!r}")
            names.add(name)
            try:
                qtype = GGMLQuantizationType(ggml_type)
            except ValueError:
                raise ModelLoadError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = math.prod(dims.tolist())
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            if qtype.name in _ELEMENT_DTYPES:
                dtype, count = np.dtype(_ELEMENT_DTYPES[qtype.name]), n_elements
            else:
                if not np_dims or np_dims[-1] % block_size:
                    raise ModelLoadError(f"{path}: tensor {name!r}: row size {np_dims[-1] if np_dims else 0} is not a "
                                         f"multiple of {qtype.name}'s block size {block_size}")  # fmt: skip
                np_dims = (*np_dims[:-1], np_dims[-1] // block_size * type_size)
                dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
            n_bytes = n_elements * type_size // block_size
            start = self.data_offset + offset
            if start + count * dtype.itemsize > size:
                raise ModelLoadError(f"{path}: tensor {name!r} ({n_bytes} bytes at offset {start}) runs past the end "
                                     f"of the file ({size} bytes): truncated")  # fmt: skip
            placed.append((name, qtype, dims, n_elements, n_bytes, start, dtype, count, np_dims))
        return [GGUFTensor(name, qtype, dims, n, nb, start, np.frombuffer(mm, dtype, count, start).reshape(np_dims))
                for name, qtype, dims, n, nb, start, dtype, count, np_dims in placed]


def _raw_string(mm: mmap.mmap, off: int, size: int) -> tuple[bytes, int]:
    """A GGUF string's bytes at ``off`` (uint64 length, then the bytes) and the offset after it."""
    (n,) = _U64.unpack_from(mm, off)
    end = off + 8 + n
    if end > size:
        raise _Truncated
    return mm[off + 8 : end], end


def _string(mm: mmap.mmap, off: int, size: int, path: str) -> tuple[str, int]:
    raw, end = _raw_string(mm, off, size)
    try:
        return str(raw, "utf-8"), end
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: a key or tensor name at offset {off} is not utf-8: {e}") from None


def _strings(mm: mmap.mmap, off: int, count: int, size: int) -> tuple[list[bytes], int]:
    """``count`` GGUF strings from ``off``, undecoded (the hot loop of a tokenizer's
    vocabulary and merges: one unpack and one slice each)."""
    if count > (size - off) // 8:
        raise _Truncated  # each string takes 8 bytes at least
    unpack = _U64.unpack_from
    out = [b""] * count
    for i in range(count):
        end = off + 8 + unpack(mm, off)[0]
        out[i] = mm[off + 8 : end]
        off = end
    if off > size:
        raise _Truncated
    return out, off


def _value(mm: mmap.mmap, off: int, size: int, vtype: int, path: str, key: str) -> tuple[Any, int]:
    """The value of type ``vtype`` at ``off`` and the offset after it. Arrays are lists;
    nested arrays are flattened to one list of their leaf values, as
    ``gguf.ReaderField.contents`` gives them."""
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        return scalar.unpack_from(mm, off)[0], off + scalar.size
    if vtype == _STRING:
        raw, end = _raw_string(mm, off, size)
        return _decode(raw, path, key), end
    if vtype != _ARRAY:
        raise ModelLoadError(f"{path}: metadata value {key!r} has unknown GGUF type {vtype}")
    itype, count = _ARRAY_HEADER.unpack_from(mm, off)
    off += _ARRAY_HEADER.size
    if itype == _STRING:
        raw, off = _strings(mm, off, count, size)
        return _decode_all(raw, path, key), off
    dtype = _DTYPES.get(itype)
    if dtype is not None:
        end = off + count * dtype.itemsize
        if end > size:
            raise _Truncated
        return np.frombuffer(mm, dtype, count, off).tolist(), end
    if itype != _ARRAY:
        raise ModelLoadError(f"{path}: metadata value {key!r} is an array of unknown GGUF type {itype}")
    flat: list = []
    for _ in range(count):
        inner, off = _value(mm, off, size, _ARRAY, path, key)
        flat += inner
    return flat, off


def _decode_all(raw: list[bytes], path: str, key: str) -> list[str]:
    """``raw`` decoded as utf-8: in one decode of them joined by NUL and one split when
    no string holds a NUL (a NUL byte is never part of another character's utf-8, so
    each piece decodes as it would alone), else one by one."""
    blob = b"\0".join(raw)
    if len(raw) > 1 and blob.count(0) == len(raw) - 1:
        try:
            return str(blob, "utf-8").split("\0")
        except UnicodeDecodeError:
            pass  # named below
    return [_decode(b, path, key) for b in raw]


def _decode(b: bytes, path: str, key: str) -> str:
    try:
        return str(b, "utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: metadata value {key!r} holds a string that is not utf-8: {e}") from None


@lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFFile:
    """The parsed GGUF file at ``path`` (cached per path; ``open_gguf.cache_clear()``
    drops the cached files, which unmaps each once no tensor ``data`` of it is alive).
    Raises ModelLoadError naming the path and the problem: missing, not GGUF (bad
    magic), truncated (header, metadata, tensor infos, or a tensor past the end), an
    unsupported version or a big-endian file."""
    return GGUFFile(path)


def metadata(path: str | Path) -> dict:
    """All key-value metadata of a GGUF file as Python values (str, int, float, bool,
    or lists of them), ``GGUF.version``, ``GGUF.tensor_count`` and ``GGUF.kv_count``
    included. A fresh dict (and lists) per call. Does not read tensor data."""
    meta = open_gguf(str(path)).metadata
    return {k: list(v) if isinstance(v, list) else v for k, v in meta.items()}
