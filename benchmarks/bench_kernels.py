"""Kernel benchmark of every chunked op (kernels/ops.py): ours called as our model's layer calls it in training (RWKV-7:
the decay's logits with w_bias; GSA: chunk_gsa_from_projection on the stacked projection; the call is printed first;
tests/kernels/test_ops_match_models.py holds each to the model's), beside FLA's op called as FLA's layer calls it
(when installed) and causal SDPA flash attention, same run, same GPU.

    python benchmarks/bench_kernels.py                       # both ops: median ms, tokens/s, peak memory, ratio to FLA
    python benchmarks/bench_kernels.py --op gsa --kernels ours
    python benchmarks/bench_kernels.py --set rwkv7.scan_bv=32   # a setting other than its default (kernels/settings.py)
    python benchmarks/bench_kernels.py --profile             # also the GPU time of each kernel in one fwd+bwd
    python benchmarks/bench_kernels.py --op rwkv7 --shape 8,4096,20,64,64   # one shape: here the 0.6B model's layer

Two times per row: the timed fwd+bwd (triton.testing.do_bench, median), and the time the GPU spends in kernels
(the sum of the kernels' durations under the profiler): the timed figure includes the gaps in which the GPU waits
for the host to launch the next kernel, so it depends on the host's speed where kernels are short and many.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_time import kernel_times  # noqa: E402
from kernels.ops import OPS  # noqa: E402

TABLE_HEAD = ("| shape | kernel | fwd ms | fwd+bwd ms | GPU ms (fwd+bwd) | fwd+bwd Mtok/s | fwd+bwd peak MiB "
              "| FLA / this (fwd+bwd) | FLA / this (GPU ms) |\n|---|---|---|---|---|---|---|---|---|")


def bench(fn, inputs, backward):
    """(median ms, peak MiB above the inputs) of fn, with o.backward when `backward`."""
    from triton.testing import do_bench
    xs = [x.detach().clone().requires_grad_(backward) for x in inputs]
    do = None

    def step():
        nonlocal do
        o = fn(*xs)
        if backward:
            if do is None:
                do = torch.randn_like(o)
            o.backward(do)
            for x in xs:
                x.grad = None
        return o

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return do_bench(step, warmup=50, rep=300, return_mode="median"), peak


def fwd_bwd_kernel_times(fn, xs) -> list[tuple[str, float, int]]:
    """gpu_time.kernel_times of one fwd+bwd of fn on xs (their grads cleared after)."""
    def fwd_bwd():
        o = fn(*xs)
        o.backward(torch.ones_like(o))
    rows = kernel_times(fwd_bwd)
    for x in xs:
        x.grad = None
    return rows


def median_gpu_ms(fn, inputs, runs=3):
    """The GPU's time in kernels during one fwd+bwd, median of `runs`."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    fwd_bwd_kernel_times(fn, xs)   # warm-up
    return sorted(sum(ms for _, ms, _ in fwd_bwd_kernel_times(fn, xs)) for _ in range(runs))[runs // 2]


def profile(fn, inputs, label):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    fwd_bwd_kernel_times(fn, xs)   # warm-up
    rows = fwd_bwd_kernel_times(fn, xs)
    print(f"\n-- {label}: GPU time per kernel (one fwd+bwd)")
    for name, ms, _ in sorted(rows, key=lambda x: -x[1])[:12]:
        print(f"   {ms:8.3f} ms  {name[:90]}")
    print(f"   {sum(ms for _, ms, _ in rows):8.3f} ms  on the GPU in all ({len(rows)} kernels)")


def sdpa(q, k, v):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def table_rows(shape: str, tokens: int, res: dict, ref_name: str) -> list[str]:
    """One row per kernel of {name: (fwd ms, fwd+bwd ms, peak MiB, GPU ms)}, with the ratios to `ref_name`'s."""
    ref = res.get(ref_name)
    rows = []
    for name, (f_ms, fb_ms, mem, g_ms) in res.items():
        ratio = f"{ref[1] / fb_ms:5.2f}x" if ref else "  n/a"
        g_ratio = f"{ref[3] / g_ms:5.2f}x" if ref else "  n/a"
        rows.append(f"| {shape} | {name:22s} | {f_ms:8.3f} | {fb_ms:8.3f} | {g_ms:8.3f} | {tokens / fb_ms / 1e3:8.2f} "
                    f"| {mem:8.0f} | {ratio} | {g_ratio} |")
    return rows


def bench_op(op, settings, args) -> list[str]:
    fla, why = None, "--kernels ours"
    if args.kernels == "all":
        try:
            fla = op.fla(op.shapes[0])
        except Exception as e:  # noqa: BLE001  (missing, or broken against this torch/triton)
            why = f"{type(e).__name__}: {e}"
    if fla is None:
        print(f"note: FLA's {op.name} rows skipped ({why})")
    print(f"{op.name}: ours timed as {op.model_call}")
    ours_name, fla_name = f"ours {op.name} (model call)", f"FLA 0.6.0 chunk_{op.name}"
    shapes = {"all": op.shapes, "first": op.shapes[:1], "last": op.shapes[-1:]}[args.shapes]
    if args.shape:
        shapes = [args.shape]
    rows = []
    for shape in shapes:
        inputs = op.make_inputs(*shape)
        cands = [(ours_name, lambda *xs, shape=shape: op.ours(shape, xs, settings))] \
            + ([(fla_name, op.fla(shape))] if fla else []) \
            + ([("SDPA flash (causal)", lambda *xs, shape=shape: sdpa(*op.qkv(shape, xs)))]
               if args.kernels == "all" else [])
        label = " ".join(f"{n}={x}" for n, x in zip(op.shape_names, shape))
        res = {}
        for name, fn in cands:
            f_ms, _ = bench(fn, inputs, False)
            fb_ms, fb_mem = bench(fn, inputs, True)
            res[name] = (f_ms, fb_ms, fb_mem, median_gpu_ms(fn, inputs))
            print(f"   done {name} {label}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms, GPU {res[name][3]:.3f} ms",
                  flush=True)
            if args.profile and name != "SDPA flash (causal)":
                profile(fn, inputs, f"{name} {label}")
        rows += table_rows(label, shape[0] * shape[1], res, fla_name)
    return rows


def shape_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="all", choices=["all", *OPS])
    p.add_argument("--shapes", default="all", choices=["all", "first", "last"])
    p.add_argument("--shape", type=shape_arg, default=None, metavar="B,T,H,...",
                   help="one shape instead of the op's own (its names as the table's), e.g. 8,4096,20,64,64: the "
                        "0.6B RWKV-7 layer")
    p.add_argument("--kernels", default="all", choices=["all", "ours"], help="ours: skip FLA and SDPA")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="OP.FIELD=VALUE",
                   help="a kernel setting instead of its default, e.g. rwkv7.scan_bv=32")
    args = p.parse_args()
    from kernels.settings import parse
    try:
        settings = parse(args.set)
    except ValueError as e:
        p.exit(2, f"bench_kernels: {e}\n")
    if settings:
        print(f"kernel settings: {settings}")
    if args.shape:
        for name, op in OPS.items():
            if args.op in ("all", name) and len(args.shape) != len(op.shape_names):
                p.exit(2, f"bench_kernels: --shape for {name} takes {len(op.shape_names)} numbers "
                          f"({','.join(op.shape_names)}), got {len(args.shape)}\n")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name, op in OPS.items():
        if args.op in ("all", name):
            rows += bench_op(op, settings.get(name), args)
    print("\n" + TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
