#!/usr/bin/env bash
# Install llama-cpp-python's OpenAI-compatible server (llama-cpp-python[server]
# ==0.3.36) into its own virtualenv, .peers/llamacpp-venv, for the benchmark
# peer that serves the embedded SmolLM2 GGUF with `python -m llama_cpp.server`.
#
# A separate venv, not .venv: the [server] extra brings fastapi, uvicorn,
# pydantic-settings, sse-starlette, starlette-context and numpy, none of which
# the project needs.  There is no CPU wheel on PyPI, so pip builds llama.cpp
# from the sdist with cmake (scikit-build-core); on 2 cores that takes about
# 8 minutes.  The default build already compiles ggml-cpu with -march=native
# (GGML_NATIVE=ON), so the wheel only suits CPUs like the building one.
# Needs a C/C++ compiler; scikit-build-core fetches cmake and ninja from PyPI
# itself when the system has none (or too old ones).
#
# Usage, from anywhere:  [PYTHON=python3] [CMAKE_ARGS=...] benchmarks/peers/setup_llamacpp.sh
# Idempotent: does nothing when the venv can already import the server.
# Prints the peer venv's python on success.
set -euo pipefail

cd "$(dirname "$0")/../.."
BASE_PY="${PYTHON:-python3}"
VENV=".peers/llamacpp-venv"
PY="$PWD/$VENV/bin/python"
VERSION=0.3.36
CHECK="import llama_cpp, llama_cpp.server.app; assert llama_cpp.__version__ == '$VERSION', llama_cpp.__version__"

if [ -x "$PY" ] && "$PY" -c "$CHECK" 2>/dev/null; then
    echo "$PY"
    exit 0
fi

if ! command -v "${CXX:-c++}" >/dev/null 2>&1 || ! command -v "${CC:-cc}" >/dev/null 2>&1; then
    echo "setup_llamacpp.sh: no C/C++ compiler (cc/c++) found; install one (e.g. apt-get install build-essential) first" >&2
    exit 1
fi

if [ ! -x "$PY" ]; then
    "$BASE_PY" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip

export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$PY" -m pip install --quiet "llama-cpp-python[server]==$VERSION"

"$PY" -c "$CHECK"
echo "$PY"
