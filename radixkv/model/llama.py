"""Llama-family decoder over a paged KV pool (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2, Gemma 3's text model, SmolLM).

RMSNorm, RoPE (half-split layout, as HF stores q/k), GQA/MQA attention through a
backend from ``radixkv.kernels``, gated MLP, tied or untied output head; per
architecture (``ModelConfig``) q/k/v biases, per-head q/k norms, sliding windows on
all or some layers, RoPE on the leading part of each head, longrope, q/k/v (gate/up)
stored fused, and Gemma's pieces: (1 + weight) norms, norms after the attention and the
MLP too, scaled embeddings, a GeLU MLP, its own attention scale, soft-capped attention
and output logits, and a RoPE base of their own for the sliding layers. One
``forward`` computes a whole ragged batch (``ForwardBatch``): every sequence's new
tokens, attending to the KV already in the pool; per layer the pool stores the new
tokens' K/V at ``out_slots`` (in its KV format) and the backend reads the layer's view.

The arithmetic follows HF transformers' Llama step by step (norms in float32, the
same RoPE tables), so results match it to float rounding.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, fields
from functools import cache, partial
from typing import Callable

import torch
import torch.nn.functional as F

from radixkv.cache.pool import KVPool
from radixkv.model.batch import ForwardBatch
from radixkv.kernels import AttentionBackend, get_backend
from radixkv.model.config import ModelConfig

from radixkv.kernels.weights import Attention, PackedMatrix, QLayer, Steps, load_library, small_matmul  # the C library builds on first use


class Stacked:
    """Matrices whose rows are stacked but that cannot share one tensor (a GGUF file may
    give q, k and v different quantized types): ``linear`` is their outputs side by side."""

    def __init__(self, parts: list):
        self.parts = parts

    def linear(self, x: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
        return torch.cat([_linear(x, p, dense=dense) for p in self.parts], dim=-1)


# a weight matrix [out, in] as _linear takes it; on a CUDA device a packed one is a TritonPackedMatrix
# (radixkv.kernels.triton_weights: the same interface as PackedMatrix, imported only there)
Matrix = torch.Tensor | PackedMatrix | Stacked


def _packed(m) -> bool:
    """Whether ``m`` is one packed matrix (on the CPU or a CUDA device), not a tensor or a
    ``Stacked`` of parts."""
    return not isinstance(m, (torch.Tensor, Stacked))


def stack_rows(parts: list) -> Matrix:
    """``parts``' rows in order as one matrix: a tensor or PackedMatrix when they share a
    type, else a ``Stacked`` of them."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(_packed(p) and type(p) is type(parts[0]) for p in parts):
        packed = type(parts[0]).stack(parts)
        if packed is not None:
            return packed
    return Stacked(parts)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [(Hq + 2 Hkv) * D, hidden]: q, k, v projections stacked
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) * D] (Qwen2)
    o: Matrix  # [hidden, Hq * D]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [2 * intermediate, hidden]: gate, up stacked
    down: Matrix  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [D], over each query head before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [D], over each key head
    post_attn_norm: torch.Tensor | None = None  # [hidden], on the attention's output (Gemma 2/3)
    post_mlp_norm: torch.Tensor | None = None  # [hidden], on the MLP's output


# Architectures the native (packed GGUF blocks) path runs; the others load expanded (weights fp32).
NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu}


class LlamaModel:
    """Weights and the forward pass. Build with ``from_state_dict`` (HF tensor names)."""

    def __init__(self, config: ModelConfig, embed: Matrix, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: Matrix):  # fmt: skip
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden]; the embedding itself when tied
        # activations' (packed matrices compute in float32; Gemma's norms are float32 whatever the dtype)
        self.dtype = embed.dtype if isinstance(embed, torch.Tensor) else norm.dtype
        self.device = norm.device
        self.native = any(":" in name for name, _ in self.tensors())  # a packed matrix, alone or stacked
        # the CPU packed matrices' input precision (one per model: the loader packs them alike; 16 without any)
        cpu_packed = [p for _, m in self._matrices() for p in (m.parts if isinstance(m, Stacked) else [m])
                      if isinstance(p, PackedMatrix)]  # fmt: skip
        self.activation_bits = cpu_packed[0].activation_bits if cpu_packed else 16
        # on the CPU the steps between products run in C; on CUDA the dense loop's torch steps around Triton products
        native_cpu = self.native and self.device.type == "cpu"
        # Tensor parallelism (radixkv.model.tp): sums a partial ``[T, hidden]`` in place
        # across the ranks, after o_proj and after down_proj; None: the whole model here.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        self._rope_cache: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # by local (sliding layers' own base)
        self._act = _ACTIVATIONS[config.hidden_act]
        self._steps = Steps() if native_cpu else None  # a native model's elementwise steps, in C
        # a step's layers run in C calls (one in all, or one a stretch between attentions) on packed matrices alone
        self._described: tuple | None = None  # (weakref to a pool, its layers for Steps.native_forward)
        self._one_call_layers = (native_cpu and all(isinstance(getattr(w, n), PackedMatrix)
                                         for w in layers for n in ("qkv", "o", "gate_up", "down")))  # fmt: skip
        # and prefill and extend rows too where no matrix needs its rows routed by sequence
        self._no_routing = all(_paths_agree(getattr(w, n)) for w in layers for n in ("qkv", "o", "gate_up", "down"))

    def _matrices(self) -> list[tuple[str, Matrix]]:
        out = [("embed", self.embed), ("norm", self.norm)]
        if self.lm_head is not self.embed:
            out.append(("lm_head", self.lm_head))
        for i, layer in enumerate(self.layers):
            out += [(f"layers.{i}.{f.name}", getattr(layer, f.name)) for f in fields(layer)
                    if getattr(layer, f.name) is not None]  # fmt: skip
        return out

    def tensors(self, stored: bool = True) -> list[tuple[str, torch.Tensor]]:
        """Every weight tensor by name, as loaded (a head tied to the embedding once);
        a packed matrix named with its type (``layers.0.o:Q4_1``), as the bytes it is
        stored in or, with ``stored=False``, as GGUF's blocks where it can give them back
        (``PackedMatrix.blocks()``: the same whatever layout this CPU's kernels chose); the
        parts of a ``Stacked`` one by one."""
        out = []
        for name, m in self._matrices():
            for j, part in enumerate(m.parts if isinstance(m, Stacked) else [m]):
                label = f"{name}.{j}" if isinstance(m, Stacked) else name
                if not _packed(part):
                    out.append((label, part))
                else:
                    data = part.data if stored or not hasattr(part, "blocks") else part.blocks()
                    out.append((f"{label}:{part.type_name}", data))
        return out

    def weights_summary(self) -> dict:
        """How the weights are held: ``mode`` (``native``: some matrices in their GGUF
        blocks, else the dtype), their bytes, the matrices per type, and for native
        weights the bits their inputs are rounded to."""
        types: dict[str, int] = {}
        nbytes = 0
        for name, t in self.tensors():
            kind = name.rsplit(":", 1)[1] if ":" in name else str(t.dtype).removeprefix("torch.")
            types[kind] = types.get(kind, 0) + 1
            nbytes += t.numel() * t.element_size()
        out = {"mode": "native" if self.native else str(self.dtype).removeprefix("torch."), "bytes": nbytes,
               "tensors": types}
        if self.native:
            out["activation_bits"] = self.activation_bits
        return out

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: dict[str, torch.Tensor]) -> LlamaModel:
        """Build from HF-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...);
        Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` are taken as they are (their rows
        are already q, k, v and gate, up). Gemma's norms are kept as the factor they scale
        by, ``1 + weight`` in float32 (as HF computes it on every call); its
        ``post_attention_layernorm`` is the norm on the attention's output, and
        ``pre_feedforward_layernorm`` the one before the MLP."""

        def fused(name: str, parts: list[str]) -> Matrix:
            return sd[name] if name in sd else stack_rows([sd[n] for n in parts])

        def norm(name: str) -> torch.Tensor:
            return config.norm_offset + sd[name].float() if config.norm_offset else sd[name]

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            extra = {}
            if config.qk_norm:
                extra.update({f"{n}_norm": norm(p + f"self_attn.{n}_norm.weight") for n in "qk"})
            mlp_norm = p + "post_attention_layernorm.weight"
            if config.sandwich_norms:
                extra.update(post_attn_norm=norm(mlp_norm), post_mlp_norm=norm(p + "post_feedforward_layernorm.weight"))
                mlp_norm = p + "pre_feedforward_layernorm.weight"
            layers.append(
                LayerWeights(
                    attn_norm=norm(p + "input_layernorm.weight"),
                    qkv=fused(p + "self_attn.qkv_proj.weight", [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                    qkv_bias=qkv_bias,
                    o=sd[p + "self_attn.o_proj.weight"],
                    mlp_norm=norm(mlp_norm),
                    gate_up=fused(p + "mlp.gate_up_proj.weight", [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]),
                    down=sd[p + "mlp.down_proj.weight"],
                    **extra,
                )
            )
        embed = sd["model.embed_tokens.weight"]
        lm_head = embed if config.tie_word_embeddings else sd["lm_head.weight"]
        return cls(config, embed, layers, norm("model.norm.weight"), lm_head)

    # -- forward ------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits (float32) for the last new token of each sequence, ``[B, vocab]``, or
        for every new token with ``all_logits``, ``[T, vocab]``. Writes the new tokens'
        K/V into ``pool`` at ``batch.out_slots``. With ``all_reduce`` set (a rank of a
        tensor-parallel model, ``radixkv.model.tp``), each rank calls this with the same
        batch, in step."""
        cfg = self.config
        backend = backend or get_backend("torch")
        backend.plan(batch)
        cos, sin = rope = self._rope(batch.positions)
        x = _embed(batch.input_ids, self.embed).to(self.dtype)
        if cfg.embed_scale is not None:  # as HF: the scale rounded to float32, then to the activation dtype
            x = x * torch.tensor(cfg.embed_scale).to(x.dtype)
        head = _linear
        last = None if all_logits else (batch.qo_indptr[1:] - 1).long()  # the rows whose logits are read
        if self._steps is not None:  # native on the CPU: the layers return the rows read
            decode = all(n == 1 for n in batch.qo_lens)  # a row per sequence: all of them read
            x = self._native_step(x, batch, pool, backend, cos, sin, None if decode else last, decode)
            # every row of prefills: routed as the layers; a row per sequence: the kernel
            head = _routed_linear(batch) if all_logits and not decode else partial(_linear, dense=False)
        else:
            local = self._rope(batch.positions, local=True) if cfg.local_rope_theta is not None else rope
            x = self._dense_layers(x, batch, pool, backend, rope, local)
            x = x if last is None else x[last]
        logits = head(self._norm(x, self.norm), self.lm_head)
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits.float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, weight, self.config.rms_norm_eps, upcast=bool(self.config.norm_offset))

    def _dense_layers(self, x, batch, pool, backend, rope, local_rope) -> torch.Tensor:
        """The layers, step by step as HF transformers computes them (the exact mode; a
        native model on a CUDA device too, its products in Triton on the packed blocks).
        ``rope``/``local_rope``: cos and sin of the global and the sliding layers."""
        cfg, reduce, norm = self.config, self.all_reduce, self._norm
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for i, w in enumerate(self.layers):
            h = norm(x, w.attn_norm)
            qkv = _linear(h, w.qkv, w.qkv_bias)
            qk = qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d)
            if w.q_norm is not None:
                qk = torch.cat([norm(qk[:, :hq], w.q_norm), norm(qk[:, hq:], w.k_norm)], dim=1)
            cos, sin = local_rope if cfg.local_rope(i) else rope
            q, k = _apply_rope(qk, cos, sin).split([hq, hkv], dim=1)  # q and k at once
            v = qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
            pool.store_kv(i, k, v, batch.out_slots)
            o = backend.forward(q, k, v, pool.view(i), cfg.attn_scale, cfg.window(i), cfg.attn_logit_softcap)
            out = _linear(o.reshape(-1, hq * d), w.o)
            if reduce is not None:
                reduce(out)
            if w.post_attn_norm is not None:
                out = norm(out, w.post_attn_norm)
            x = x + out
            h = norm(x, w.mlp_norm)
            gate, up = _linear(h, w.gate_up).chunk(2, dim=-1)
            out = _linear(self._act(gate) * up, w.down)
            if reduce is not None:
                reduce(out)
            if w.post_mlp_norm is not None:
                out = norm(out, w.post_mlp_norm)
            x = x + out
        return x

    def _native_layers(self, x, batch, pool, backend, cos, sin, last=None) -> torch.Tensor:
        """The layers of a native model: products on the packed blocks (routed by sequence,
        ``_routed_linear``), the steps between them in one C call each
        (``radixkv.kernels.weights.Steps``), the residual stream ``x`` updated in place.
        The same arithmetic as the dense loop, float32. ``last``: the rows whose logits are
        read (a sequence's last), or None for every row: the last layer needs every row's K
        and V, but past its attention only those rows, so its output projection and MLP run
        on them alone (as llama.cpp's output rows) and the rows returned are those. On packed
        matrices a row's bits are the same either way (a product gives a row the bits of its
        own path, whatever else is in it)."""
        cfg, steps, eps = self.config, self._steps, self.config.rms_norm_eps
        hq, hkv, d, rot = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dims
        cos, sin = cos.reshape(-1, rot), sin.reshape(-1, rot)
        mm = _routed_linear(batch)
        x = x.contiguous()
        h = steps.add_rms_norm(x, None, self.layers[0].attn_norm, eps)
        for i, w in enumerate(self.layers):
            qkv = mm(h, w.qkv, w.qkv_bias)  # contiguous rows: the q/k norms and RoPE work in place on them
            if w.q_norm is not None:
                steps.qk_norm_(qkv, (hq, hkv), d, w.q_norm, w.k_norm, eps)
            steps.rope_(qkv, hq + hkv, d, cos, sin)  # q and k, in place (partial rotary: the leading rot dims)
            q, k, v = self._heads(qkv)
            pool.store_kv(i, k, v, batch.out_slots)
            if last is not None and i + 1 == len(self.layers):  # past here only the rows read, in order
                o = backend.forward_rows(q, k, v, pool.view(i), cfg.attn_scale, last, cfg.window(i)).reshape(-1, hq * d)
                x = x[last]  # a copy
                mm = _routed_linear(batch, last)
            else:
                o = backend.forward(q, k, v, pool.view(i), cfg.attn_scale, cfg.window(i)).reshape(-1, hq * d)
            h = steps.add_rms_norm(x, mm(o, w.o), w.mlp_norm, eps)
            out = mm(steps.silu_mul(mm(h, w.gate_up)), w.down)
            if i + 1 < len(self.layers):
                h = steps.add_rms_norm(x, out, self.layers[i + 1].attn_norm, eps)
            else:
                x += out
        return x

    def _native_layers_in_calls(self, x, batch, pool, backend, cos, sin, last) -> torch.Tensor:
        """``_native_layers`` where every matrix is packed and gives a token the same bits on
        both paths (``_paths_agree``: no routing by sequence is needed), and decode batches
        without the CPU decode kernel: between two attentions one C call
        (``Steps.native_layer``), each norm and SwiGLU row rounded for the next product as
        it is computed. The same bits as the step-by-step loop."""
        cfg, steps, layers = self.config, self._steps, self.layers
        hq, d, rot = cfg.num_heads, cfg.head_dim, cfg.rotary_dims
        x = x.contiguous()
        args = (cfg.rms_norm_eps, (hq, cfg.num_kv_heads), d, cos.reshape(-1, rot).contiguous(),
                sin.reshape(-1, rot).contiguous())  # fmt: skip
        qkv = steps.native_layer(x, None, None, layers[0], *args)
        for i, w in enumerate(layers):
            q, k, v = self._heads(qkv)
            pool.store_kv(i, k, v, batch.out_slots)
            if last is not None and i + 1 == len(layers):  # past here only the rows read, in order
                o = backend.forward_rows(q, k, v, pool.view(i), cfg.attn_scale, last, cfg.window(i))
                x = x[last]  # a copy
            else:
                o = backend.forward(q, k, v, pool.view(i), cfg.attn_scale, cfg.window(i))
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            qkv = steps.native_layer(x, o.reshape(-1, hq * d).contiguous(), w, nxt, *args)
        return x

    def _native_step(self, x, batch, pool, backend, cos, sin, last, decode: bool) -> torch.Tensor:
        """``_native_layers`` in as few calls as the batch allows (``decode``: one new token
        per sequence). Where every matrix is packed (and, for prefill and extend rows, gives
        a token the same bits on both paths) and the CPU attention kernels read the pool's
        float32, bfloat16 or half pages for every sequence (``CpuBackend.step_kernels``):
        the whole step is one call (``Steps.native_forward``: the K/V stores and those
        kernels too, with the same arguments, so the same bits), without the Python layer
        loop and the threads' waits between its calls. Else, where the matrices allow it,
        one call per layer's stretch between attentions (``_native_layers_in_calls``)."""
        if not (self._one_call_layers and (decode or self._no_routing)):
            return self._native_layers(x, batch, pool, backend, cos, sin, last)
        cfg, steps = self.config, self._steps
        x = x.contiguous()
        kernels = backend.step_kernels(pool.view(0), cfg.num_heads)
        if kernels is None:
            return self._native_layers_in_calls(x, batch, pool, backend, cos, sin, last)
        cos, sin = cos.reshape(-1, cfg.rotary_dims).contiguous(), sin.reshape(-1, cfg.rotary_dims).contiguous()
        last = None if last is None else last.to("cpu", torch.int64).contiguous()
        attention = Attention(**kernels, page_size=pool.page_size, scale=cfg.attn_scale, softcap=0.0)
        return steps.native_forward(x, self._described_layers(pool), cfg.rms_norm_eps,
                                    (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), cos, sin,
                                    batch.out_slots.contiguous(), attention, last)  # fmt: skip

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``: views of a native layer's ``qkv`` rows."""
        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)

    def _described_layers(self, pool: KVPool) -> ctypes.Array:
        """The layers with ``pool``'s pages as ``Steps.native_forward`` takes them
        (kept for the last pool: its tensors live as long as it does)."""
        cached = self._described
        if cached is not None and cached[0]() is pool:
            return cached[1]
        layers = (QLayer * len(self.layers))()
        for i, w in enumerate(self.layers):
            view = pool.view(i)
            layers[i] = QLayer(w.qkv.described, w.o.described, w.gate_up.described, w.down.described,
                               w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(),
                               *(None if t is None else t.data_ptr() for t in (w.qkv_bias, w.q_norm, w.k_norm)),
                               view.k.data_ptr(), view.v.data_ptr(), self.config.window(i) or 0)  # fmt: skip
        self._described = (weakref.ref(pool), layers)
        return layers

    def _rope(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions``: [T, 1, R] each (R: the rotary dims), in the
        model dtype; with ``local``, the sliding layers' (their own base, unscaled).
        longrope: a position below the original length takes the short factors, from it
        on the long ones; cos and sin scaled by its attention factor."""
        needed = int(positions.max()) + 1
        if local not in self._rope_cache or self._rope_cache[local][0].shape[0] < needed:
            cfg = self.config
            length = max(needed, min(cfg.max_position_embeddings, 8192))
            pos = torch.arange(length, device=self.device, dtype=torch.float32)[:, None]
            freqs = pos * cfg.inv_freq(local=local).to(self.device)[None, :]
            s = cfg.rope_scaling
            if s.kind == "longrope" and not local:
                long = pos * cfg.inv_freq(long=True).to(self.device)[None, :]
                freqs = torch.where(pos >= s.original_max_position_embeddings, long, freqs)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if s.kind == "longrope" and not local:
                cos, sin = cos * s.attention_factor, sin * s.attention_factor
            self._rope_cache[local] = (cos.to(self.dtype), sin.to(self.dtype))
        cos, sin = self._rope_cache[local]
        return cos[positions][:, None, :], sin[positions][:, None, :]


SMALL_BATCH_ROWS = 64


def _routed_linear(batch: ForwardBatch, taken: torch.Tensor | None = None) -> Callable:
    """``_linear`` for a native model's batch: the rows of decode sequences (one new
    token) through the packed kernel, the rows of prefill and extend sequences through
    the dense path, so that a token's path, and its result, depend on its own sequence
    alone, never on what shares the batch. A mixed batch is one product where the matrix
    gives every token the same bits on both paths (``_paths_agree``), two otherwise.
    ``taken``: the batch's rows the products take (indices, in order), else all of them."""
    lens = batch.qo_lens
    if all(n == 1 for n in lens):
        return lambda x, w, bias=None: _linear(x, w, bias, dense=False)
    if all(n > 1 for n in lens):
        return lambda x, w, bias=None: _linear(x, w, bias, dense=True)
    decode = torch.tensor([n == 1 for n in lens]).repeat_interleave(torch.tensor(lens))
    decode = decode if taken is None else decode[taken]
    rows, other = decode.nonzero().squeeze(1), (~decode).nonzero().squeeze(1)

    def split(x, w, bias=None):
        if _paths_agree(w):
            return _linear(x, w, bias, dense=True)
        a, b = _linear(x[rows], w, bias, dense=False), _linear(x[other], w, bias, dense=True)
        out = torch.empty(x.shape[0], a.shape[1], dtype=a.dtype)
        out[rows], out[other] = a, b
        return out

    return split


def _paths_agree(w: Matrix) -> bool:
    """Whether ``_linear(x, w, dense=...)`` gives a token the same bits either way: packed
    32-value types (their panels take the kernel's float steps), not the K-quants or
    float matrices (whose small and large products sum in different orders)."""
    if isinstance(w, Stacked):
        return all(_paths_agree(p) for p in w.parts)
    return isinstance(w, PackedMatrix) and w.paths_agree


def _embed(ids: torch.Tensor, table: Matrix) -> torch.Tensor:
    if _packed(table):
        return table.rows(ids)
    return F.embedding(ids, table)


def _linear(x: torch.Tensor, w: Matrix, bias: torch.Tensor | None = None, dense: bool | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)``; a packed or stacked ``w`` computes it itself. On the CPU,
    for a dense ``w`` and a few rows (decode steps): float32 through ``small_matmul``
    (the rows of ``w`` over every thread, each token's dots in a fixed order: batch 1
    measured 2x torch's one-core matrix-vector product, this 2-core machine, torch 2.13),
    other dtypes as ``(w @ x.T).T`` (the BLAS then streams ``w`` once instead of packing
    it first: 30-45% faster per weight matrix for 16 rows with weights out of cache).
    Prefill-sized inputs keep ``F.linear``."""
    if not isinstance(w, torch.Tensor):  # packed (dense: its path, see PackedMatrix.linear) or stacked
        out = w.linear(x, dense=dense)
        return out if bias is None else out + bias
    if x.device.type != "cpu" or x.shape[0] > SMALL_BATCH_ROWS:
        return F.linear(x, w, bias)
    if w.dtype == x.dtype == torch.float32 and w.is_contiguous() and _small_matmul_available():
        out = small_matmul(x, w)
    else:
        out = (w @ x.t()).t().contiguous()
    return out if bias is None else out + bias


@cache
def _small_matmul_available() -> bool:
    try:
        load_library()  # built on first use
    except ImportError:  # no C compiler: torch's products
        return False
    return True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, upcast: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` (computed in float32) times ``weight``: Llama's way, the norm
    back in ``x``'s dtype and then scaled; with ``upcast`` Gemma's, scaled in float32
    and then cast (the same in float32)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if upcast:
        return (h * weight).to(x.dtype)
    return weight * h.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading ``cos.shape[-1]`` dims of each head of ``x`` (all of them
    but for partial rotary), the rest passed through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rerotate_pages(pool: KVPool, inv_freq: torch.Tensor, src, dst, shifts) -> None:
    """Write into pages ``dst`` the KV of pages ``src`` with each page's keys moved
    ``shifts[i]`` positions back (``R(p) k`` becomes ``R(p - shift) k``: RoPE by
    ``-shift``), every layer; values unchanged. ``dst[i]`` may equal ``src[i]`` (in
    place). Quantized formats are read dequantized and stored quantized again.
    ``inv_freq``: the model's rotary frequencies ``[rotary dims / 2]`` (the leading
    ``2 * len(inv_freq)`` dims of each head rotate). The hook of ``kv_rerotate``
    (``radixkv.cache.compress``)."""
    if not len(src):
        return
    ps, device = pool.page_size, pool.config.device
    shift = torch.as_tensor(shifts, dtype=torch.float64, device=device).repeat_interleave(ps)  # per token
    angle = -shift[:, None] * inv_freq.to(device=device, dtype=torch.float64)[None, :]
    emb = torch.cat([angle, angle], -1)[:, None, :]  # [pages * ps, 1, rotary dims]
    cos, sin = emb.cos().float(), emb.sin().float()
    src_slots, dst_slots = pool.slots(src, 0, len(src) * ps), pool.slots(dst, 0, len(dst) * ps)
    for layer in range(pool.config.num_layers):
        k, v = pool.read_kv(layer, src_slots)
        pool.store_kv(layer, _apply_rope(k.float(), cos, sin), v, dst_slots)
