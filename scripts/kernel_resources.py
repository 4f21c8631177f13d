"""Registers, stack bytes (spilled registers) per thread, shared memory per block and SASS instructions (in all, and
in the largest loop body, a sequential scan's step) of every RWKV-7 and GSA kernel, compiled offline for an
H100 (sm_90) with Triton's bundled ptxas: no GPU needed, so a kernel change can be judged before a device call. The
kernels and their launch settings are the ones the sm_90 compile tests build.

    python scripts/kernel_resources.py [--kv 64] [--gsa-m 64] [--set rwkv7.LEVEL_SUMS=True --set rwkv7.CHUNK_PREC=bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)                 # the interpreter would replace @triton.jit
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # as on the GPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv", type=int, default=64, help="RWKV-7 K = V")
    p.add_argument("--gsa-m", type=int, default=64, help="GSA slots (K = V = 256)")
    p.add_argument("--set", action="append", default=[], metavar="FAMILY.NAME=VALUE",
                   help="a module setting of kernels.rwkv7 or kernels.gsa, e.g. rwkv7.BWD_WARPS=8")
    args = p.parse_args()
    from kernels.settings import apply
    apply(args.set)
    import triton

    from tests.kernels import test_gsa, test_rwkv7
    print(f"Triton {triton.__version__} (the device image has 3.6: registers and spills differ between versions)")

    for title, table in ((f"RWKV-7, K = V = {args.kv}", test_rwkv7.compile_for_sm90(args.kv, args.kv, "resources")),
                         (f"GSA, M = {args.gsa_m}, K = V = 256", test_gsa.compile_for_sm90(args.gsa_m, what="resources"))):
        if "unavailable" in table:
            raise SystemExit(f"this Triton cannot compile for CUDA: {table['unavailable']}")
        print(f"\n{title} (sm_90)\n| kernel | registers | stack bytes | shared bytes | instructions | loop body |"
              "\n|---|---|---|---|---|---|")
        for name, r in table.items():
            print(f"| {name} | {r['registers']} | {r['stack']} | {r['shared']} | {r['instructions']} | {r['loop']} |",
                  flush=True)


if __name__ == "__main__":
    main()
