"""Tiny random HF-format checkpoints, written by transformers, loaded by radixkv."""

import json

import numpy as np
import pytest
import torch

from radixkv.cache import KVPool, PoolConfig
from radixkv.engine.batch import ForwardBatch, SeqInput
from radixkv.errors import ModelLoadError
from radixkv.model import load_model, resolve_model

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)  # fmt: skip

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
