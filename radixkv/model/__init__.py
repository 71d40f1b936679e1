"""Model config, Llama-family forward, loaders (GGUF, HF directories), tokenizers."""

from radixkv.model.config import ModelConfig, RopeScaling
from radixkv.model.llama import LlamaModel
from radixkv.model.loader import load_model, load_state_dict
from radixkv.model.registry import DEFAULT_MODEL, MODELS, ModelSource, resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "LlamaModel",
    "ModelConfig",
    "ModelSource",
    "RopeScaling",
    "load_model",
    "load_state_dict",
    "resolve_model",
]
