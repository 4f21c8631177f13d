#!/usr/bin/env bash
# One device call for the RWKV7 kernel: install the carried wheels, restore the Triton cache, run the GPU tests and
# the benchmark (each under a timeout), save the Triton cache to $OUT, print the table last.
# Run with carry [".tcache"] (the FLA wheels copied from .whl into it), or [".whl", ".tcache"] for the model tests
# (mind the 64 MiB carry limit); copy $OUT/tcache.tgz.* back to .tcache/ for the next call.
#   BENCH_ARGS="--sweep --profile" TEST_TIMEOUT=300 BENCH_TIMEOUT=240 bash scripts/gpu_rwkv7.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# The FLA wheels (for the comparison) travel in .tcache; the project's other wheels (torchdata etc., which
# flame.config imports, so the model tests need them) in .whl when it is carried too.
whls=(.tcache/fla_core-*.whl .tcache/flash_linear_attention-*.whl)
[ -d .whl ] && whls=(.whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${whls[@]}" || exit 1
# TRITON_CACHE_AUTOTUNING keeps autotune results (FLA autotunes for minutes cold) in the carried cache too.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tcache
# the cache comes back in parts of at most 15 MB (the transfer limit per file)
ls .tcache/tcache.tgz.* >/dev/null 2>&1 && cat .tcache/tcache.tgz.* | tar xzf - -C /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${TEST_TIMEOUT:-300}" -gt 0 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -x -q -p no:cacheprovider --durations=8 \
    ${TEST_PATHS:-tests/kernels/test_rwkv7.py tests/models/test_rwkv7.py} ${TEST_ARGS:-} 2>&1 \
    | tee "$OUT/tests.log" | tail -25
fi
[ "${BENCH_TIMEOUT:-300}" -gt 0 ] && timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench_kernels.py ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log" | grep -v '^|'
tar czf - -C /tmp tcache | split -b 15M - "$OUT/tcache.tgz."
grep -s '^|' "$OUT/bench.log"
