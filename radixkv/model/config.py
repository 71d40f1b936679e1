"""Model configuration for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2, Gemma 3's text model, SmolLM).

One frozen dataclass, built from an HF ``config.json`` dict or from GGUF metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from radixkv.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
HF_MODEL_TYPES = {**{a: a for a in SUPPORTED_ARCHITECTURES if a != "gemma3"}, "gemma3_text": "gemma3"}
GEMMA = ("gemma2", "gemma3")
ROPE_KINDS = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")  # the gated MLP's activation (HF's hidden_act)
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
    sliding_layers: tuple[bool, ...] | None = None  # per layer: a sliding layer; None: all when there is a window
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    rotary_dim: int | None = None  # leading dims of each head that RoPE rotates (Phi-3's partial_rotary_factor)
    hidden_act: str = "silu"
    # Gemma 2/3:
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + weight), in float32 (Gemma: 1)
    sandwich_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs too
    embed_scale: float | None = None  # embeddings times this, in the activation dtype (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # the attention scale is its ** -0.5; None: head_dim's
    attn_logit_softcap: float | None = None  # attention logits become cap * tanh(logit / cap)
    final_logit_softcap: float | None = None  # output logits likewise
    local_rope_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3); None: as the others

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

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window ("local") layer: per ``sliding_layers``,
        else every layer when there is a window."""
        return self.sliding_layers[layer] if self.sliding_layers is not None else self.sliding_window is not None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, in tokens (None: all of the context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with ``local_rope_theta`` (Gemma 3's sliding layers)."""
        return self.local_rope_theta is not None and self.is_sliding(layer)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From an HF ``config.json`` dict."""
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3":
            raise ModelLoadError("model_type 'gemma3' in config.json is Gemma 3 with its vision tower; radixkv runs "
                                 "the text model alone (model_type gemma3_text)")  # fmt: skip
        arch = HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(HF_MODEL_TYPES)}"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError("config.json use_bidirectional_attention: only causal attention is supported")
        gemma = arch in GEMMA
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        local_theta = None
        if arch == "gemma3":  # the sliding layers' RoPE: its own base, never scaled
            local = cfg.get("rope_parameters", {}).get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ModelLoadError(f"config.json rope_parameters.sliding_attention: rope type "
                                     f"{local['rope_type']!r} on sliding layers is not supported, only default")
            local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        if "full_attention" in rope:  # per layer type (Gemma 3): the global layers' entry
            rope = rope["full_attention"] or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 1e6 if arch == "gemma3" else 10000.0))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        uses_window = cfg.get("use_sliding_window", arch in ("mistral", "phi3", *GEMMA))
        window = cfg.get("sliding_window", 4096 if gemma else None) if uses_window else None
        layers = cfg["num_hidden_layers"]
        sliding = _sliding_layers(cfg, arch, layers) if window is not None or local_theta is not None else None
        if sliding is not None and all(sliding) and window is not None:
            sliding = None  # every layer slides: the default
        if sliding is not None and not any(sliding):
            window = sliding = local_theta = None
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        cap = 30.0 if arch == "gemma2" else None  # transformers' default final soft-cap
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_rope_from_hf(rope, cfg, arch),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            sliding_window=window,
            sliding_layers=sliding,
            qk_norm=arch in ("qwen3", "gemma3"),
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            hidden_act=act,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if gemma else None,
            # transformers' Gemma 3 attention takes no soft-cap, whatever its config says
            attn_logit_softcap=cfg.get("attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
            final_logit_softcap=cfg.get("final_logit_softcapping", cap) if gemma else None,
            local_rope_theta=local_theta,
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
        layers = get("block_count")
        window = meta.get(f"{arch}.attention.sliding_window") or None  # phi3 writes 0 for none
        gemma, sliding, local_theta = arch in GEMMA, None, None
        if gemma:  # as llama.cpp reads them (llama-model.cpp): nothing in the file says the layers' pattern
            if arch == "gemma2":
                window = window or 4096
            if window is not None:
                every = 2 if arch == "gemma2" else 6  # each every-th layer is global, the others slide
                sliding = tuple(i % every < every - 1 for i in range(layers))
                if arch == "gemma3":
                    local_theta = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        # llama.cpp scales the queries by 1/sqrt(head_dim), but for the 27B models (Gemma 2: 46 layers,
        # Gemma 3: 62) by 1/sqrt(hidden / heads): their query_pre_attn_scalar
        big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
        cap = 30.0 if arch == "gemma2" else None  # llama.cpp's default final soft-cap
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope,
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=arch == "qwen2",
            sliding_window=window,
            sliding_layers=sliding,
            qk_norm=arch in ("qwen3", "gemma3"),
            rotary_dim=None if rotary == head_dim else rotary,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            norm_offset=1.0 if gemma else 0.0,  # llama.cpp's converter wrote 1 + weight; the loader takes the 1 off
            sandwich_norms=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            query_pre_attn_scalar=(hidden // heads if big else head_dim) if gemma else None,
            attn_logit_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", 50.0)) if arch == "gemma2" else None,
            final_logit_softcap=_softcap(meta.get(f"{arch}.final_logit_softcapping", cap)),
            local_rope_theta=local_theta,
        )

    def inv_freq(self, long: bool = False, local: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies [rotary_dims // 2], float32, with scaling applied
        (longrope: the short factors', or with ``long`` the long factors'); with ``local``,
        those of the sliding layers that have their own base (``local_rope_theta``,
        unscaled). Without: the global layers' (what ``kv_rerotate`` rotates by; it is
        refused for sliding-window models)."""
        dim = self.rotary_dims
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        if local and self.local_rope_theta is not None:
            return 1.0 / (self.local_rope_theta**exponents)
        s = self.rope_scaling
        if s.kind == "longrope":  # HF's order of operations: 1 / (factor * base ** (i / dim))
            factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
            return 1.0 / (factors * self.rope_theta**exponents)
        inv = 1.0 / (self.rope_theta**exponents)
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


def _softcap(value) -> float | None:
    return float(value) if value else None  # 0 or none: no soft-capping


def _sliding_layers(cfg: dict, arch: str, layers: int) -> tuple[bool, ...]:
    """Which layers attend within the sliding window: ``layer_types`` when the config
    lists them, else as HF derives them (Qwen2/3: the layers from ``max_window_layers``
    on; Gemma 2: every other layer from the first, Gemma 3: all but each
    ``sliding_window_pattern``-th; the others: every layer)."""
    types = cfg.get("layer_types")
    if types is None:
        if arch in GEMMA:
            every = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", 6)
            if not isinstance(every, int) or every < 1:
                raise ModelLoadError(f"config.json sliding_window_pattern must be a positive integer, got {every!r}")
            return tuple((i + 1) % every != 0 for i in range(layers))
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
