"""Quantized weights as GGUF stores them, multiplied in place (``qmatmul.c``).

A ``PackedMatrix`` holds one weight matrix ``[rows, cols]`` as the GGUF file's blocks
(every byte kept, laid out for the kernels: ``split``, a ``uint8`` tensor ``[rows,
row_bytes]`` with each row's block scales gathered ahead of its codes for the 32-value
types; or ``panels``, Q4_0, Q4_1 and Q8_0, sixteen rows interleaved as the integer tiles
read them; ``blocks()`` gives GGUF's order back) and its ggml type.
``linear(x)`` computes ``x @ W.T`` without expanding ``W``: the kernel rounds each
token's activations to 16-bit integers per block of 32 (one float scale each) and takes
the block dot products on integers, scaled once per block. The result is the exact
product of the dequantized weights with the rounded activations, up to float32
accumulation (relative error of the rounding: ~1e-5), and batch-invariant: a token's
outputs do not depend on which other tokens share the call.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (``TYPES``). AVX2 + FMA code
when the compiler targets them (``-march=native`` on such a CPU), portable C otherwise;
OpenMP threads over rows, ``torch.get_num_threads()`` of them unless told. Built on
first use by ``radixkv.kernels.build`` (cached, keyed by source, compiler, flags, CPU);
without a C compiler ``load_library`` raises ImportError.
"""

from __future__ import annotations

import copy
import ctypes
import threading
from pathlib import Path

import torch

from radixkv.kernels import build

SOURCE = Path(__file__).with_name("qmatmul.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")

# ggml type id -> (name, values per block, bytes per block)
TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}

DENSE_FROM = 32  # tokens from which linear() takes the panel path by default
LAYOUTS = ("split", "panels")  # how a PackedMatrix lays its blocks out for the kernels (see blocks())
PANELS = 0x100  # added to a type id for the C entry points: the matrix is stored as panels
PANELS8 = 0x200  # the same for Q4_0 and Q4_1 at 8-bit activations (codes in the byte tiles' order)
PANEL_ROWS = 16  # rows a panel holds (the last one padded with zero rows)

# activation_bits -> the codes' bound: activations are rounded per block of 32 to codes
# within +-bound times a scale (16: the default; 8: llama.cpp's precision, whose byte
# products the integer panels take 1.4-1.6x as fast for Q4_0, Q4_1, Q5_0 and Q5_1)
ACTIVATION_CODES = {16: 32767, 8: 127}


def check_activation_bits(bits) -> int:
    """``bits`` if it is one of ``ACTIVATION_CODES``, else ValueError naming the field."""
    if isinstance(bits, bool) or bits not in ACTIVATION_CODES:
        raise ValueError(f"activation_bits must be one of {', '.join(map(str, ACTIVATION_CODES))}, got {bits!r}")
    return bits


_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class QMat(ctypes.Structure):
    """A matrix as the C code describes it (``qmat`` in ``qmatmul.c``)."""

    _fields_ = [("type", ctypes.c_int), ("act_max", ctypes.c_int), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("w", ctypes.c_void_p)]  # fmt: skip


class QLayer(ctypes.Structure):
    """One layer of a native model over a float32, bfloat16 or half pool (``qlayer`` in
    ``qmatmul.c``)."""

    _fields_ = [("qkv", QMat), ("o", QMat), ("gate_up", QMat), ("down", QMat), ("attn_norm", ctypes.c_void_p),
                ("mlp_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("window", ctypes.c_int64)]  # fmt: skip


class Attention(ctypes.Structure):
    """The CPU attention kernels and a step's arguments to them (``attention`` in
    ``qmatmul.c``; ``CpuBackend.step_kernels`` gives them by name)."""

    _fields_ = [("decode", _ptr), ("rows", _ptr), ("kv_starts", _ptr), ("seq_lens", _ptr), ("n_decode", _i64),
                ("extend", _ptr), ("ext_q", _ptr), ("ext_n", _ptr), ("ext_starts", _ptr), ("ext_lens", _ptr),
                ("n_extend", _i64), ("kv_indices", _ptr), ("page_size", _i64), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("kv_format", _i64), ("last", _ptr), ("dec_seq", _ptr), ("ext_seq", _ptr),
                ("ones", _ptr)]  # fmt: skip


_lock = threading.Lock()
_libraries: dict[bool, ctypes.CDLL] = {}


def load_library(portable: bool = False) -> ctypes.CDLL:
    """The compiled kernels, built into the cache directory on first use; ``portable``:
    without ``-march=native`` (the plain C loops: what a CPU without AVX2 runs)."""
    with _lock:
        if portable not in _libraries:
            flags = tuple(f for f in FLAGS if not (portable and f.startswith("-march")))
            name = "qmatmul-portable" if portable else "qmatmul"
            try:
                lib = ctypes.CDLL(str(build.build(name, SOURCE, flags, depends_on=(build.cpu_id(),), libs=("-lm",))))
            except OSError as e:
                raise ImportError(f"the quantized weight kernels are unavailable: {e}") from e
            lib.radixkv_qmatmul.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _int]
            lib.radixkv_qmatmul.restype = _int
            lib.radixkv_dequant_rows.argtypes = [_int, _ptr, _i64, _ptr, _i64, _ptr, _int]
            lib.radixkv_dequant_rows.restype = _int
            lib.radixkv_round_activations.argtypes = [_ptr, _i64, _i64, _ptr, _int, _int]
            lib.radixkv_round_activations.restype = None
            lib.radixkv_qmatmul_last_threads.restype = _int
            lib.radixkv_repack.argtypes = [_int, _ptr, _i64, _i64, _ptr, _int]
            lib.radixkv_repack.restype = _int
            lib.radixkv_panel_bytes.argtypes = [_int, _i64, _i64]
            lib.radixkv_panel_bytes.restype = _i64
            lib.radixkv_panels.argtypes = [_int, _ptr, _i64, _i64, _ptr, _int]
            lib.radixkv_panels.restype = _int
            lib.radixkv_add_rms_norm.argtypes = [_ptr, _ptr, _ptr, ctypes.c_float, _i64, _i64, _ptr, _int]
            lib.radixkv_add_rms_norm.restype = None
            lib.radixkv_silu_mul.argtypes = [_ptr, _i64, _i64, _ptr, _int]
            lib.radixkv_silu_mul.restype = None
            lib.radixkv_rope.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr]
            lib.radixkv_rope.restype = None
            lib.radixkv_sgemm_small.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int]
            lib.radixkv_sgemm_small.restype = None
            lib.radixkv_qgemm.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _int]
            lib.radixkv_qgemm.restype = _int
            q, f = ctypes.POINTER(QMat), ctypes.c_float
            lib.radixkv_qk_norm.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, f, _int]
            lib.radixkv_qk_norm.restype = None
            lib.radixkv_native_layer.argtypes = [_ptr, _i64, _i64, f, _ptr, q, _ptr, q, q, _ptr, q, _ptr, _ptr, _ptr,
                                                 _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _int]  # fmt: skip
            lib.radixkv_native_layer.restype = _int
            lib.radixkv_native_layer_floats.argtypes = [_i64, _i64, _i64]
            lib.radixkv_native_layer_floats.restype = _i64
            lib.radixkv_native_forward.argtypes = [_ptr, _i64, _i64, f, ctypes.POINTER(QLayer), _i64, _i64, _i64,
                                                   _i64, _i64, _ptr, _ptr, _ptr, ctypes.POINTER(Attention), _i64,
                                                   _ptr, _i64, _int]  # fmt: skip
            lib.radixkv_native_forward.restype = _int
            lib.radixkv_native_forward_floats.argtypes = [_i64] * 5
            lib.radixkv_native_forward_floats.restype = _i64
            _libraries[portable] = lib
        return _libraries[portable]


def small_matmul(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``x @ w.T`` for a few float32 rows ``x [n, cols]`` and float32 weights ``w [rows,
    cols]`` (contiguous, on the CPU): the rows of ``w`` shared out over the threads, each
    (row, token) dot in a fixed order, so a token's result does not depend on ``n``. A
    BLAS computes a decode-sized product on one core; a decode step is bound by reading
    ``w``, which two cores do faster. Raises ImportError without the C library."""
    lib = load_library()
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    lib.radixkv_sgemm_small(w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0], y.data_ptr(),
                            threads or torch.get_num_threads())  # fmt: skip
    return y


def row_bytes(type_id: int, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ggml type ``type_id``; ValueError when the
    type is not one of ``TYPES`` or its blocks do not divide ``cols``."""
    if type_id not in TYPES:
        raise ValueError(f"ggml type {type_id} is not supported natively (supported: "
                         f"{', '.join(n for n, _, _ in TYPES.values())})")  # fmt: skip
    name, values, nbytes = TYPES[type_id]
    if cols % values:
        raise ValueError(f"a {name} row holds a multiple of {values} values, got {cols}")
    return cols // values * nbytes


class PackedMatrix:
    """A ``[rows, cols]`` weight matrix in a GGUF quantized type, read in place.

    ``data``: ``uint8 [rows, row_bytes]`` on the CPU, the blocks of row ``r`` in
    ``data[r]`` (GGUF's order; with ``split``, already in the kernels' layout: another
    PackedMatrix's ``data``). Rows can be reordered or stacked (``stack``) without
    touching values. ``activation_bits`` (16 or 8): the precision the inputs are rounded
    to per block of 32 (``ACTIVATION_CODES``); every path rounds them alike. ``layout``:
    ``panels`` (Q4_0, Q4_1 and Q8_0 on a build with AVX2 and F16C: the tiles read
    the weights as stored, at any batch size, instead of rebuilding each panel of 16 rows
    for every product; the same bits) or ``split``; None takes panels where they can be.
    """

    def __init__(self, type_id: int, data: torch.Tensor, cols: int, portable: bool = False, split: bool = False,
                 activation_bits: int = 16, layout: str | None = None):
        expected = row_bytes(type_id, cols)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != expected:
            raise ValueError(f"{TYPES[type_id][0]} data for {cols} columns must be uint8 [rows, {expected}], "
                             f"got {data.dtype} {list(data.shape)}")  # fmt: skip
        if data.device.type != "cpu":
            raise ValueError("packed weights live on the CPU")
        if layout not in (None, *LAYOUTS):
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} (or None: the fastest the build has), "
                             f"got {layout!r}")  # fmt: skip
        self.type_id = type_id
        self.activation_bits = check_activation_bits(activation_bits)
        self.portable = portable
        self.cols = cols
        self.shape = (data.shape[0], cols)
        self._lib = load_library(portable)
        data = data.contiguous()
        kind8 = type_id | PANELS8  # the byte tiles' order: only where the kernels take it (4-bit types, 8 bits)
        byte_codes = self.act_max <= 127 and self._lib.radixkv_panel_bytes(kind8, 1, cols) > 0
        self._panel_kind = kind8 if byte_codes else type_id | PANELS  # the type as panels, for the C entry points
        self.layout, self.data = "split", None
        if layout != "split" and self._panels_possible():
            self.layout, self.data = "panels", self._to_panels(self._repack(data, to_split=False) if split else data)
        if self.data is None:
            self.data = data if split else self._repack(data, to_split=True)
        if layout == "panels" and self.layout != "panels":
            raise ValueError(f"{self.type_name} cannot be stored as panels on this build (Q4_0, Q4_1 and Q8_0, "
                             f"not portable, with AVX2 and F16C)")  # fmt: skip
        self._describe()

    def _describe(self) -> None:
        """The type as the C entry points take it (with PANELS or PANELS8 for a matrix stored
        as panels), and the matrix as ``Steps.native_layer`` passes it."""
        self._ctype = self._panel_kind if self.layout == "panels" else self.type_id
        self.described = QMat(self._ctype, self.act_max, self.shape[0], self.cols, self.data.data_ptr())

    def _panels_possible(self) -> bool:
        return not self.portable and self._lib.radixkv_panel_bytes(self._panel_kind, self.shape[0], self.cols) > 0

    def _to_panels(self, ggml: torch.Tensor) -> torch.Tensor:
        """ggml's rows as panels (``qmatmul.c``, "panels kept in memory")."""
        panels = -(-self.shape[0] // PANEL_ROWS)
        size = self._lib.radixkv_panel_bytes(self._panel_kind, self.shape[0], self.cols)
        out = torch.empty(panels, size // panels, dtype=torch.uint8)
        self._lib.radixkv_panels(self._panel_kind, ggml.data_ptr(), self.shape[0], self.cols, out.data_ptr(), 1)
        return out

    @property
    def act_max(self) -> int:
        """The bound of the activations' codes (``ACTIVATION_CODES``)."""
        return ACTIVATION_CODES[self.activation_bits]

    def _repack(self, data: torch.Tensor, to_split: bool) -> torch.Tensor:
        out = torch.empty_like(data)
        self._lib.radixkv_repack(self.type_id, data.data_ptr(), data.shape[0], self.cols, out.data_ptr(), int(to_split))
        return out

    def blocks(self) -> torch.Tensor:
        """The matrix in GGUF's layout, ``uint8 [rows, row_bytes]``. ``data`` holds the same
        values laid out for the kernels: ``split`` (each row's block scales gathered ahead
        of its codes: the kernels read eight blocks' scales at once; the K-quants as GGUF
        has them) or ``panels`` (Q4_0, Q4_1, Q8_0: sixteen rows' codes interleaved as the
        integer tiles read them, ``[panels, bytes]``)."""
        if self.layout == "panels":
            out = torch.empty(self.shape[0], row_bytes(self.type_id, self.cols), dtype=torch.uint8)
            self._lib.radixkv_panels(self._panel_kind, self.data.data_ptr(), self.shape[0], self.cols, out.data_ptr(),
                                     0)  # fmt: skip
            return out
        return self._repack(self.data, to_split=False)

    @property
    def type_name(self) -> str:
        return TYPES[self.type_id][0]

    @property
    def paths_agree(self) -> bool:
        """Whether ``linear`` gives a token the same bits on either path (the kernel, the
        panels): true for the 32-value types, whose panels take the kernel's float steps."""
        return TYPES[self.type_id][1] == 32

    def __repr__(self) -> str:
        return f"PackedMatrix({self.type_name}, {list(self.shape)})"

    @staticmethod
    def stack(parts: list[PackedMatrix]) -> PackedMatrix | None:
        """One matrix of the parts' rows in order, or None when their types, widths or
        activation bits differ (the caller keeps them apart)."""
        first, kind = parts[0], lambda p: (p.type_id, p.cols, p.activation_bits, p.portable)
        if any(kind(p) != kind(first) for p in parts):
            return None
        layouts = {p.layout for p in parts}
        if layouts == {"split"}:
            return PackedMatrix(first.type_id, torch.cat([p.data for p in parts]), first.cols, first.portable,
                                split=True, activation_bits=first.activation_bits, layout="split")  # fmt: skip
        if layouts == {"panels"} and all(p.shape[0] % PANEL_ROWS == 0 for p in parts[:-1]):
            # whole panels (only the last part's may be padded): their bytes in order are the stacked matrix's
            out = copy.copy(first)
            out.shape, out.data = (sum(p.shape[0] for p in parts), first.cols), torch.cat([p.data for p in parts])
            out._describe()
            return out
        return PackedMatrix(first.type_id, torch.cat([p.blocks() for p in parts]), first.cols, first.portable,
                            activation_bits=first.activation_bits)  # fmt: skip

    def linear(self, x: torch.Tensor, threads: int | None = None, dense: bool | None = None) -> torch.Tensor:
        """``x @ W.T`` for float32 ``x [..., cols]``: float32 ``[..., rows]``.

        The kernel multiplies the blocks in place, a few tokens against each row; with
        ``dense`` (default: from ``DENSE_FROM`` tokens on) the same product is taken on
        panels of sixteen rows that stay in cache, tiles of six tokens by the panel's rows
        (``radixkv_qgemm``, which rounds the activations as the kernel does): for the
        32-value types on integers (the rows' codes as 16-bit pairs against the
        activations' 16-bit codes, pmaddwd, or AVX512-VNNI's vpdpwssd where the CPU has it;
        with ``activation_bits`` 8, the Q4 and Q5 types as bytes against the activations' bytes,
        pmaddubsw, or AVX512-VNNI's vpdpbusd over 16 rows a zmm; exact sums per block scaled
        once per block), for the K-quants in float32 (the
        rounded activations times the weights dequantized into the panel). Both are
        batch-invariant (a fixed order of steps per output, whatever the batch, the tile or
        the threads). For the 32-value types the panels take the kernel's float steps in
        its order, so both paths give the same bits (and the kernel's call itself moves to
        the panels from 8 tokens on; a matrix stored as panels takes them at every size).
        For the K-quants they differ by float32 rounding
        (which the next layer's rounding of activations can enlarge): a caller that needs
        a token's result independent of its batch picks the path by the token alone, as
        the model does (its decode rows: the kernel; prefill and extend rows: the panels)."""
        if x.dtype != torch.float32 or x.shape[-1] != self.cols:
            raise ValueError(f"input must be float32 [..., {self.cols}], got {x.dtype} {list(x.shape)}")
        threads = threads or torch.get_num_threads()
        lead, rows = x.shape[:-1], self.shape[0]
        x2 = x.reshape(-1, self.cols).contiguous()
        n = x2.shape[0]
        y = torch.empty(n, rows, dtype=torch.float32)
        if not (n >= DENSE_FROM if dense is None else dense):
            # the type and the width were checked when the matrix was made: a failure is the allocation
            if self._lib.radixkv_qmatmul(self._ctype, self.data.data_ptr(), rows, self.cols, x2.data_ptr(), n,
                                         y.data_ptr(), self.act_max, threads) != 0:  # fmt: skip
                raise MemoryError("quantized matmul could not allocate its activation buffer")
            return y.view(*lead, rows)
        if self._lib.radixkv_qgemm(self._ctype, self.data.data_ptr(), rows, self.cols, x2.data_ptr(), n,
                                   y.data_ptr(), self.act_max, threads) != 0:  # fmt: skip
            raise MemoryError("the dense product could not allocate its panels")
        return y.view(*lead, rows)

    def rows(self, ids: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """Rows ``ids`` (every row when None) dequantized to float32 ``[len(ids), cols]``:
        an embedding lookup, or the whole matrix."""
        if ids is None:
            n, ptr = self.shape[0], None
        else:
            ids = ids.to(device="cpu", dtype=torch.int64).contiguous()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
                raise IndexError(f"row ids must be in [0, {self.shape[0]})")
            n, ptr = ids.numel(), ids.data_ptr()
        out = torch.empty(n, self.cols, dtype=torch.float32)
        self._lib.radixkv_dequant_rows(self._ctype, self.data.data_ptr(), self.cols, ptr, n, out.data_ptr(),
                                       threads or torch.get_num_threads())  # fmt: skip
        return out


class Steps:
    """The elementwise steps between a native model's products, one C call each
    (``qmatmul.c``): on float32, contiguous CPU tensors."""

    def __init__(self) -> None:
        self._lib = load_library()
        self._scratch = torch.empty(0)  # native_layer's and native_forward's buffers, kept from call to call

    def _scratch_of(self, floats: int) -> torch.Tensor:
        """The kept scratch, grown to at least ``floats`` float32 first."""
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """With ``add``: ``x += add`` in place first. Returns RMSNorm(x) * weight."""
        n, d = x.shape
        out = torch.empty_like(x)
        self._lib.radixkv_add_rms_norm(x.data_ptr(), None if add is None else add.contiguous().data_ptr(),
                                       weight.data_ptr(), eps, n, d, out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [n, 2 * inter]`` (gate first): ``[n, inter]``."""
        n, width = gate_up.shape
        out = torch.empty(n, width // 2, dtype=torch.float32)
        self._lib.radixkv_silu_mul(gate_up.data_ptr(), n, width // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding in place on the first ``heads`` heads of each row of ``x``
        (``[n, >= heads * head_dim]``, half-split layout) over the first ``rot`` dims of
        each head; ``cos``/``sin`` ``[n, rot]`` (``rot < head_dim``: partial rotary)."""
        cos, sin = cos.contiguous(), sin.contiguous()
        self._lib.radixkv_rope(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.shape[1], cos.data_ptr(),
                               sin.data_ptr())  # fmt: skip

    def qk_norm_(self, x: torch.Tensor, heads: tuple[int, int], head_dim: int, q_norm: torch.Tensor,
                 k_norm: torch.Tensor, eps: float) -> None:
        """q/k norms (Qwen3) in place on each row of ``x`` (``[n, >= (hq + hkv) *
        head_dim]``): RMSNorm times ``q_norm`` over each of its first ``hq`` heads, times
        ``k_norm`` over each of the next ``hkv`` (``heads``: (hq, hkv))."""
        hq, hkv = heads
        self._lib.radixkv_qk_norm(x.data_ptr(), x.shape[0], x.stride(0), hq, hkv, head_dim, q_norm.data_ptr(),
                                  k_norm.data_ptr(), eps, torch.get_num_threads())  # fmt: skip

    def native_layer(self, x: torch.Tensor, attn: torch.Tensor | None, layer, next_layer, eps: float,
                     heads: tuple[int, int], head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """A native layer's stretch between two attentions in one call (``x``, the residual
        ``[n, hidden]``, updated in place): with ``attn`` (``layer``'s attention output),
        its output projection, residual, MLP norm, MLP and residual; then, with
        ``next_layer``, that layer's attention norm, q/k/v projection (and bias), its q/k
        norms where it has them and RoPE on the q and k heads (``heads``: (hq, hkv); over
        the first ``cos.shape[1]`` dims of each), returned ``[n, qkv rows]``. The same arithmetic,
        bit for bit, as ``PackedMatrix.linear`` and the steps above one by one. ``layer``,
        ``next_layer``: ``LayerWeights`` whose matrices are ``PackedMatrix``."""
        n, hidden = x.shape
        after = (None,) * 4  # o, mlp_norm, gate_up, down: nothing before layer 0
        if layer is not None:
            after = (ctypes.byref(layer.o.described), layer.mlp_norm.data_ptr(), ctypes.byref(layer.gate_up.described),
                     ctypes.byref(layer.down.described))  # fmt: skip
        qkv, before = None, (None,) * 5  # attn_norm, qkv, qkv_bias, q/k norms: nothing after the last layer
        if next_layer is not None:
            qkv = torch.empty(n, next_layer.qkv.shape[0], dtype=torch.float32)
            before = (next_layer.attn_norm.data_ptr(), ctypes.byref(next_layer.qkv.described),
                      *(None if t is None else t.data_ptr()
                        for t in (next_layer.qkv_bias, next_layer.q_norm, next_layer.k_norm)))  # fmt: skip
        inter = 0 if layer is None else layer.gate_up.shape[0] // 2
        scratch = self._scratch_of(self._lib.radixkv_native_layer_floats(n, hidden, inter))
        status = self._lib.radixkv_native_layer(
            x.data_ptr(), n, hidden, eps, None if attn is None else attn.data_ptr(), *after, *before, *heads, head_dim,
            cos.shape[1], cos.data_ptr(), sin.data_ptr(), None if qkv is None else qkv.data_ptr(),
            scratch.data_ptr(), scratch.numel(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the native layer could not allocate its scratch buffers")
        return qkv

    def native_forward(self, x: torch.Tensor, layers: ctypes.Array, eps: float, heads: tuple[int, int, int],
                       cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, attention: Attention,
                       last: torch.Tensor | None) -> torch.Tensor:
        """Every layer of a step in one call (``x``, the embedded tokens ``[n, hidden]``,
        becomes the last layer's residual in place): per layer the new K/V rows written
        into the float32, bfloat16 or half pool at ``slots`` (``[n]`` int64), the
        attention (``attention``: the CPU kernels, ``CpuBackend.step_kernels``), and
        ``native_layer``'s stretch. ``last`` (contiguous int64, ascending; set as
        ``attention.last``): past the last layer's K/V only those rows, returned ``[len(last),
        hidden]`` (a view of ``x``'s first rows); None: every row, ``x``. ``layers``:
        ``QLayer`` per layer; ``heads``: (query heads, KV heads, head dim); ``cos``/``sin``
        ``[n, rot]``, RoPE over the first ``rot`` dims of each head."""
        n, hidden = x.shape
        hq, hkv, d = heads
        first = layers[0]
        scratch = self._scratch_of(self._lib.radixkv_native_forward_floats(n, hidden, first.gate_up.rows // 2,
                                                                           first.qkv.rows, hq * d))  # fmt: skip
        attention.last = None if last is None else last.data_ptr()
        status = self._lib.radixkv_native_forward(x.data_ptr(), n, hidden, eps, layers, len(layers), hq, hkv, d,
                                                  cos.shape[1], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                                  ctypes.byref(attention), 0 if last is None else len(last),
                                                  scratch.data_ptr(), scratch.numel(), torch.get_num_threads())  # fmt: skip
        if status == -2:
            raise MemoryError("the native step could not allocate its scratch buffers")
        if status != 0:
            raise RuntimeError(f"the cpu attention failed (status {status})")
        return x if last is None else x[: len(last)]
