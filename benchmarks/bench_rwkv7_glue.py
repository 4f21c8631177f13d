"""RWKV-7's fused key prologue and output epilogue (kernels/rwkv7_key, kernels/rwkv7_out) beside the same math in
plain PyTorch (their naive.py) under torch.compile and eager: the GPU's time in kernels (gpu_time.py, median of 5)
of the forward and of forward+backward, same run, same GPU, bf16 inputs as the model makes them. (Wall time of one
such op alone is host-bound: its dispatch and launches take longer than its kernels.)

    python benchmarks/bench_rwkv7_glue.py                          # B=8 T=4096 N=64 at C=1280 (RWKV-7 0.6B) and 2048
    python benchmarks/bench_rwkv7_glue.py --shape 2 4096 1280 64   # one shape: B T C N
    python benchmarks/bench_rwkv7_glue.py --set key.fwd_tokens=64 --set out.warps=8   # other Settings fields

(kernels/ops.py describes the chunk ops, whose adapters and offline compile checks assume a chunk kernel; these two
elementwise ops have one launch regime each, so they are timed here.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_time import gpu_ms  # noqa: E402
from kernels.rwkv7_key import naive_rwkv7_key, rwkv7_key  # noqa: E402
from kernels.rwkv7_key.op import Settings as KeySettings  # noqa: E402
from kernels.rwkv7_out import naive_rwkv7_out, rwkv7_out  # noqa: E402
from kernels.rwkv7_out.op import Settings as OutSettings  # noqa: E402

SHAPES = ((8, 4096, 1280, 64), (8, 4096, 2048, 64))
EPS = 64e-5


def key_inputs(B, T, C, N, device):
    bf = dict(device=device, dtype=torch.bfloat16)
    return [torch.randn(B, T, C, **bf), 2 * torch.randn(B, T, C, **bf), -0.2 + 0.3 * torch.rand(C, device=device),
            0.7 + 0.05 * torch.rand(C, device=device), torch.full((C,), 1.02, device=device)]


def out_inputs(B, T, C, N, device):
    H = C // N
    bf = dict(device=device, dtype=torch.bfloat16)
    return [torch.randn(B, T, H, N, **bf) for _ in range(4)] + [
        -0.04 * torch.ones(H, N, device=device), torch.ones(C, device=device), torch.zeros(C, device=device),
        torch.randn(B, T, C, **bf)]


def timed(step, device) -> float:
    """Median of 5 of step()'s GPU time in kernels (on a CPU: its wall ms), after a run that compiles."""
    step()
    times = []
    for _ in range(5):
        if device == "cuda":
            times.append(gpu_ms(step))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[2]


def bench(fn, inputs, device) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of fn on inputs, every floating input taking a gradient."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cots = [torch.randn_like(o) for o in outs]

    def forward():
        with torch.no_grad():
            fn(*xs)

    def forward_backward():
        res = fn(*xs)
        torch.autograd.backward(res if isinstance(res, tuple) else (res,), cots)
        for x in xs:
            x.grad = None

    return timed(forward, device), timed(forward_backward, device)


def parse_settings(items: list[str]) -> dict:
    """{"key": KeySettings, "out": OutSettings} with the "op.field=value" items applied (integer fields)."""
    fields = {"key": {}, "out": {}}
    for item in items:
        target, _, value = item.partition("=")
        op, _, field = target.partition(".")
        if op not in fields or field not in KeySettings.__dataclass_fields__ or not value.strip().isdigit():
            raise ValueError(f"setting {item!r}: expected key.FIELD=INT or out.FIELD=INT, FIELD one of "
                             f"{', '.join(KeySettings.__dataclass_fields__)}")
        fields[op][field] = int(value)
    return {"key": KeySettings(**fields["key"]), "out": OutSettings(**fields["out"])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, metavar=("B", "T", "C", "N"), help="one shape instead of both")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only checks that it runs")
    p.add_argument("--set", action="append", default=[], metavar="OP.FIELD=VALUE",
                   help="a Settings field of key or out other than its default, e.g. key.fwd_tokens=64")
    args = p.parse_args()
    try:
        settings = parse_settings(args.set)
    except ValueError as e:
        p.exit(2, f"bench_rwkv7_glue: {e}\n")
    print(f"settings: {settings}")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for B, T, C, N in [tuple(args.shape)] if args.shape else SHAPES:
        cases = {
            "key": (key_inputs(B, T, C, N, args.device),
                    lambda *x: rwkv7_key(*x, N, settings=settings["key"]), lambda *x: naive_rwkv7_key(*x, N)),
            "out": (out_inputs(B, T, C, N, args.device),
                    lambda *x: rwkv7_out(*x, EPS, settings=settings["out"]), lambda *x: naive_rwkv7_out(*x, EPS)),
        }
        for op, (inputs, fused, plain) in cases.items():
            res = {"fused (Triton)": bench(fused, inputs, args.device),
                   "PyTorch, torch.compile": bench(torch.compile(plain), inputs, args.device),
                   "PyTorch, eager": bench(plain, inputs, args.device)}
            ref = res["PyTorch, torch.compile"][1]
            for name, (f_ms, fb_ms) in res.items():
                rows.append(f"| rwkv7_{op} | B={B} T={T} C={C} N={N} | {name} | {f_ms:.3f} | {fb_ms:.3f} "
                            f"| {ref / fb_ms:.2f}x |")
            print(f"   done rwkv7_{op} B={B} T={T} C={C} N={N}", flush=True)
    unit = "GPU ms" if args.device == "cuda" else "wall ms"
    print(f"\n| op | shape | kernel | fwd {unit} | fwd+bwd {unit} | compiled / this (fwd+bwd) |\n"
          "|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
