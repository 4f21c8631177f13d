"""GSA kernel benchmark: our chunk_gsa beside FLA's (optional) and causal SDPA flash attention, same run, same GPU.

    python scripts/bench_gsa.py                 # the table (median ms, tokens/s, peak memory, ratio vs FLA)
    python scripts/bench_gsa.py --sweep [N]     # also (the first N of) our alternatives: scan tiles, FEED_SCAN, ...
    python scripts/bench_gsa.py --profile       # also per-kernel CUDA time of one fwd+bwd

Shapes: the GSA layer's head layout at hidden 1024 (4 heads, K = V = 256, M = 64 slots), B=8 x T=4096 and
B=2 x T=16384. Inputs as the layers make them: swish q, k, silu v, f = logsigmoid(.) / 8, s = 1 - e^f, scale 1.
FLA's chunk_gsa gets s and the log gate f in bf16 (as its layer passes them); ours gets s in bf16 and f in fp32 (as
flame's layer passes them). Rows for FLA are skipped with a note when it is not installed.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

# the timing and profiling harness is the RWKV-7 benchmark's (scripts/ is on sys.path when run as a script)
from bench_kernels import TABLE_HEAD, bench, gpu_ms, profile, sweep, table_rows

SHAPES = [(8, 4096, 4, 256, 64), (2, 16384, 4, 256, 64)]   # B, T, H, K = V, M


def make(B, T, H, D, M, dev="cuda"):
    torch.manual_seed(0)
    dt = torch.bfloat16
    q, k, v = (F.silu(torch.randn(B, T, H, D, device=dev)).to(dt) for _ in range(3))
    f = F.logsigmoid(torch.randn(B, T, H, M, device=dev)) / 8
    s = -torch.expm1(f)
    return q, k, v, s.to(dt), f


def ours(q, k, v, s, f):
    from kernels.gsa import chunk_gsa
    return chunk_gsa(q, k, v, s, f, scale=1.0)[0]


def fla_fn():
    try:
        from fla.ops.gsa import chunk_gsa as fla_chunk
    except Exception as e:  # noqa: BLE001  (missing, or broken against this torch/triton)
        return None, f"{type(e).__name__}: {e}"

    def fn(q, k, v, s, f):
        return fla_chunk(q, k, v, s, f.to(q.dtype), scale=1.0)[0]
    return fn, None


def sdpa(q, k, v, s, f):
    qq, kk, vv = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(1, 2)


# Alternatives to the defaults in kernels/gsa/__init__.py, one change at a time (bench_kernels.sweep prints each
# one's time and its relative difference from the defaults). The scan D tile sets how many programs the sequential
# scans spread over; FEED_SCAN takes the cumulative sums and exps off their sequential path; SPLIT_SCAN=False keeps
# the fed weights fp32 (tf32 products).
SWEEP = [dict(OUT_SCAN=False), dict(OUT_SCAN=True), dict(LOGITS_SCAN=False), dict(OUT_SCAN_PASSES=1),
         dict(KEY_SCAN_BD=32), dict(OUT_SCAN_BD=32), dict(PAIRS_WARPS=8, PAIRS_MAXNREG=128), dict(SCAN_BD=32),
         dict(PAIRS_STREAM=False), dict(PAIRS_KERNEL=False), dict(DZ_MAXNREG=128), dict(OUT_MAXNREG=168),
         dict(DKVSG_MAXNREG=None), dict(EGC_EARLY=False), dict(G_SLOT_MAJOR=False), dict(OUT_PASSES=1),
         dict(SPLIT_SCAN=False), dict(FEED_SCAN=False), dict(SCAN_BD=16), dict(SCAN_BD=64), dict(SCAN_WARPS=8),
         dict(OUT_WARPS=8), dict(CHUNK_WARPS=4), dict(CHUNK=16)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", nargs="?", type=int, const=len(SWEEP), default=0, metavar="N",
                   help="also time the first N (default: all) alternatives in SWEEP")
    p.add_argument("--kernels", default="all", choices=["all", "ours"], help="ours: skip FLA and SDPA")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shapes", default="all", choices=["all", "first"])
    args = p.parse_args()
    import kernels.gsa as mod
    fla, why = fla_fn() if args.kernels == "all" else (None, "--kernels ours")
    if fla is None:
        print(f"note: FLA rows skipped ({why})")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    shapes = SHAPES if args.shapes == "all" else SHAPES[:1]
    rows = []
    for B, T, H, D, M in shapes:
        inputs = make(B, T, H, D, M)
        cands = [("ours chunk_gsa", ours)] + ([("FLA 0.6.0 chunk_gsa", fla)] if fla else []) \
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
        rows += table_rows(f"B={B} T={T} H={H} D={D} M={M}", B * T, res, "FLA 0.6.0 chunk_gsa")
    print("\n" + TABLE_HEAD)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
