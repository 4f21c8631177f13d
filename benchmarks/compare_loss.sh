#!/usr/bin/env bash
# Trains several configs for the same steps on the same data (the bundled sample, so it runs anywhere) and plots
# their loss curves into one PNG:
#   bash benchmarks/compare_loss.sh configs/rwkv7_0.1B.toml configs/transformer_0.1B.toml configs/gsa_0.1B.toml
# Variables: STEPS (300), BATCH (4), SEQ_LEN (1024), LR (8e-4, warmup 10 then cosine to a tenth), RUNS
# (runs/compare: one run folder per config), PNG ($RUNS/loss.png), EXTRA (more overrides for every run). Every run
# gets the same overrides: only the model section and each model's own optimizer settings (betas, eps, parameter
# groups, L2Wrap) differ. With the defaults, 300 steps of 4 x 1024 tokens stay within one pass over the sample's
# Pile part (1.18M tokens), so the curves are not read off repeated text.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 CONFIG [CONFIG ...]" >&2; exit 2; }
runs=${RUNS:-runs/compare}
steps=${STEPS:-300}
sources='[{path = "data/sample/pile/*.jsonl.zst", weight = 0.8}, {path = "data/sample/webtext/*.parquet", weight = 0.2}]'
evals='[{path = "data/sample/eval/*.jsonl"}]'
folders=()
for config in "$@"; do
  name=$(basename "$config" .toml)
  folder="$runs/$name"
  rm -rf "$folder" "$folder.log"
  mkdir -p "$runs"
  echo "== $name (log: $folder.log)"
  # shellcheck disable=SC2086
  scripts/launch.sh "$config" --job.dump_folder="$folder" --data.sources="$sources" --data.eval_sources="$evals" \
    --data.tokenizer=data/tokenizer/gpt-neox-20b/tokenizer.json --training.steps="$steps" \
    --training.batch_size="${BATCH:-4}" --training.gradient_accumulation_steps=1 --training.seq_len="${SEQ_LEN:-1024}" \
    --optimizer.lr="${LR:-8e-4}" --lr_scheduler.warmup_steps=10 --lr_scheduler.decay_type=cosine \
    --lr_scheduler.min_lr_factor=0.1 --validation.enable=true --validation.freq=50 \
    --validation.steps=8 --checkpoint.enable=false --metrics.enable_wandb=false --metrics.log_freq=5 \
    ${EXTRA:-} > "$folder.log" 2>&1 || { tail -20 "$folder.log"; exit 1; }
  grep -E "step +[0-9]+ \|" "$folder.log" | tail -3
  folders+=("$name=$folder")
done
python3 scripts/plot_metrics.py "${folders[@]}" --out "${PNG:-$runs/loss.png}" \
  --title "same data, ${steps} steps of ${BATCH:-4} x ${SEQ_LEN:-1024} tokens"
