"""Error of the RWKV-6 or RWKV-7 Triton kernel against the fp64 recurrence, for every output and gradient (RMSE /
RMS, the measure the GPU tests hold to 5e-3), on one GPU:

    python benchmarks/kernel_accuracy.py                                  # RWKV-6, B=2 T=4096 H=4 K=V=64
    python benchmarks/kernel_accuracy.py --op rwkv7
    python benchmarks/kernel_accuracy.py --set rwkv6.bf16_products=False  # a setting other than its default

Rows: bf16 inputs at the model's initial decays, bf16 inputs under the stress decays (-1e-6 .. -50 per step), fp32
inputs under the stress decays. The inputs, cotangents and reference are the kernel tests' own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    import importlib

    from kernels.settings import parse
    from tests.kernels.common import rel_rmse
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="rwkv6", choices=["rwkv6", "rwkv7"])
    p.add_argument("--shape", default="2,4096,4,64,64", help="B,T,H,K,V")
    p.add_argument("--set", action="append", default=[], metavar="OP.FIELD=VALUE")
    args = p.parse_args()
    try:
        settings = parse(args.set).get(args.op)
    except ValueError as e:
        p.exit(2, f"kernel_accuracy: {e}\n")
    chunk = getattr(importlib.import_module(f"kernels.{args.op}"), f"chunk_{args.op}")
    tests = importlib.import_module(f"tests.kernels.test_{args.op}")
    op = tests.OP   # the op's pieces as its kernel tests hold them (tests.kernels.common.ChunkOp)
    NAMES, make_inputs, naive, run = op.names, op.make_inputs, op.naive, tests.run
    if not torch.cuda.is_available():   # after the pieces above: a CPU machine still finds a broken reference
        p.exit(2, "kernel_accuracy: needs a CUDA GPU\n")
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    print(f"| inputs | {' | '.join(NAMES)} |\n|---|{'---|' * len(NAMES)}")
    for label, dtype, decay in [("bf16, model decays", torch.bfloat16, "model"),
                                ("bf16, stress decays", torch.bfloat16, "stress"),
                                ("fp32, stress decays", torch.float32, "stress")]:
        xs, h0 = make_inputs(B, T, H, K, V, device="cuda", dtype=dtype, decay=decay, seed=3)
        got = run(lambda *a, **kw: chunk(*a, settings=settings, **kw), xs, h0, 1.0)
        ref = naive(xs, h0, 1.0)
        print(f"| {label} | " + " | ".join(f"{rel_rmse(a, b):.1e}" for a, b in zip(got, ref)) + " |")


if __name__ == "__main__":
    main()
