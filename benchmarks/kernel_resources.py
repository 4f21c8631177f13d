"""Registers, stack bytes (spilled registers) per thread, shared memory per block, SASS instructions (in all, and
in the largest loop body, a sequential scan's step) and tile loads (in all / issued before the first shared-memory
store: kernels.sm90.resources) of every kernel build our ops launch at their benchmark shapes,
called as the models call them (kernels/ops.py), compiled offline for an H100 (sm_90) with Triton's bundled ptxas: no
GPU needed, so a kernel change can be judged before a device call. The builds are recorded from the launch code
(kernels/launch.py).

    python benchmarks/kernel_resources.py [--op rwkv7|gsa] [--set rwkv7.prep_maxnreg=128]
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
    from kernels.ops import OPS
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="all", choices=["all", *OPS])
    p.add_argument("--set", action="append", default=[], metavar="OP.FIELD=VALUE",
                   help="a kernel setting instead of its default, e.g. rwkv7.prep_maxnreg=128")
    args = p.parse_args()
    import triton

    from kernels import sm90
    from kernels.settings import parse
    try:
        settings = parse(args.set)
    except ValueError as e:
        p.exit(2, f"kernel_resources: {e}\n")
    why = sm90.unavailable()
    if why:
        p.exit(2, f"kernel_resources: this Triton cannot compile for CUDA: {why}\n")
    print(f"Triton {triton.__version__} (registers and spills differ between Triton versions)")
    for name, op in OPS.items():
        if args.op not in ("all", name):
            continue
        shapes = ", ".join(" ".join(f"{n}={x}" for n, x in zip(op.shape_names, s)) for s in op.shapes)
        print(f"\n{name} at {shapes} (sm_90)\n| kernel | registers | stack bytes | shared bytes | instructions "
              "| loop body | tile loads first / all |\n|---|---|---|---|---|---|---|")
        for kernel, r in sm90.report(op, "resources", settings.get(name)).items():
            print(f"| {kernel} | {r['registers']} | {r['stack']} | {r['shared']} | {r['instructions']} "
                  f"| {r['loop']} | {r['loads_first']} / {r['loads']} |", flush=True)
        if name == "rwkv7":
            bwd_chunk_forming_w_row(settings.get(name))
            cuda_scan_row()


def bwd_chunk_forming_w_row(settings):
    """_bwd_chunk as the model's calls run it where the CUDA scans serve them: forming the log decays from their
    logits (chunk._forms_w, which meta tensors, no GPU's, always answer False)."""
    from unittest import mock

    from kernels import sm90
    from kernels.ops import OPS
    from kernels.rwkv7 import chunk

    with mock.patch.object(chunk, "_forms_w", lambda r, w, w_bias, v, blocked, s: w_bias is not None and not blocked):
        rows = sm90.report(OPS["rwkv7"], "resources", settings)
    for kernel, r in rows.items():
        if kernel.startswith("_bwd_chunk") and "FORM_W=True" in kernel:
            print(f"| {kernel}, where the CUDA scans serve the call | {r['registers']} | {r['stack']} | {r['shared']} "
                  f"| {r['instructions']} | {r['loop']} | {r['loads_first']} / {r['loads']} |")


def cuda_scan_row():
    """The CUDA sequence scans (they take _fwd_scan's and _bwd_scan's place on sm_90 where they apply), built by
    NVRTC."""
    from kernels import cuda_rtc
    from kernels.rwkv7 import scan_cuda
    if cuda_rtc._nvrtc() is None:
        print("(the CUDA scans: NVRTC not installed)")
        return
    for scan, instead in ((scan_cuda.FORWARD_LOGITS, "_fwd_scan"), (scan_cuda.FORWARD, "_fwd_scan"),
                          (scan_cuda.BACKWARD_LOGITS, "_bwd_scan"),
                          (scan_cuda.BACKWARD, "_bwd_scan"), (scan_cuda.PREP, "_fwd_prep")):
        r = scan.resources()
        built = "decay from logits, " if scan.logits else ""
        print(f"| {scan.name} (CUDA, {built}in {instead}'s place) | {r['registers']} | {r['spilled_bytes']} "
              f"| {scan.shared_bytes} | | | |")


if __name__ == "__main__":
    main()
