#!/usr/bin/env bash
# Installs what flame needs on this machine; quick and harmless when everything is already there.
# torch comes first and only when missing: on a machine without a GPU the CPU build (torch==2.13.0); a plain
# "torch" requirement resolved by pip there would download several GB of CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch==2.13.0
  fi
fi
"$py" -m pip install -q -e ".[test]" 2>&1 | grep -vE "Location .* is ignored|Running pip as the 'root' user" || true
"$py" -c "import flame, torch, triton, torchtitan, datasets, tokenizers" \
  || { echo "setup.sh: install incomplete" >&2; exit 1; }
