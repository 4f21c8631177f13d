#!/usr/bin/env bash
# One device call: the trainer on GPUs (NCCL FSDP and HSDP on 2 GPUs, bf16, fused AdamW, compile) and the 0.6B
# Transformer throughput table. Run from the repo root on the lent machine with .whl and .tcache carried.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TRITON_CACHE_DIR=/tmp/tcache PYTHONUNBUFFERED=1
mkdir -p /tmp/tcache && [ -f .tcache/tcache.tgz ] && tar xzf .tcache/tcache.tgz -C /tmp
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
ngpu=$(nvidia-smi -L | wc -l)

echo "== tiny transformer, FSDP over $ngpu GPU(s)"
NPROC=$ngpu timeout 180 bash scripts/launch.sh configs/transformer_tiny.toml --training.steps 30 \
  --job.dump_folder /tmp/tiny_fsdp --training.seq_len 512 --metrics.log_freq 10 2>&1 | grep -E "step|error|Error" | tail -8
if [ "$ngpu" -ge 2 ]; then
  echo "== tiny transformer, HSDP (dp_replicate=2)"
  NPROC=2 timeout 120 bash scripts/launch.sh configs/transformer_tiny.toml --training.steps 10 \
    --job.dump_folder /tmp/tiny_hsdp --parallelism.dp_replicate=2 --metrics.log_freq 5 --training.compile=true \
    2>&1 | grep -E "step|error|Error" | tail -5
fi
echo "== 0.6B transformer throughput, 1 GPU"
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_train.py configs/transformer_0.6B.toml \
  --steps 20 --timeout 200 --variants ${VARIANTS:-nocompile,compile,compile+ac} 2>&1 | tee "$OUT/bench_train.txt" | tail -8
tar czf "$OUT/tcache.tgz" -C /tmp tcache
