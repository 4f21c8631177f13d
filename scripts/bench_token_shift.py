"""Benchmark of kernels.token_shift.shift_mix (RWKV's token shift + lerps) beside the PyTorch formula the models used
before it, compiled by torch.compile (Inductor) and eager, on one GPU.

    python scripts/bench_token_shift.py                          # the table in kernels/token_shift/README.md
    python scripts/bench_token_shift.py --set bwd_tiles=8        # a Settings field other than its default

Per row: forward ms and forward+backward ms (triton.testing.do_bench, median; the backward from n given grads, one
per output, as the models' n consumers give them), and the GB/s those times give for the bytes the op must move at
least: forward x once and the n outputs, backward the n grads and x once and dx (bf16).
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

from kernels.token_shift import Settings, shift_mix  # noqa: E402

# (B, T, C, n, packed): RWKV-7 0.6B's time mix (6 lerps) and channel mix (1) at 4 x 4096 tokens, and 16384 tokens of
# packed documents in one row
SHAPES = ((4, 4096, 1280, 6, False), (4, 4096, 1280, 1, False), (1, 16384, 1280, 6, True), (4, 4096, 2048, 6, False))
TABLE_HEAD = ("| B T C n | kernel | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s |\n|---|---|---|---|---|---|")


def pytorch_shift_mix(x, mix, keep):
    """The models' formula before shift_mix (bf16 arithmetic, as they ran it), unpacked into n outputs as they did."""
    shifted = F.pad(x, (0, 0, 1, -1))
    if keep is not None:
        shifted = shifted * keep
    return (x[None] + (shifted - x)[None] * mix[:, None, None, :].to(x.dtype)).unbind(0)


def inputs(B, T, C, n, packed):
    torch.manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    mix = torch.rand(n, C, device="cuda")
    keep = None
    if packed:   # documents of 300 tokens
        keep = torch.ones(T, 1, device="cuda", dtype=torch.bfloat16)
        keep[::300] = 0
    grads = [torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    return x, mix, keep, grads


def bench(fn, x, mix, keep, grads, backward):
    from triton.testing import do_bench
    x, mix = x.detach().clone().requires_grad_(backward), mix.detach().clone().requires_grad_(backward)

    def step():
        outs = fn(x, mix, keep)
        if backward:
            torch.autograd.backward(list(outs), grads)
            x.grad = mix.grad = None

    step()
    return do_bench(step, warmup=25, rep=200, return_mode="median")


def main():
    p = argparse.ArgumentParser()
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
    kernels = {"ours shift_mix": lambda x, mix, keep: shift_mix(x, mix, keep, settings=settings),
               "torch.compile (Inductor)": torch.compile(pytorch_shift_mix, dynamic=False),
               "PyTorch eager": pytorch_shift_mix}
    rows = []
    for B, T, C, n, packed in SHAPES:
        xs = inputs(B, T, C, n, packed)
        elems = B * T * C
        fwd_bytes, bwd_bytes = 2 * elems * (1 + n), 2 * elems * (n + 2)
        label = f"{B} {T} {C} {n}" + (" packed" if packed else "")
        for name, fn in kernels.items():
            f_ms, fb_ms = bench(fn, *xs, False), bench(fn, *xs, True)
            rows.append(f"| {label} | {name} | {f_ms:.3f} | {fwd_bytes / f_ms / 1e6:.0f} | {fb_ms:.3f} | "
                        f"{(fwd_bytes + bwd_bytes) / fb_ms / 1e6:.0f} |")
            print(rows[-1], flush=True)
    print("\n" + TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
