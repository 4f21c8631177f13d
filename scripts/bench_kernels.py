"""Kernel benchmark: our chunk_rwkv7 beside FLA's (optional) and causal SDPA flash attention, same run, same GPU.

    python scripts/bench_kernels.py                 # the table (median ms, tokens/s, peak memory, ratio vs FLA)
    python scripts/bench_kernels.py --sweep [N]     # also (the first N of) the alternatives to our settings
    python scripts/bench_kernels.py --profile       # also per-kernel CUDA time of one fwd+bwd
    python scripts/bench_kernels.py --set rwkv7.LEVEL_SUMS=False   # other kernel settings (kernels/settings.py)

FLA's chunk_rwkv7 is called as FLA's RWKV7 layer calls it (a = -kk, b = kk * a, scale 1, safe_gate=True,
lower_bound=-exp(-0.5), chunk_size=64, bf16 log decay in [-exp(-0.5), 0)). Ours gets the same values with the log
decay in fp32. Rows for FLA are skipped with a note when it is not installed.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

SHAPES = [(8, 4096, 16, 64), (2, 16384, 16, 64)]   # B, T, H, K = V


def make(B, T, H, D, dev="cuda"):
    torch.manual_seed(0)
    dt = torch.bfloat16
    r, k, v = (torch.randn(B, T, H, D, device=dev, dtype=dt) for _ in range(3))
    kk = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1)
    rate = torch.rand(B, T, H, D, device=dev)
    w = -math.exp(-0.5) * torch.sigmoid(torch.randn(B, T, H, D, device=dev))
    return r, w, k, v, (-kk).to(dt), (kk * rate).to(dt)


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
    ms = do_bench(step, warmup=50, rep=300, return_mode="median")
    return ms, peak


def ours(r, w, k, v, a, b):
    from kernels.rwkv7 import chunk_rwkv7
    return chunk_rwkv7(r, w, k, v, a, b, scale=1.0)[0]


def fla_fn():
    try:
        from fla.ops.rwkv7 import chunk_rwkv7 as fla_chunk
    except Exception as e:  # noqa: BLE001  (missing, or broken against this torch/triton)
        return None, f"{type(e).__name__}: {e}"

    def fn(r, w, k, v, a, b):
        return fla_chunk(r, w.to(r.dtype), k, v, a, b, scale=1.0, safe_gate=True,
                         lower_bound=-math.exp(-0.5), chunk_size=64)[0]
    return fn, None


def sdpa(r, w, k, v, a, b):
    q, kk, vv = (x.transpose(1, 2) for x in (r, k, v))
    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True).transpose(1, 2)


def kernel_times(fn, xs) -> list[tuple[str, float]]:
    """(kernel name, ms) of every kernel that ran on the GPU during one fwd+bwd of fn on xs, under the profiler."""
    from torch.profiler import ProfilerActivity, profile as prof_ctx
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        o = fn(*xs)
        o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
    for x in xs:
        x.grad = None
    return [(e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]


def gpu_ms(fn, inputs, runs=3):
    """Time the GPU spends in kernels during one fwd+bwd (the sum of the kernels' durations, median of `runs`): the
    device's work alone, without the gaps in which it waits for the host to launch the next kernel. The timed
    fwd+bwd includes those gaps, so it depends on the host's speed where the kernels are short and many (FLA's
    fwd+bwd took 3.66 to 5.34 ms on four H100 machines while its kernels took about 3.4 ms)."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    kernel_times(fn, xs)   # warm-up
    totals = sorted(sum(ms for _, ms in kernel_times(fn, xs)) for _ in range(runs))
    return totals[runs // 2]


TABLE_HEAD = ("| shape | kernel | fwd ms | fwd+bwd ms | GPU ms (fwd+bwd) | fwd+bwd Mtok/s | fwd+bwd peak MiB "
              "| FLA / this (fwd+bwd) | FLA / this (GPU ms) |\n|---|---|---|---|---|---|---|---|---|")


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


def profile(fn, inputs, label):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    kernel_times(fn, xs)   # warm-up
    rows = kernel_times(fn, xs)
    print(f"\n-- {label}: CUDA time per kernel (one fwd+bwd)")
    for name, ms in sorted(rows, key=lambda x: -x[1])[:12]:
        print(f"   {ms:8.3f} ms  {name[:90]}")
    # against the timed fwd+bwd: what is left is the GPU waiting for the host to launch the next kernel
    print(f"   {sum(ms for _, ms in rows):8.3f} ms  on the GPU in all ({len(rows)} kernels)")


# Results on an H100 are in kernels/rwkv7/README.md (chunks of 32 and 64 were far slower or did not fit; run those
# one per process: an illegal memory access poisons the CUDA context for the settings after it).
SWEEP = [dict(W_FEATURE_MAJOR=False), dict(BLOCK_MAP_BV=64), dict(BLOCK_SCAN=True), dict(BLOCK_SCAN=False),
         dict(SCAN_WARPS=8), dict(SCAN_BV=32), dict(BWD_WARPS=8), dict(PREP_MAXNREG=128), dict(PREP_MAXNREG=None), dict(LEVEL_SUMS=False),
         dict(CHUNK_PREC="bf16"), dict(BLOCK_CHUNKS=16), dict(BLOCK_CHUNKS=64), dict(BLOCK_BV=32),
         dict(BLOCK_MAP_WARPS=8)]


def grads(fn, inputs):
    """Output and input gradients of one fwd+bwd (fixed upstream gradient), flattened."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    o = fn(*xs)
    o.backward(torch.ones_like(o) / o.numel() ** 0.5)
    return [o.float()] + [x.grad.float() for x in xs]


def sweep(mod, fn, inputs, changes=SWEEP):
    """Alternatives to the defaults set in the kernel module `mod` (one change of its settings at a time), each with
    its largest relative RMS difference from the defaults over the output and the input gradients."""
    ref = grads(fn, inputs)
    for change in changes:
        saved = {n: getattr(mod, n) for n in change}
        for n, x in change.items():
            setattr(mod, n, x)
        try:
            f_ms, _ = bench(fn, inputs, False)
            fb_ms, _ = bench(fn, inputs, True)
            diff = max(((g - g0).pow(2).mean() / g0.pow(2).mean()).sqrt().item()
                       for g, g0 in zip(grads(fn, inputs), ref))
            print(f"   sweep {change}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms, rel diff {diff:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001  (a setting that does not compile is reported, not fatal)
            print(f"   sweep {change}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            for n, x in saved.items():
                setattr(mod, n, x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", nargs="?", type=int, const=len(SWEEP), default=0, metavar="N",
                   help="also time the first N (default: all) alternatives in SWEEP")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shapes", default="all", choices=["all", "first", "last"])
    p.add_argument("--kernels", default="all", choices=["all", "ours"], help="ours: skip FLA and SDPA")
    p.add_argument("--set", action="append", default=[], metavar="rwkv7.NAME=VALUE",
                   help="a kernel setting instead of its default (kernels/settings.py), e.g. rwkv7.PREP_MAXNREG=128")
    args = p.parse_args()
    from kernels.settings import apply
    made = apply(args.set)
    if made:
        print(f"kernel settings: {made}")
    import kernels.rwkv7 as mod
    fla, why = fla_fn() if args.kernels == "all" else (None, "--kernels ours")
    if fla is None:
        print(f"note: FLA rows skipped ({why})")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    shapes = {"all": SHAPES, "first": SHAPES[:1], "last": SHAPES[-1:]}[args.shapes]
    rows = []
    for B, T, H, D in shapes:
        inputs = make(B, T, H, D)
        cands = [("ours chunk_rwkv7", ours)] + ([("FLA 0.6.0 chunk_rwkv7", fla)] if fla else []) \
            + ([("SDPA flash (causal)", sdpa)] if args.kernels == "all" else [])
        res = {}
        for name, fn in cands:
            f_ms, _ = bench(fn, inputs, False)
            fb_ms, fb_mem = bench(fn, inputs, True)
            res[name] = (f_ms, fb_ms, fb_mem, gpu_ms(fn, inputs))
            print(f"   done {name} B={B} T={T}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms, "
                  f"GPU {res[name][3]:.3f} ms", flush=True)
            if name.startswith("ours") and args.sweep:
                sweep(mod, ours, inputs, SWEEP[:args.sweep])
            if args.profile and name != "SDPA flash (causal)":
                profile(fn, inputs, f"{name} B={B} T={T}")
        rows += table_rows(f"B={B} T={T} H={H} D={D}", B * T, res, "FLA 0.6.0 chunk_rwkv7")
    print("\n" + TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
