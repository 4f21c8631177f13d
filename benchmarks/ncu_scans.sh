#!/usr/bin/env bash
# Where a sequential scan's step waits (one device call; Firecracker machines have ncu): warp stall reasons and
# memory throughput of each chunk kernel of one RWKV-7 and one GSA fwd+bwd at B=2 T=16384, where the scans set
# the time. Carry .whl (or nothing: the kernels need only torch and triton).
#   SHAPE="2 16384" bash benchmarks/ncu_scans.sh
# SOURCE=1 also samples stalls per SASS instruction and prints each kernel's hot spots (benchmarks/ncu_hotspots.py;
# the per-kernel CSVs go to $OUT). KERNELS narrows the kernels profiled, e.g.
#   SOURCE=1 SHAPE="8 4096" KERNELS='_fwd_scan|_bwd_chunk' bash benchmarks/ncu_scans.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
read -r B T <<< "${SHAPE:-2 16384}"
cat > /tmp/one_step.py <<PY
# one fwd+bwd of each op on the inputs its benchmark makes (kernels/ops.py), heads and widths as benchmarked
import torch, sys
sys.path.insert(0, "$PWD")
from kernels.ops import OPS
for op in OPS.values():
    shape = (($B, $T) + op.shapes[0][2:])
    xs = [x.requires_grad_(True) for x in op.make_inputs(*shape)]
    op.ours(shape, xs).sum().backward()
torch.cuda.synchronize()
PY
python3 /tmp/one_step.py || exit 1   # compile (and autotune) outside the profiler
KERNELS=${KERNELS:-_fwd|_bwd|_state_scan|_out_scan|_block_scan|_gate}
extra=()
[ "${SOURCE:-0}" = 1 ] && extra=(--section SourceCounters --section MemoryWorkloadAnalysis --import-source no
                                 --export /tmp/ncu_rep --force-overwrite)
timeout ${NCU_TIMEOUT:-400} ncu --clock-control none -k "regex:$KERNELS" \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats "${extra[@]}" \
  python3 /tmp/one_step.py > /tmp/ncu.txt 2>&1
[ "${SOURCE:-0}" = 1 ] && ncu --import /tmp/ncu_rep.ncu-rep > /tmp/ncu.txt 2>&1
grep -E "^  _|Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Stall|stall" /tmp/ncu.txt \
  | cut -c1-160 | head -200
cp /tmp/ncu.txt "${OUT:-/tmp}/ncu.txt" 2>/dev/null
if [ "${SOURCE:-0}" = 1 ]; then
  for k in $(grep -oE "^  _[A-Za-z_0-9]+" /tmp/ncu.txt | sort -u); do
    ncu --import /tmp/ncu_rep.ncu-rep -k "$k" --page source --print-source sass --csv > "${OUT:-/tmp}/src$k.csv" 2>&1
    python3 benchmarks/ncu_hotspots.py "${OUT:-/tmp}/src$k.csv" --top 8
  done
fi
