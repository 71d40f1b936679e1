#!/usr/bin/env bash
# Install NVIDIA's kvpress (==0.5.5) into its own virtualenv, .peers/kvpress-venv, for
# the KV-cache-compression peer (benchmarks/peers/kvpress_ppl.py, passkey.py): HF
# transformers running the embedded SmolLM2 GGUF with kvpress's presses.
#
# A separate venv, not .venv: kvpress pins transformers<5.3,>=4.56 (the project runs a
# newer one) and its top-level import pulls in datasets (duo_attention_press and
# expected_attention_with_stats import it at module level), hence pyarrow and pandas.
#
# torch goes in first, alone, as torch==$TORCH: that release is a CPU build on this
# machine's disk (/opt/wheels) and installs in seconds. Every later install runs under a
# constraint file pinning it, because any requirement that admits a newer torch would
# fetch a CUDA build and its nvidia-* packages (gigabytes).
#
# kvpress itself goes in with --no-deps; of its declared requirements only those its
# import needs are installed (pip then warns that peft is missing; harmless) (numpy, requests, cachetools, fire, datasets; transformers
# brings huggingface_hub, safetensors and tqdm). peft and pandas are declared but never
# imported by kvpress (pandas arrives anyway, with datasets). gguf and accelerate are for
# transformers' GGUF loader (from_pretrained(gguf_file=...) refuses to run without
# accelerate).
#
# Usage, from anywhere:  [PYTHON=python3.11] benchmarks/peers/setup_kvpress.sh
# Idempotent: does nothing but print the versions when the venv already imports
# kvpress at the pinned versions.
set -euo pipefail

cd "$(dirname "$0")/../.."
BASE_PY="${PYTHON:-python3.11}"
VENV=".peers/kvpress-venv"
PY="$PWD/$VENV/bin/python"
TORCH=2.13.0
TRANSFORMERS=5.2.0   # the newest release kvpress 0.5.5 admits (<5.3)
KVPRESS=0.5.5
CHECK="
import importlib.metadata as m, torch, transformers, gguf, accelerate, kvpress
from kvpress import StreamingLLMPress, SnapKVPress, ObservedAttentionPress, KeyDiffPress
assert m.version('kvpress') == '$KVPRESS', m.version('kvpress')
assert transformers.__version__ == '$TRANSFORMERS', transformers.__version__
assert torch.__version__.split('+')[0] == '$TORCH', torch.__version__
"
VERSIONS="
import importlib.metadata as m
for p in ('torch', 'transformers', 'kvpress', 'gguf', 'accelerate', 'tokenizers', 'datasets', 'numpy'):
    print(f'{p:13s}', m.version(p))
"

if [ -x "$PY" ] && "$PY" -c "$CHECK" 2>/dev/null; then
    "$PY" -c "$VERSIONS"
    echo "$PY"
    exit 0
fi

if [ ! -x "$PY" ]; then
    "$BASE_PY" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip

CONSTRAINTS="$PWD/$VENV/constraints.txt"
# pandas: kvpress declares pandas<3 (it never imports it; datasets would bring 3.x)
printf 'torch==%s\npandas>=2.2.2,<3\n' "$TORCH" >"$CONSTRAINTS"

"$PY" -m pip install --quiet "torch==$TORCH"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" \
    "transformers==$TRANSFORMERS" gguf "accelerate>=1.0,<2" \
    "numpy>=2,<3" "requests>=2.32.3,<3" "cachetools>=5.5.2,<6" "fire>=0.6,<0.7" "datasets>=2.21"
"$PY" -m pip install --quiet --no-deps "kvpress==$KVPRESS"

"$PY" -c "$CHECK"
"$PY" -c "$VERSIONS"
echo "$PY"
