#!/usr/bin/env bash
# One device call for the trainer: run from the repo root on the lent machine with .whl carried.
#   STAGES="tests,tiny,bench,ckpt" CONFIG=configs/transformer_0.6B.toml VARIANTS=nocompile,compile bash benchmarks/gpu_smoke.sh
# tests: the GPU model tests; tiny: the tiny config over every GPU (FSDP, and HSDP with compile on 2+ GPUs);
# bench: bench_train.py on each config of CONFIG (space-separated) at each GPU count of BENCH_NPROC (e.g. 1,4; the
# variant hsdp runs 2 replicas), tables with scaling against the first count; ckpt: a short run of the first config on
# CKPT_NPROC GPUs that saves twice (async), resumed on CKPT_RESUME_NPROC GPUs (default 1), printing how long each
# save blocked training, when it was complete on disk and how long the resume took to load. Each stage runs under a
# timeout; the bench tables come last.
# Multi-GPU hosts: NVLink multicast stays off (NCCL_NVLS_ENABLE=0 here and in launch.sh).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TRITON_CACHE_DIR=/tmp/tcache PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stages=${STAGES:-tiny,bench}
config=${CONFIG:-configs/transformer_0.6B.toml}
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
ngpu=$(nvidia-smi -L | wc -l)

if [[ $stages == *tests* ]]; then
  echo "== GPU model tests"
  timeout ${TEST_TIMEOUT:-180} python3 -m pytest -m gpu -q -p no:cacheprovider tests/models 2>&1 | tail -6
fi
if [[ $stages == *tiny* ]]; then
  echo "== tiny transformer, FSDP over $ngpu GPU(s)"
  NPROC=$ngpu timeout 180 bash scripts/launch.sh configs/transformer_tiny.toml --training.steps 30 \
    --job.dump_folder /tmp/tiny_fsdp --training.seq_len 512 --metrics.log_freq 10 2>&1 | grep -E "step|rror" | tail -8
  if [ "$ngpu" -ge 2 ]; then
    echo "== tiny transformer, HSDP (dp_replicate=2) + compile"
    NPROC=2 timeout 120 bash scripts/launch.sh configs/transformer_tiny.toml --training.steps 10 \
      --job.dump_folder /tmp/tiny_hsdp --parallelism.dp_replicate=2 --metrics.log_freq 5 --training.compile=true \
      2>&1 | grep -E "step|rror" | tail -5
  fi
fi
if [[ $stages == *ckpt* ]]; then
  first=${config%% *}
  echo "== $first: async checkpoints on ${CKPT_NPROC:-1} GPU(s), resumed on ${CKPT_RESUME_NPROC:-1}"
  common=(--job.dump_folder=/tmp/ckpt --data.synthetic=true --metrics.enable_wandb=false
          --checkpoint.interval=3 --metrics.log_freq=3 --lr_scheduler.warmup_steps=1)
  NPROC=${CKPT_NPROC:-1} timeout ${CKPT_TIMEOUT:-200} bash scripts/launch.sh "$first" "${common[@]}" \
    --training.steps=6 2>&1 | grep -E "^\[default0\]:(step|prepared|checkpoint|model)|rror" | tail -9
  NPROC=${CKPT_RESUME_NPROC:-1} timeout ${CKPT_TIMEOUT:-200} bash scripts/launch.sh "$first" "${common[@]}" \
    --training.steps=9 ${CKPT_RESUME_ARGS:-} 2>&1 | grep -E "^\[default0\]:(step|checkpoint|model)|rror" | tail -6
fi
if [[ $stages == *bench* ]]; then
  for c in $config; do
    echo "== $c throughput on ${BENCH_NPROC:-1} GPU(s)"
    timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_train.py "$c" --nproc "${BENCH_NPROC:-1}" \
      --steps ${BENCH_STEPS:-20} --timeout ${BENCH_RUN_TIMEOUT:-200} \
      --variants ${VARIANTS:-nocompile,compile,compile+ac} --no-fla 2>&1 \
      | tee -a "$OUT/bench_train.txt" | grep -v "^[^ ]* [0-9]* [a-z+]* {"
  done
fi
