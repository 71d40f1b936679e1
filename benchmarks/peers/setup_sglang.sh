#!/usr/bin/env bash
# Install SGLang's radix tree (sglang==0.5.23) into .peers/sglang for the
# benchmark peer adapter benchmarks/peers/sglang_tree.py.
#
# Everything goes in with --no-deps: sglang pins torch==2.14.1 (GBs of CUDA
# wheels) and dozens of GPU/serving packages that the radix tree never touches.
# Besides the sglang wheel, only what its radix_cache import chain needs (the
# adapter stubs the heavy, unused modules; see _STUBBED_MODULES there):
#   msgspec, pyzmq, pydantic (+ pydantic-core, annotated-types,
#   typing-inspection)  - sglang.srt.disaggregation.kv_events, runtime_context
#   psutil              - sglang.srt.utils.network
# torch (and typing-extensions, which torch brings) must already be in $PYTHON.
#
# Usage, from anywhere:  [PYTHON=path/to/python] benchmarks/peers/setup_sglang.sh
# Idempotent: does nothing when the adapter can already import the tree.
set -euo pipefail

cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
TARGET=".peers/sglang"
CHECK=benchmarks/peers/sglang_tree.py

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup_sglang.sh: torch is not importable with $PY; install the project's torch first (this script never installs torch)" >&2
    exit 1
fi

if "$PY" "$CHECK" >/dev/null 2>&1; then
    "$PY" "$CHECK"
    exit 0
fi

"$PY" -m pip install --quiet --no-deps --upgrade --target "$TARGET" \
    sglang==0.5.23 \
    msgspec==0.22.0 \
    pyzmq==27.3.0 \
    pydantic==2.14.3 \
    pydantic-core==2.50.4 \
    annotated-types==0.8.0 \
    typing-inspection==0.4.5 \
    psutil==7.2.2

"$PY" "$CHECK"
