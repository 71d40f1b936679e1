#!/usr/bin/env bash
# Install xgrammar (0.2.8) into its own virtualenv, .peers/xgrammar-venv, for the
# constrained-decoding peer (benchmarks/peers/xgrammar_masks.py): xgrammar's compile and
# per-step mask time against llguidance's on benchmarks/constrain_cases.py, both engines
# in one process (llguidance at the version the project's venv runs, 1.9.1).
#
# A separate venv, not .venv: xgrammar declares torch, transformers, pydantic,
# apache-tvm-ffi and an unpinned triton (Linux x86_64) as run-time requirements; the
# project's runtime needs none of them for constraints (llguidance has no dependencies).
#
# torch goes in first, alone, as torch==$TORCH: that release is a CPU build on this
# machine's disk (/opt/wheels) and installs in seconds. Every later install runs under a
# constraint file pinning it, because any requirement that admits a newer torch would
# fetch a CUDA build and its nvidia-* packages (gigabytes). triton (~290 MB) comes in
# as xgrammar declares it; xgrammar's CPU path never uses it.
#
# Usage, from anywhere:  [PYTHON=python3.11] benchmarks/peers/setup_xgrammar.sh
# Idempotent: does nothing but print the versions when the venv already imports
# xgrammar at the pinned versions.
set -euo pipefail

cd "$(dirname "$0")/../.."
BASE_PY="${PYTHON:-python3.11}"
VENV=".peers/xgrammar-venv"
PY="$PWD/$VENV/bin/python"
TORCH=2.13.0
XGRAMMAR=0.2.8
LLGUIDANCE=1.9.1
CHECK="
import importlib.metadata as m, torch, transformers, tokenizers, numpy, xgrammar, llguidance
assert m.version('xgrammar') == '$XGRAMMAR', m.version('xgrammar')
assert m.version('llguidance') == '$LLGUIDANCE', m.version('llguidance')
assert torch.__version__.split('+')[0] == '$TORCH', torch.__version__
"
VERSIONS="
import importlib.metadata as m
for p in ('xgrammar', 'llguidance', 'apache-tvm-ffi', 'torch', 'triton', 'transformers', 'tokenizers', 'numpy', 'pydantic'):
    print(f'{p:15s}', m.version(p))
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
printf 'torch==%s\n' "$TORCH" >"$CONSTRAINTS"

"$PY" -m pip install --quiet "torch==$TORCH"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "xgrammar==$XGRAMMAR" "llguidance==$LLGUIDANCE" \
    transformers tokenizers "numpy>=2,<3"

"$PY" -c "$CHECK"
"$PY" -c "$VERSIONS"
echo "$PY"
