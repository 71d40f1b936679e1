"""Tiny random HF-format checkpoints, written by transformers, loaded by radixkv."""

import json
import math

import numpy as np
import pytest
import torch

from radixkv.cache import KVPool, PoolConfig
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.errors import ModelLoadError
from radixkv.model import load_model, resolve_model

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)  # fmt: skip

PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # Phi3Config's defaults lie past TINY's vocab
# Gemma: larger random weights than the default, so that the soft-caps bend the logits
GEMMA = dict(head_dim=16, sliding_window=6, initializer_range=0.2)
GEMMA2_CAPS = dict(GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)

VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3-rope-tied": (
        transformers.LlamaConfig,
        dict(tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),  # fmt: skip
    "linear-rope-mqa": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "qwen2-bias": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=6, head_dim=16)),
    "qwen3-qk-norm": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-window-on-layer-1": (  # layer_types: only the layers from max_window_layers on slide
        transformers.Qwen3Config, dict(head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "phi3-fused": (transformers.Phi3Config, dict(PHI3_IDS)),  # qkv_proj and gate_up_proj
    "phi3-partial-longrope-window": (
        transformers.Phi3Config,
        dict(PHI3_IDS, sliding_window=6, max_position_embeddings=256, original_max_position_embeddings=64,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 4.0, 9.0, 20.0]}),
    ),  # fmt: skip
    "gemma2-softcap-window": (transformers.Gemma2Config, dict(GEMMA2_CAPS, query_pre_attn_scalar=24)),
    "gemma3-local-rope": (  # layers 0, 1 slide with their own base, layer 2 is global with linear scaling
        transformers.Gemma3TextConfig,
        dict(GEMMA, num_hidden_layers=3, sliding_window_pattern=3, query_pre_attn_scalar=32, rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    ),  # fmt: skip
    # as llama.cpp's GGUF loader assumes them: query_pre_attn_scalar = head_dim, Gemma 3's layer pattern 6 and
    # local base 10000
    "gemma2-like-llama-cpp": (transformers.Gemma2Config, dict(GEMMA2_CAPS, query_pre_attn_scalar=16)),
    "gemma3-like-llama-cpp": (
        transformers.Gemma3TextConfig,
        dict(GEMMA, num_hidden_layers=6, query_pre_attn_scalar=16, final_logit_softcapping=3.0,
             rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),  # fmt: skip
}


def write_checkpoint(path, variant, shard=False):
    cls, extra = VARIANTS[variant]
    torch.manual_seed(0)
    config = cls(**{**TINY, **extra})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "1GB")
    return model


def run_ours(model, seqs, page_size=4):
    c = model.config
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, page_size, num_pages=128))
    out = []
    for prefix, rest in seqs:  # prefill a prefix, then extend it (exercises the cached path)
        table = pool.alloc(-(-(len(prefix) + len(rest)) // page_size))
        first = model.forward(ForwardBatch.build([SeqInput(prefix, 0, table)], page_size), pool, all_logits=True)
        second = model.forward(
            ForwardBatch.build([SeqInput(rest, len(prefix), table)], page_size), pool, all_logits=True
        )
        out.append(torch.cat([first, second]))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_checkpoint_matches_transformers(tmp_path, variant):
    hf = write_checkpoint(tmp_path, variant, shard=variant == "llama")
    if variant == "llama":
        assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded on purpose
    ours = load_model(tmp_path)
    assert resolve_model(tmp_path).format == "hf"
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 97, 5).tolist(), rng.integers(0, 97, 12).tolist()),
            (rng.integers(0, 97, 9).tolist(), rng.integers(0, 97, 1).tolist())]  # fmt: skip
    for (prefix, rest), mine in zip(seqs, run_ours(ours, seqs)):
        with torch.no_grad():
            theirs = hf(torch.tensor([prefix + rest])).logits[0]
        assert (mine - theirs).abs().max() < 1e-4, variant


def test_unsupported_architecture_and_rope_are_clear_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path)
    cfg = {"model_type": "llama", **TINY, "num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 2}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'yarn'"):
        load_model(tmp_path)


def test_missing_weights_and_paths_are_clear_errors(tmp_path):
    write_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").rename(tmp_path / "other.bin")
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="neither a registered name"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="must be .gguf"):
        resolve_model(tmp_path / "other.bin")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(empty)


def test_bad_dtype_names_the_choices():
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        load_model(dtype="float64")


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")  # what write_gguf lays out as llama.cpp does


def write_gguf(path, hf_model, architecture="llama", matrices=None):
    """A GGUF of ``hf_model`` laid out as llama.cpp's converter writes it: tensor names
    from gguf's own map for the architecture, q/k rows permuted only where llama.cpp
    rotates consecutive pairs (llama), no output matrix when the head is tied. Float32,
    or the 2-D matrices quantized to ``matrices`` (a ``GGMLQuantizationType``)."""
    import gguf
    from gguf.quants import quantize

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if architecture == "phi3":  # as llama.cpp's Phi3MiniModel converter writes it
        rope = cfg.rope_parameters
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", cfg.max_position_embeddings))
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
            for kind in ("long", "short"):
                w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    if architecture in ("gemma2", "gemma3"):  # as llama.cpp's Gemma2Model/Gemma3Model converters write it
        w.add_sliding_window(cfg.sliding_window)
        if cfg.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])

    def permute(t, heads):  # HF halves -> llama.cpp interleaved pairs
        rows = t.shape[0]
        return t.reshape(heads, 2, rows // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    arch = {n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch if architecture in GGUF_ARCHITECTURES else gguf.MODEL_ARCH.LLAMA,
                                     cfg.num_hidden_layers)  # fmt: skip
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # save_pretrained leaves the tied head out, and so does the converter
        t = tensor.detach().numpy().astype(np.float32)
        if architecture.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's norms scale by 1 + weight: the converter stores the sum
        if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, cfg.num_attention_heads)
        elif architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, cfg.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if matrices is not None and t.ndim == 2:
            w.add_tensor(gname, quantize(t, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("variant, architecture", [("llama", "llama"), ("qwen2-bias", "qwen2")])
def test_gguf_written_like_llama_cpp_loads_to_the_hf_weights(tmp_path, variant, architecture):
    """llama.cpp permutes llama's q/k rows (the loader puts them back) but keeps qwen2's
    in HF's order, biases included."""
    hf = write_checkpoint(tmp_path / "hf", variant)
    write_gguf(tmp_path / "tiny.gguf", hf, architecture)
    from radixkv.model import load_state_dict

    config, sd = load_state_dict(resolve_model(tmp_path / "tiny.gguf"))
    assert config.num_kv_heads == 2 and not config.tie_word_embeddings
    assert config.architecture == architecture
    theirs = hf.state_dict()
    assert set(sd) == set(theirs)
    for name, tensor in sd.items():
        assert torch.equal(tensor, theirs[name]), name


def test_gguf_with_an_unsupported_architecture_is_a_clear_error(tmp_path):
    hf = write_checkpoint(tmp_path / "hf", "llama")
    write_gguf(tmp_path / "odd.gguf", hf, architecture="mamba")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        load_model(tmp_path / "odd.gguf")


def prompts(vocab=97):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, vocab, 5).tolist(), rng.integers(0, vocab, 12).tolist()),
            (rng.integers(0, vocab, 9).tolist(), rng.integers(0, vocab, 1).tolist())]  # fmt: skip


GGUF_VARIANTS = [("qwen3-qk-norm", "qwen3"), ("phi3-partial-longrope-window", "phi3"),
                 ("gemma2-like-llama-cpp", "gemma2"), ("gemma3-like-llama-cpp", "gemma3")]  # fmt: skip


@pytest.mark.parametrize("variant, architecture", GGUF_VARIANTS)
def test_gguf_of_a_tiny_checkpoint_matches_transformers(tmp_path, variant, architecture):
    """The GGUF llama.cpp's converter would write, loaded by radixkv, against transformers
    running the checkpoint it came from."""
    hf = write_checkpoint(tmp_path / "hf", variant)
    write_gguf(tmp_path / "tiny.gguf", hf, architecture)
    ours = load_model(tmp_path / "tiny.gguf")
    assert ours.config.architecture == architecture
    seqs = prompts()
    for (prefix, rest), mine in zip(seqs, run_ours(ours, seqs)):
        with torch.no_grad():
            theirs = hf(torch.tensor([prefix + rest])).logits[0]
        assert (mine - theirs).abs().max() < 1e-4, variant


@pytest.mark.parametrize("variant, architecture", GGUF_VARIANTS[:2])
def test_native_weights_of_a_quantized_gguf_follow_its_fp32_expansion(tmp_path, variant, architecture):
    """The native path (packed Q8_0 matrices, the steps between them) against the exact
    fp32 path on the same file: the same architecture-specific steps, so the logits agree
    up to the kernel's 16-bit activation rounding."""
    from gguf import GGMLQuantizationType

    hf = write_checkpoint(tmp_path / "hf", variant)
    write_gguf(tmp_path / "q8.gguf", hf, architecture, matrices=GGMLQuantizationType.Q8_0)
    native, exact = load_model(tmp_path / "q8.gguf", native=True), load_model(tmp_path / "q8.gguf")
    assert native.native and not exact.native
    seqs = prompts()
    for mine, theirs in zip(run_ours(native, seqs), run_ours(exact, seqs)):
        assert (mine - theirs).abs().max() < 1e-3, variant


@pytest.mark.parametrize("variant, architecture", [("phi3-fused", "phi3"), ("qwen2-bias", "qwen2"),
                                                   ("mistral-window", "llama"), ("qwen3-qk-norm", "qwen3"),
                                                   ("phi3-partial-longrope-window", "phi3")])  # fmt: skip
def test_native_decode_in_one_call_gives_the_bits_of_the_layer_loop(tmp_path, variant, architecture):
    """Decode steps of a native model (biases, fused projections, sliding windows, q/k
    norms, partial rotary) skip the Python layer loop: the same logits, bit for bit, as
    the step-by-step loop."""
    from gguf import GGMLQuantizationType

    from radixkv.kernels import get_backend

    hf = write_checkpoint(tmp_path / "hf", variant)
    write_gguf(tmp_path / "q8.gguf", hf, architecture, matrices=GGMLQuantizationType.Q8_0)
    model = load_model(tmp_path / "q8.gguf", native=True)
    c = model.config
    assert model._one_call_layers
    runs = []
    for one_call in (True, False):
        model._one_call_layers = one_call
        pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 4, num_pages=64))
        seqs = [[1, 5, 9, 30, 4, 7, 8, 9, 10, 11], [3, 4, 5]]
        tables = [pool.alloc(8) for _ in seqs]
        model.forward(ForwardBatch.build([SeqInput(p, 0, t) for p, t in zip(seqs, tables)], 4), pool)
        tokens, logits = [1, 2], []
        for step in range(4):  # past the window of 6 for mistral-window
            batch = ForwardBatch.build([SeqInput([tok], len(p) + step, t) for tok, p, t in zip(tokens, seqs, tables)], 4)
            logits.append(model.forward(batch, pool, get_backend("auto")))
            tokens = logits[-1].argmax(-1).tolist()
        runs.append(torch.stack(logits))
        model._one_call_layers = True
    assert torch.equal(runs[0], runs[1])


def test_bad_layer_types_name_the_field(tmp_path):
    cfg = {"model_type": "qwen3", **TINY, "use_sliding_window": True, "sliding_window": 4,
           "layer_types": ["full_attention", "local"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="layer_types must give each of the 2 layers one of"):
        load_model(tmp_path)


def test_longrope_takes_the_long_factors_from_the_original_length_on(tmp_path):
    """Past ``original_max_position_embeddings`` HF recomputes every position with the
    long factors; a cache cannot rotate its keys again, so radixkv switches per position:
    from the original length on its cos/sin equal HF's long ones, below it HF's short ones."""
    hf = write_checkpoint(tmp_path, "phi3-partial-longrope-window")
    ours = load_model(tmp_path)
    x = torch.zeros(1, dtype=torch.float32)
    positions = torch.arange(80)
    cos, sin = ours._rope(positions)
    with torch.no_grad():
        long_cos, long_sin = hf.model.rotary_emb(x, positions[None])  # 80 > 64: the long factors
        short_cos, short_sin = hf.model.rotary_emb(x, positions[None, :64])
    assert torch.allclose(cos[64:, 0], long_cos[0, 64:], atol=1e-6) and torch.allclose(sin[64:, 0], long_sin[0, 64:], atol=1e-6)
    assert torch.allclose(cos[:64, 0], short_cos[0], atol=1e-6) and torch.allclose(sin[:64, 0], short_sin[0], atol=1e-6)
    assert not torch.allclose(cos[:64, 0], long_cos[0, :64], atol=1e-3)


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 3}},
     "longrope: long_factor must hold 8 numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "longrope needs short_factor and long_factor"),
    ({"partial_rotary_factor": 0.1}, "rotary dims per head .* must be even"),
    ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
])  # fmt: skip
def test_bad_phi3_rope_and_activation_name_the_field(tmp_path, change, match):
    cfg = {"model_type": "phi3", **TINY, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_model(tmp_path)


def test_native_weights_refuse_gemma_and_auto_expands_it(tmp_path):
    from gguf import GGMLQuantizationType

    from radixkv.engine.config import EngineConfig

    hf = write_checkpoint(tmp_path / "hf", "gemma2-like-llama-cpp")
    write_gguf(tmp_path / "q8.gguf", hf, "gemma2", matrices=GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="weights native does not run gemma2 models yet .* use weights fp32"):
        load_model(tmp_path / "q8.gguf", native=True)
    assert not EngineConfig().native_weights(resolve_model(tmp_path / "q8.gguf"))  # auto: fp32, exact
    assert not load_model(tmp_path / "q8.gguf").native


@pytest.mark.parametrize("config, match", [
    ({"model_type": "gemma3"}, "model_type 'gemma3' in config.json is Gemma 3 with its vision tower"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention: rope type 'linear'"),
    ({"model_type": "gemma3_text", "sliding_window": 4, "sliding_window_pattern": 0}, "sliding_window_pattern must"),
    ({"model_type": "gemma2", "hidden_activation": "gelu_new"}, "unsupported hidden_act 'gelu_new'"),
])  # fmt: skip
def test_bad_gemma_configs_name_the_field(tmp_path, config, match):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **config}))
    with pytest.raises(ModelLoadError, match=match):
        load_model(tmp_path)


@pytest.mark.parametrize("variant", ["qwen3-qk-norm", "phi3-partial-longrope-window", "gemma2-softcap-window",
                                     "gemma3-local-rope"])  # fmt: skip
def test_tensor_parallel_ranks_give_the_whole_models_logits(tmp_path, variant):
    """Two ranks of ``shard_model`` (heads and MLP split; q/k and Gemma's norms whole),
    each in a thread of its own with an in-process all-reduce, give the whole model's
    logits: what ``--tp 2`` runs over torch.distributed."""
    import threading

    from radixkv.model.tp import shard_model

    write_checkpoint(tmp_path, variant)
    whole = load_model(tmp_path)
    ranks = [shard_model(whole, r, 2) for r in range(2)]
    barrier, partials = threading.Barrier(2, timeout=60), [None, None]

    def reducer(rank):
        def all_reduce(t):
            partials[rank] = t.clone()
            barrier.wait()
            total = partials[0] + partials[1]
            barrier.wait()
            t.copy_(total)

        return all_reduce

    seqs, outs = prompts(), [None, None]

    def run(rank):
        ranks[rank].all_reduce = reducer(rank)
        outs[rank] = run_ours(ranks[rank], seqs)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mine, theirs in zip(outs[0], run_ours(whole, seqs)):
        assert (mine - theirs).abs().max() < 1e-4, variant
