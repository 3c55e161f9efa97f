#!/usr/bin/env bash
# One lent GPU window (issue 42), as one command on the device machine: the GPU tests of
# the decode graphs and of the batched draw, then bench/gpu.py, then bench/sampling.py. Every log and the JSON land in $OUT as they are
# written, so a window cut short keeps what it measured.
#
#   here:  make gpu-pack                      (.whl/: what the device's python lacks)
#   there: run(command="bash bench/gpu_window.sh", carry=[".whl"], timeout_s=320)
#
# The defaults fit the window this task has left (under 6 minutes of device time, a
# minute or more of it the machine's start): the graph tests, then bf16 only, our one
# process against transformers' generate, one round of 64 tokens. A fuller window:
# BENCH_ARGS="--repeat 2" (both precisions, every system; about 6 minutes on an H200).
# TESTS_S, BENCH_S and DRAW_S bound each part, so a window cut short keeps what it measured.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/site
{
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    tar xzf .whl/gpu-site.tar.gz -C /tmp/site
} > "$OUT/setup.log" 2>&1 || { echo "setup failed: $(tail -5 "$OUT/setup.log")"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/device.txt"
timeout "${TESTS_S:-80}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_cuda_graphs.py tests/model/test_draw.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -25
timeout "${BENCH_S:-160}" python3 bench/gpu.py ${BENCH_ARGS:---weights bf16 --systems ours1,hf --repeat 1 --tokens 64} \
    --json "$OUT/gpu.json" \
    2>&1 | tee "$OUT/gpu.log" | tail -60
# the chat's sampled draw on the device (synthetic logits: the default model is not carried)
timeout "${DRAW_S:-40}" python3 bench/sampling.py --device cuda --synthetic --json "$OUT/sampling.json" \
    2>&1 | tee "$OUT/sampling.log" | tail -12
