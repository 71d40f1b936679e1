"""Model configuration for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM).

One frozen dataclass, built from an HF ``config.json`` dict or from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch

from radixkv.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
ROPE_KINDS = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu",)  # the gated MLP's activation (HF's hidden_act)
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's layer_types


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` leaves the frequencies alone; ``linear``
    divides them by ``factor``; ``llama3`` scales low frequencies by ``factor`` and
    blends between ``low_freq_factor`` and ``high_freq_factor`` wavelengths;
    ``longrope`` (Phi-3, HF's "su") divides each frequency by its ``short_factor`` at
    positions below ``original_max_position_embeddings`` and by its ``long_factor`` from
    there on, and scales cos and sin by ``attention_factor``.

    Per position, because a cached key is never rotated again: HF switches every
    position of a sequence to the long factors once the sequence passes the original
    length (recomputing the whole sequence), so past that length the two differ; below
    it they agree."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # Mistral-style local attention, in tokens
    sliding_layers: tuple[bool, ...] | None = None  # per layer: attends within sliding_window; None: every layer
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)
    rotary_dim: int | None = None  # leading dims of each head that RoPE rotates (Phi-3's partial_rotary_factor)
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_scaling.kind not in ROPE_KINDS:
            raise ModelLoadError(f"unsupported rope scaling {self.rope_scaling.kind!r}; supported: {', '.join(ROPE_KINDS)}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ModelLoadError(f"sliding_layers names {len(self.sliding_layers)} layers, the model has "
                                 f"{self.num_layers}")  # fmt: skip
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        rot = self.rotary_dims
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise ModelLoadError(f"the rotary dims per head (partial_rotary_factor x head_dim = {rot}) must be even "
                                 f"and within head_dim {self.head_dim}")  # fmt: skip
        s = self.rope_scaling
        if s.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(s, name)) != rot // 2:
                    raise ModelLoadError(f"rope scaling longrope: {name} must hold {rot // 2} numbers (half the rotary "
                                         f"dims), got {len(getattr(s, name))}")  # fmt: skip

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, in tokens (None: all of the context)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From an HF ``config.json`` dict."""
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model_type {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in ("mistral", "phi3")) else None
        layers = cfg["num_hidden_layers"]
        sliding = _sliding_layers(cfg, arch, layers) if window is not None else None
        if sliding is not None and not any(sliding):
            window = sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_rope_from_hf(rope, cfg, arch),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            sliding_window=window,
            sliding_layers=None if sliding is None or all(sliding) else sliding,
            qk_norm=arch == "qwen3",
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            hidden_act=cfg.get("hidden_act", "silu"),
        )

    @classmethod
    def from_gguf(cls, meta: dict, tie_word_embeddings: bool,
                  rope_factors: tuple[list[float], list[float]] | None = None) -> ModelConfig:  # fmt: skip
        """From GGUF metadata (``gguf_file.metadata``); whether the file has its own
        output matrix decides ``tie_word_embeddings``, its ``rope_factors_short`` and
        ``rope_factors_long`` tensors (Phi-3's longrope: llama.cpp's converter writes
        them as tensors, no scaling type) give ``rope_factors``."""
        arch = meta.get("general.architecture", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
            return value

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        rope = RopeScaling()
        if kind == "linear":
            rope = RopeScaling("linear", float(get("rope.scaling.factor")))
        elif kind not in ("none", None):
            raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}")
        if rope_factors is not None:
            original = get("rope.scaling.original_context_length")
            rope = RopeScaling("longrope", original_max_position_embeddings=original,
                               short_factor=tuple(map(float, rope_factors[0])),
                               long_factor=tuple(map(float, rope_factors[1])),
                               attention_factor=float(get("rope.scaling.attn_factor", 1.0)))  # fmt: skip
        head_dim = get("attention.key_length", hidden // heads)
        rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope,
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=arch == "qwen2",
            sliding_window=meta.get(f"{arch}.attention.sliding_window") or None,  # phi3 writes 0 for none
            qk_norm=arch == "qwen3",
            rotary_dim=None if rotary == head_dim else rotary,
        )

    def inv_freq(self, long: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies [rotary_dims // 2], float32, with scaling applied
        (longrope: the short factors', or with ``long`` the long factors')."""
        dim = self.rotary_dims
        s = self.rope_scaling
        if s.kind == "longrope":  # HF's order of operations: 1 / (factor * base ** (i / dim))
            factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
            return 1.0 / (factors * self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if s.kind == "linear":
            inv = inv / s.factor
        elif s.kind == "llama3":
            low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            wavelen = 2 * torch.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            blended = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = torch.where(medium, blended, scaled)
        return inv


def _sliding_layers(cfg: dict, arch: str, layers: int) -> tuple[bool, ...]:
    """Which layers attend within the sliding window: ``layer_types`` when the config
    lists them, else as HF derives them (Qwen2/3: the layers from ``max_window_layers``
    on; the others: every layer)."""
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28) if arch in ("qwen2", "qwen3") else 0
        return tuple(i >= first for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"config.json layer_types must give each of the {layers} layers one of "
                             f"{', '.join(LAYER_TYPES)}, got {types!r}")  # fmt: skip
    return tuple(t == "sliding_attention" for t in types)


def _rope_from_hf(rope: dict, cfg: dict, arch: str) -> RopeScaling:
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if arch == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # what transformers' Phi3Config reads these older names as
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    if kind == "longrope":
        # Phi-3 keeps the original length outside the rope dict; HF prefers that one
        original = int(cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                       or cfg.get("max_position_embeddings", 4096))  # fmt: skip
        factor = rope.get("factor") or cfg.get("max_position_embeddings", 4096) / original
        attention = rope.get("attention_factor")
        if attention is None:  # the LongRoPE paper's, as HF computes it
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        try:
            short, long = tuple(map(float, rope["short_factor"])), tuple(map(float, rope["long_factor"]))
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError("rope scaling longrope needs short_factor and long_factor, lists of numbers") from None
        return RopeScaling("longrope", float(factor), original_max_position_embeddings=original, short_factor=short,
                           long_factor=long, attention_factor=float(attention))  # fmt: skip
    raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_KINDS)}")
