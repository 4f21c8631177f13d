"""Benchmark of kernels.token_shift.norm_shift_mix (a LayerNorm, then RWKV's token shift + lerps) beside the same in
PyTorch (F.layer_norm, then the shift and lerp formula), compiled by torch.compile (Inductor) and eager, on one GPU.

    python benchmarks/bench_token_shift.py                          # the table in kernels/token_shift/README.md
    python benchmarks/bench_token_shift.py --set bwd_tiles=8        # a Settings field other than its default

Per row: the GPU time of the forward and of the backward (the sum of the kernels' durations under the profiler, median
of 5 calls; the backward from n given grads, one per output, as the models' n consumers give them), and the GB/s
those times give for the bytes the op must move at least: forward x once and the n outputs, backward the n grads, x
once and dx (bf16; the norm's and the lerps' parameters are not counted). GPU time, not wall time: one call of the op
alone waits on the host (autograd, the custom op's dispatch, the launches) longer than its kernels run, which inside
a compiled training step the GPU does not.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_time import gpu_ms  # noqa: E402
from kernels.token_shift import Settings, norm_shift_mix  # noqa: E402

# (B, T, C, n, packed): RWKV-7 0.6B's time mix (6 lerps) and channel mix (1) at 8 x 4096 tokens (a training step's),
# and 32768 tokens of packed documents in one row
EPS = 1e-5
SHAPES = ((8, 4096, 1280, 6, False), (8, 4096, 1280, 1, False), (1, 32768, 1280, 6, True), (8, 4096, 2048, 6, False))
TABLE_HEAD = ("| B T C n | kernel | fwd GPU ms | fwd GB/s | bwd GPU ms | bwd GB/s |\n|---|---|---|---|---|---|")


def pytorch_norm_shift_mix(x, weight, bias, mix, keep):
    """F.layer_norm (bf16 output), then the token shift and lerps in bf16 arithmetic, unpacked into n outputs."""
    x = F.layer_norm(x, x.shape[-1:], weight, bias, EPS)
    shifted = F.pad(x, (0, 0, 1, -1))
    if keep is not None:
        shifted = shifted * keep
    return (x[None] + (shifted - x)[None] * mix[:, None, None, :].to(x.dtype)).unbind(0)


def inputs(B, T, C, n, packed):
    torch.manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    mix = torch.rand(n, C, device="cuda")
    weight = 1 + 0.1 * torch.randn(C, device="cuda", dtype=torch.bfloat16)
    bias = 0.1 * torch.randn(C, device="cuda", dtype=torch.bfloat16)
    keep = None
    if packed:   # documents of 300 tokens
        keep = torch.ones(T, 1, device="cuda", dtype=torch.bfloat16)
        keep[::300] = 0
    grads = [torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    return x, weight, bias, mix, keep, grads


def bench(fn, x, weight, bias, mix, keep, grads, runs=5):
    """(forward, backward) GPU ms of fn, each the median of `runs` (after one warm-up); the backward from n given
    grads."""
    times = []
    for _ in range(runs + 1):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias, mix)]
        outs = []
        fwd = gpu_ms(lambda: outs.extend(fn(*leaves, keep)))
        times.append((fwd, gpu_ms(torch.autograd.backward, list(outs), grads)))
    return [sorted(t[i] for t in times[1:])[runs // 2] for i in (0, 1)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ours", action="store_true", help="our kernels' rows only")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a kernels.token_shift Settings field other than its default, e.g. bwd_tiles=8")
    args = p.parse_args()
    fields = {f.name for f in dataclasses.fields(Settings)}
    changes = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            p.exit(2, f"bench_token_shift: --set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}\n")
        changes[name] = ast.literal_eval(value)
    settings = Settings(**changes)
    if not torch.cuda.is_available():
        p.exit(2, "bench_token_shift: needs a CUDA GPU\n")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {settings}")
    kernels = {"ours norm_shift_mix": lambda x, w, b, mix, keep: norm_shift_mix(x, w, b, EPS, mix, keep,
                                                                                  settings=settings),
               "torch.compile (Inductor)": torch.compile(pytorch_norm_shift_mix, dynamic=False),
               "PyTorch eager": pytorch_norm_shift_mix}
    if args.ours:
        kernels = dict(list(kernels.items())[:1])
    rows = []
    for B, T, C, n, packed in SHAPES:
        xs = inputs(B, T, C, n, packed)
        elems = B * T * C
        fwd_bytes, bwd_bytes = 2 * elems * (1 + n), 2 * elems * (n + 2)
        label = f"{B} {T} {C} {n}" + (" packed" if packed else "")
        for name, fn in kernels.items():
            f_ms, b_ms = bench(fn, *xs)
            rows.append(f"| {label} | {name} | {f_ms:.3f} | {fwd_bytes / f_ms / 1e6:.0f} | {b_ms:.3f} | "
                        f"{bwd_bytes / b_ms / 1e6:.0f} |")
            print(rows[-1], flush=True)
    print("\n" + TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
