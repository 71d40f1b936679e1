"""Load weights as HF-named tensors from a GGUF file or a local HF directory.

GGUF tensors are dequantized with the ``gguf`` package. For the architectures llama.cpp
rotates by consecutive pairs (``llama``, ``mistral``) its converter stores the q and k
projections with their rows interleaved; they are put back in HF's half-split order
here, so both sources yield the same state dict. The others (``qwen2``, ...) keep HF's
order, which llama.cpp's half-split ("NEOX") rotation reads as it is.
"""

from __future__ import annotations

import ctypes
import json
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
import torch

from radixkv.errors import ModelLoadError
from radixkv.kernels.weights import check_activation_bits
from radixkv.model.config import ModelConfig
from radixkv.model.gguf_file import metadata, open_gguf
from radixkv.model.llama import NATIVE_ARCHITECTURES, LlamaModel
from radixkv.model.registry import ModelSource, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# GGUF tensor name (per layer after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Where an architecture's names differ: Phi-3's fused projections (attn_qkv; ffn_up holds gate and up);
# Gemma's sandwich norms (HF's post_attention_layernorm follows the attention there; ffn_norm comes before the MLP).
_GEMMA_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
}
# Architectures whose q/k rows llama.cpp's converter permutes (its rope type "NORM").
_PERMUTED_ROTARY = ("llama", "mistral")
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows go from interleaved pairs back
    to HF's halves. Works for weights [rows, cols] and biases [rows]."""
    rows = w.shape[0]
    tail = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *tail).swapaxes(1, 2).reshape(rows, *tail)


def load_gguf_state_dict(path: str | Path, native: bool = False, device: str = "cpu",
                         activation_bits: int = 16) -> tuple[ModelConfig, dict]:
    """Config and HF-named tensors of a GGUF file: float32 tensors, or with ``native``
    the matrices in a quantized type the kernels read (``radixkv.kernels.weights.TYPES``)
    as ``PackedMatrix`` (their blocks unchanged, rows reordered where llama.cpp permuted
    them; on a CUDA ``device`` a ``TritonPackedMatrix`` there, the same values in planes
    its Triton kernel reads; ``activation_bits``: the CPU matrices' input precision) and
    the rest as float32 on the CPU. Raises ModelLoadError
    for an unsupported architecture or quantization type. The file's mapping is released
    afterwards: every tensor kept is a copy."""
    from gguf.quants import dequantize

    packed_types, pack = {}, None
    if native:
        from radixkv.kernels.weights import TYPES, PackedMatrix

        packed_types, pack = TYPES, partial(PackedMatrix, activation_bits=activation_bits)
        if device.startswith("cuda"):
            from radixkv.kernels.triton_weights import TritonPackedMatrix

            pack = partial(TritonPackedMatrix.from_blocks, device=device)
    reader = open_gguf(str(path))
    config = _gguf_config(path)
    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(config.architecture, {})}
    permuted = config.architecture in _PERMUTED_ROTARY
    sd = {}
    for t in reader.tensors:
        if t.name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in layer_names:
                continue  # e.g. rope_freqs, rope_factors_*: in the config instead
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        shape = [int(n) for n in reversed(t.shape)]
        if int(t.tensor_type) in packed_types and len(shape) == 2:
            w = np.asarray(t.data, dtype=np.uint8).reshape(shape[0], -1)  # [rows, row bytes]
        else:
            try:
                w = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelLoadError(f"{path}: tensor {t.name} uses unsupported quantization "
                                     f"{t.tensor_type.name}") from None  # fmt: skip
            w = np.asarray(w, dtype=np.float32).reshape(shape)
        if config.norm_offset and t.name.endswith("norm.weight"):
            w = w - np.float32(config.norm_offset)  # llama.cpp's converter stored Gemma's norms as 1 + weight
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rotary(w, config.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rotary(w, config.num_kv_heads)
        # the file is mapped read-only and unmapped below: copy what still views it (a packed matrix,
        # an F32 tensor), take the rest (dequantize's own arrays) as they are
        w = torch.from_numpy(np.array(w, order="C") if np.may_share_memory(w, t.data) else np.ascontiguousarray(w))
        sd[name] = pack(int(t.tensor_type), w, shape[1]) if w.dtype == torch.uint8 else w
    _check_complete(sd, config, path)
    del reader, t
    open_gguf.cache_clear()  # unmap the file: its pages would count in this process's memory
    return config, sd


def load_hf_state_dict(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named tensors (as stored) of an HF directory: ``config.json`` plus
    ``model.safetensors`` or shards listed in ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"{path}/config.json is missing or incomplete: {e}") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    sd = {}
    for name in files:
        sd.update(load_file(str(path / name)))
    _check_complete(sd, config, path)
    return config, sd


def _gguf_config(path) -> ModelConfig:
    """The config of a GGUF file: its metadata, whether it has an output matrix, and
    Phi-3's longrope factors (small tensors)."""
    tensors = {t.name: t for t in open_gguf(str(path)).tensors}
    factors = None
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        try:
            factors = tuple(np.asarray(tensors[f"rope_factors_{n}.weight"].data, dtype=np.float32).tolist()
                            for n in ("short", "long"))  # fmt: skip
        except KeyError as e:
            raise ModelLoadError(f"{path}: has one of rope_factors_short/long but not {e.args[0]}") from None
    return ModelConfig.from_gguf(metadata(path), "output.weight" not in tensors, factors)


def _layer_tensors(config: ModelConfig, fused: set[str] = frozenset()) -> list[str]:
    """The HF names (after ``model.layers.N.``) every layer of ``config`` needs; q/k/v
    (gate/up) as one fused matrix where ``fused`` holds ``qkv`` (``gate_up``)."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
             "mlp.down_proj.weight"]  # fmt: skip
    names += ["self_attn.qkv_proj.weight"] if "qkv" in fused else [f"self_attn.{n}_proj.weight" for n in "qkv"]
    names += ["mlp.gate_up_proj.weight"] if "gate_up" in fused else ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    if config.attention_bias:
        names += [f"self_attn.{n}_proj.bias" for n in "qkv"]
    if config.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if config.sandwich_norms:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return names


def _check_complete(sd: dict, config: ModelConfig, path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        fused = {n for n, at in (("qkv", "self_attn"), ("gate_up", "mlp")) if f"{p}{at}.{n}_proj.weight" in sd}
        needed += [p + n for n in _layer_tensors(config, fused)]
    missing = [n for n in needed if n not in sd]
    if missing:
        raise ModelLoadError(f"{path}: missing tensors, e.g. {missing[:3]} ({len(missing)} in all)")


def load_config(source: ModelSource) -> ModelConfig:
    """The model's config alone (GGUF metadata or ``config.json``), no weights read:
    what sizing the KV pool needs (``radixkv sim --pool-bytes``)."""
    if source.format == "gguf":
        return _gguf_config(source.path)
    try:
        return ModelConfig.from_hf(json.loads((Path(source.path) / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"{source.path}/config.json is missing or incomplete: {e}") from None


def load_state_dict(source: ModelSource, native: bool = False, device: str = "cpu",
                    activation_bits: int = 16) -> tuple[ModelConfig, dict]:
    if source.format == "gguf":
        return load_gguf_state_dict(source.path, native, device, activation_bits)
    return load_hf_state_dict(source.path)


def has_native_weights(source: ModelSource) -> bool:
    """Whether ``source`` is a GGUF file of an architecture the native path runs
    (``NATIVE_ARCHITECTURES``) whose matrices are mostly in quantized types the kernels
    read in place (what ``weights="auto"`` runs natively)."""
    if source.format != "gguf" or load_config(source).architecture not in NATIVE_ARCHITECTURES:
        return False
    from radixkv.kernels.weights import TYPES

    matrices = [t for t in open_gguf(str(source.path)).tensors if len(t.shape) == 2]
    return sum(int(t.tensor_type) in TYPES for t in matrices) * 2 > len(matrices)


def load_model(
    model: str | Path = "smollm2-135m-instruct",
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    native: bool = False,
    activation_bits: int = 16,
) -> LlamaModel:
    """Resolve ``model`` (a registered name, a .gguf file or an HF directory) and build
    it in ``dtype`` on ``device``; with ``native`` (a quantized GGUF; float32 on the CPU,
    float32, bfloat16 or float16 on a CUDA device) its quantized matrices stay in their
    blocks (``radixkv.kernels.weights``; on CUDA ``radixkv.kernels.triton_weights``), and
    on the CPU their inputs are rounded to ``activation_bits`` per block of 32 (16, or 8
    as llama.cpp rounds them: faster prefill, less precise; only native weights on the
    CPU take 8). Weights are read-only during inference, so loads of the same file and
    settings share one model."""
    source = resolve_model(model)
    dtype = as_dtype(dtype)
    check_activation_bits(activation_bits)
    if activation_bits != 16 and not (native and str(device).startswith("cpu")):
        raise ValueError(f"activation_bits {activation_bits} needs weights native on the CPU (the C kernels round "
                         "activations; expanded and CUDA weights compute on them unrounded)")  # fmt: skip
    if native:
        if source.format != "gguf":
            raise ValueError(f"weights native: {source.path} is not a GGUF file (its weights are not quantized blocks)")
        check_native(str(device), dtype)
        arch = load_config(source).architecture
        if arch not in NATIVE_ARCHITECTURES:
            raise ValueError(f"weights native does not run {arch} models yet (only {', '.join(NATIVE_ARCHITECTURES)}): "
                             "use weights fp32")  # fmt: skip
    return _load(source, dtype, str(device), native, activation_bits, source.path.stat().st_mtime_ns)


NATIVE_DTYPES = {"cpu": (torch.float32,), "cuda": (torch.float32, torch.bfloat16, torch.float16)}


def check_native(device: str, dtype: torch.dtype) -> None:
    """ValueError unless native weights compute in ``dtype`` on ``device``: float32 on
    the CPU (the C kernels), float32, bfloat16 or float16 on a CUDA device (Triton)."""
    if dtype not in NATIVE_DTYPES.get(device.split(":")[0], ()):
        cpu, cuda = (", ".join(str(d).removeprefix("torch.") for d in NATIVE_DTYPES[k]) for k in ("cpu", "cuda"))
        raise ValueError(f"weights native computes in {cpu} on the CPU and in {cuda} on a CUDA device, not "
                         f"{str(dtype).removeprefix('torch.')} on {device}")  # fmt: skip


@lru_cache(maxsize=2)
def _load(source: ModelSource, dtype: torch.dtype, device: str, native: bool, activation_bits: int,
          _mtime: int) -> LlamaModel:
    config, sd = load_state_dict(source, native, device, activation_bits)
    for k, v in sd.items():  # one tensor at a time: never two copies of the whole model
        if isinstance(v, torch.Tensor):
            sd[k] = v.to(device=device, dtype=dtype)
    model = LlamaModel.from_state_dict(config, sd)
    del sd
    _trim_heap()
    return model


def _trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim): loading
    frees the parts of stacked matrices and permuted rows, which would otherwise stay in
    the process's resident memory. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
