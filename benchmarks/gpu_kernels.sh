#!/usr/bin/env bash
# One device call for the chunked kernels: install the carried wheels, restore the Triton cache, run the GPU tests
# and the kernel benchmark (each under a timeout), save the Triton cache to $OUT, print the table last.
# Carry [".whl", ".tcache"]; copy $OUT/tcache.tgz.* back to .tcache/ for the next call.
#   TEST_TIMEOUT=300 BENCH_TIMEOUT=240 BENCH_ARGS="--op gsa --profile" bash benchmarks/gpu_kernels.sh
# TEST_TIMEOUT=0 or BENCH_TIMEOUT=0 skips that part; TEST_PATHS narrows the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
whls=(.whl/*.whl)
if [ ${#whls[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${whls[@]}" || exit 1
fi
# TRITON_CACHE_AUTOTUNING keeps FLA's autotune results (minutes cold) in the carried cache too.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tcache
# the cache travels in parts of at most 15 MB (the transfer limit per file)
parts=(.tcache/tcache.tgz.*)
[ ${#parts[@]} -gt 0 ] && cat "${parts[@]}" | tar xzf - -C /tmp
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${TEST_TIMEOUT:-300}" -gt 0 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 \
    ${TEST_PATHS:-tests/kernels tests/models} ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if [ "${BENCH_TIMEOUT:-300}" -gt 0 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_kernels.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" \
    | grep -v '^|'
fi
tar czf - -C /tmp tcache | split -b 15M - "$OUT/tcache.tgz."
grep -s '^|' "$OUT/bench.log"
