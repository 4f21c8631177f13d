#!/usr/bin/env bash
# One device call for the trainer: run from the repo root on the lent machine with .whl carried.
#   STAGES="tests,tiny,bench,ckpt" CONFIG=configs/transformer_0.6B.toml VARIANTS=nocompile,compile bash scripts/gpu_smoke.sh
# tests: the GPU model tests; tiny: the tiny config over every GPU (FSDP, and HSDP with compile on 2+ GPUs);
# bench: bench_train.py on CONFIG on each GPU count of BENCH_NPROC (e.g. "1 2"); ckpt: a short CONFIG run on
# CKPT_NPROC GPUs that saves twice (async), resumed on one GPU, printing how long each save blocked training. Each stage runs under a timeout; tables come last.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TRITON_CACHE_DIR=/tmp/tcache PYTHONUNBUFFERED=1
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
  echo "== $config: async checkpoint blocking time, then resume"
  common=(--config "$config" --job.dump_folder=/tmp/ckpt --data.synthetic=true --metrics.enable_wandb=false
          --checkpoint.interval=3 --metrics.log_freq=3 --lr_scheduler.warmup_steps=1)
  # saved on CKPT_NPROC GPUs (default 1), resumed on one
  timeout ${CKPT_TIMEOUT:-200} python3 -m torch.distributed.run --standalone --nproc-per-node=${CKPT_NPROC:-1} \
    -m flame.train "${common[@]}" --training.steps=6 2>&1 | grep -E "step|prepared|rror" | tail -7
  CUDA_VISIBLE_DEVICES=0 timeout ${CKPT_TIMEOUT:-200} python3 -m flame.train "${common[@]}" --training.steps=9 2>&1 \
    | grep -E "resumed|step  |rror" | tail -4
fi
if [[ $stages == *bench* ]]; then
  echo "== $config throughput, 1 GPU"
  for n in ${BENCH_NPROC:-1}; do
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_train.py \
      "$config" --nproc "$n" --steps ${BENCH_STEPS:-20} --timeout 200 \
      --variants ${VARIANTS:-nocompile,compile,compile+ac} 2>&1 | tee -a "$OUT/bench_train.txt" | tail -6
  done
fi
