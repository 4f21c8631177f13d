"""GSA's fused output norm (kernels/silu_rms_norm) beside the same math in plain PyTorch (its naive.py) under
torch.compile and eager: median ms of the forward and of the backward alone (torch.autograd.grad of a kept graph, so
no gradient accumulates between repeats), same run, same GPU, bf16 o as the chunk kernel returns it, fp32 weight.

    python benchmarks/bench_silu_rms_norm.py                       # B=8 T=4096 C=1280 (GSA 0.6B) and B=8 T=4096 C=2048
    python benchmarks/bench_silu_rms_norm.py --shape 2 4096 1280   # one shape: B T C
    python benchmarks/bench_silu_rms_norm.py --set bwd_tiles=32    # a Settings field other than its default
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.silu_rms_norm import naive_silu_rms_norm, silu_rms_norm  # noqa: E402
from kernels.silu_rms_norm.op import Settings  # noqa: E402
from benchmarks.bench_rwkv7_glue import timed  # noqa: E402

SHAPES = ((8, 4096, 1280), (8, 4096, 2048))
EPS = 1e-5


def bench(fn, inputs, device, warmup_ms: int = 0) -> tuple[float, float]:
    """(forward ms, backward ms) of fn on inputs, both inputs taking a gradient; warmup_ms: run forward and
    backward that long first, untimed."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    y = fn(*xs)
    dy = torch.randn_like(y)
    end = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < end:
        fn(*xs)
        torch.autograd.grad(y, xs, dy, retain_graph=True)

    def forward():
        with torch.no_grad():
            fn(*xs)

    return timed(forward, device), timed(lambda: torch.autograd.grad(y, xs, dy, retain_graph=True), device)


def main():
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False   # a compiled backward that donates buffers refuses retain_graph
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=3, metavar=("B", "T", "C"), help="one shape instead of both")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only checks that it runs")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                   help=f"a Settings field other than its default ({', '.join(Settings.__dataclass_fields__)})")
    args = p.parse_args()
    fields = {}
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in Settings.__dataclass_fields__ or not value.strip().isdigit():
            p.exit(2, f"bench_silu_rms_norm: setting {item!r}: expected FIELD=INT, FIELD one of "
                      f"{', '.join(Settings.__dataclass_fields__)}\n")
        fields[field] = int(value)
    settings = Settings(**fields)
    print(f"settings: {settings}")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for B, T, C in [tuple(args.shape)] if args.shape else SHAPES:
        inputs = [torch.randn(B, T, C, device=args.device, dtype=torch.bfloat16),
                  1 + 0.1 * torch.randn(C, device=args.device)]
        plain = lambda o, w: naive_silu_rms_norm(o, w, EPS)  # noqa: E731
        if not rows:   # the process's first GPU work runs slow (clocks ramping up): 2 s of it before timing
            bench(lambda o, w: silu_rms_norm(o, w, EPS, settings=settings), inputs, args.device, warmup_ms=2000)
        res = {"fused (Triton)": bench(lambda o, w: silu_rms_norm(o, w, EPS, settings=settings), inputs, args.device),
               "PyTorch, torch.compile": bench(torch.compile(plain), inputs, args.device),
               "PyTorch, eager": bench(plain, inputs, args.device)}
        ref = sum(res["PyTorch, torch.compile"])
        for name, (f_ms, b_ms) in res.items():
            rows.append(f"| B={B} T={T} C={C} | {name} | {f_ms:.3f} | {b_ms:.3f} | {ref / (f_ms + b_ms):.2f}x |")
    print("\n| shape | kernel | fwd ms | bwd ms | compiled / this (fwd + bwd) |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
