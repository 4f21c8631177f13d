"""One bf16 forward + backward of a chunk op on the GPU, small enough to run under compute-sanitizer: a kernel build
that reads or writes out of bounds (as Triton 3.6 once compiled an 8-warp kernel with bf16 products) shows as
memcheck errors.

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_kernel.py gsa 1,512,4,64,64,64   # B,T,H,K,V,M
    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_kernel.py gsa 16,256,8,64,64,64 --projection
    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_kernel.py rwkv7 1,512,4,64,64    # B,T,H,K,V
    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_kernel.py rwkv7 8,256,20,64,64 --logits
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=["rwkv7", "gsa", "rwkv6"])
    p.add_argument("shape", help="the op's test shape: B,T,H,K,V (rwkv7, rwkv6) or B,T,H,K,V,M (gsa)")
    p.add_argument("--projection", action="store_true",
                   help="gsa: through chunk_gsa_from_projection (its backward stores the projection's gradient; K = V)")
    p.add_argument("--logits", action="store_true",
                   help="rwkv7: the decay from bf16 logits and a bias (w_bias), as the model calls it")
    args = p.parse_args()
    try:
        shape = tuple(int(n) for n in args.shape.split(","))
    except ValueError:
        p.exit(2, f"sanitize_kernel: shape must be integers joined by commas, got {args.shape!r}\n")
    if len(shape) != (6 if args.op == "gsa" else 5):
        p.exit(2, f"sanitize_kernel: wrong number of sizes for {args.op}: {args.shape}\n")
    if args.projection and (args.op != "gsa" or shape[3] != shape[4]):
        p.exit(2, "sanitize_kernel: --projection is GSA's, with K = V\n")
    if args.logits and args.op != "rwkv7":
        p.exit(2, "sanitize_kernel: --logits is RWKV-7's\n")
    # the tests' own input makers and the ops, found before the GPU is asked for, so that a moved piece fails on
    # any machine (tests/test_gpu_tool_pieces.py) rather than in the next GPU session
    inputs = importlib.import_module("tests.kernels.inputs")
    make_inputs = getattr(inputs, f"{args.op}_inputs")
    op = getattr(importlib.import_module(f"kernels.{args.op}"), f"chunk_{args.op}")
    from kernels.gsa import chunk_gsa_from_projection
    if not torch.cuda.is_available():
        p.exit(2, "sanitize_kernel: needs a CUDA GPU\n")
    if args.logits:
        xs, z, bias, _ = inputs.rwkv7_logit_inputs(*shape, device="cuda", dtype=torch.bfloat16)
        r, _, k, v, a, b = (x.requires_grad_() for x in xs)
        out = op(r, z.requires_grad_(), k, v, a, b, w_bias=bias.requires_grad_())
    elif args.projection:
        B, T, H, K, V, M = shape
        y = torch.randn(B, T, 3 * H * K + H * M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = chunk_gsa_from_projection(y, H, K, M, 8.0)
    else:
        xs, _ = make_inputs(*shape, device="cuda", dtype=torch.bfloat16)
        xs = [x.requires_grad_() if x.is_floating_point() else x for x in xs]
        out = op(*xs)
    (out[0] if isinstance(out, tuple) else out).float().square().sum().backward()
    torch.cuda.synchronize()
    how = " (from the projection)" if args.projection else " (decay from logits)" if args.logits else ""
    print(f"{args.op} {args.shape}{how}: forward and backward ran")


if __name__ == "__main__":
    main()
