"""RWKV-7 chunked kernels against the fp64 token-by-token recurrence.

CPU: the PyTorch chunked path, and the Triton kernel under TRITON_INTERPRET=1 (fp32; small shapes, the interpreter is
slow). GPU (`-m gpu`): the Triton kernel in bf16 over the broad shape sweep. Metric: RMSE(x - ref) / RMS(ref).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.rwkv7 import chunk_rwkv7, naive_rwkv7
from kernels.rwkv7.torch_chunk import chunk_rwkv7_torch
from tests.kernels import sm90
from tests.kernels.test_gsa import GSA_KERNELS

CPU_TOL = 1e-5
GPU_TOL = 5e-3
NAMES = ("o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The recurrences are thousands of tiny ops: threads only add overhead (10x on a busy 2-core CI machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_inputs(B, T, H, K, V, *, device="cpu", dtype=torch.float32, decay="model", seed=0, n_seq=None):
    """RWKV-7-shaped inputs: a = -kk, b = kk * rate (kk unit-norm per head), log decay w <= 0 (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    r, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    kk = F.normalize(rnd(B, T, H, K), dim=-1)
    rate = torch.rand(B, T, H, K, generator=gen)
    if decay == "model":      # the RWKV-7 layer's range: -exp(-0.5) * sigmoid(.)
        w = -math.exp(-0.5) * torch.sigmoid(2 * rnd(B, T, H, K))
    elif decay == "wide":     # 3e-4 .. 4.5 per step
        w = -torch.exp(torch.empty(B, T, H, K).uniform_(-8, 1.5, generator=gen))
    elif decay == "stress":   # -1e-6 (decay ~ 1) down to -50, mixed in every row and along time
        w = -torch.exp(torch.empty(B, T, H, K).uniform_(math.log(1e-6), math.log(50.0), generator=gen))
        w[:, ::7] = -1e-6
        w[:, 3::11] = -50.0
    else:
        raise ValueError(decay)
    xs = [r, w, k, v, -kk, kk * rate]
    xs = [x.to(device=device, dtype=torch.float32 if i == 1 else dtype) for i, x in enumerate(xs)]
    N = B if n_seq is None else n_seq
    h0 = rnd(N, H, K, V).to(device)
    return xs, h0


def run(fn, xs, h0, scale, cu_seqlens=None, seed=1, **kw):
    """(outputs, grads) of fn for a fixed random cotangent on o and on the final state."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, ht = fn(*xs, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device)
    dht = torch.randn(ht.shape, generator=gen).to(o.device)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    grads = [x.grad for x in xs] + [None if h0 is None else h0.grad]
    return [o.detach(), ht.detach()] + grads


def naive(xs, h0, scale, cu_seqlens=None):
    return run(naive_rwkv7, xs, h0, scale, cu_seqlens)


def assert_close(got, ref, tol, what=""):
    for name, x, y in zip(NAMES, got, ref):
        if y is None:
            assert x is None, f"{what} {name}: expected no gradient"
            continue
        x, y = x.double().cpu(), y.double().cpu()
        assert torch.isfinite(x).all(), f"{what} {name}: non-finite values"
        err = ((x - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt().clamp_min(1e-30)).item()
        assert err <= tol, f"{what} {name}: RMSE/RMS = {err:.3e} > {tol:.0e}"


@pytest.fixture
def interp():
    """chunk_rwkv7 with backend='triton' on CPU tensors: needs TRITON_INTERPRET=1 from before Triton's import
    (tests/conftest.py sets it on machines without CUDA)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines (TRITON_INTERPRET=1)")
    return lambda *a, **kw: chunk_rwkv7(*a, backend="triton", **kw)


# ---------------------------------------------------------------- CPU: PyTorch chunked path


@pytest.mark.parametrize("B,T", [(2, 1), (2, 15), (2, 64), (2, 100), (1, 1000)])
def test_torch_path_matches_naive(B, T):
    xs, h0 = make_inputs(B, T, 2, 32, 32, decay="wide", seed=T)
    assert_close(run(chunk_rwkv7_torch, xs, h0, 0.5), naive(xs, h0, 0.5), CPU_TOL, f"T={T}")


def test_torch_path_is_the_cpu_default():
    xs, h0 = make_inputs(1, 20, 1, 16, 16)
    o, ht = chunk_rwkv7(*xs, initial_state=h0, output_final_state=True)
    o2, ht2 = chunk_rwkv7_torch(*xs, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_torch_path_varlen():
    cu = torch.tensor([0, 5, 37, 38, 100])
    xs, h0 = make_inputs(1, 100, 2, 32, 16, decay="wide", n_seq=4, seed=3)
    assert_close(run(chunk_rwkv7_torch, xs, h0, 1.0, cu), naive(xs, h0, 1.0, cu), CPU_TOL, "varlen")


def test_torch_path_stress_decays_t4096():
    # Log decays from -1e-6 to -50 mixed in one sequence: a factorized exp(g_t) * exp(-g_s) would overflow here.
    xs, h0 = make_inputs(1, 4096, 1, 32, 32, decay="stress", seed=4)
    got = run(chunk_rwkv7_torch, xs, h0, 1.0)
    with torch.no_grad():
        o_ref, ht_ref = naive_rwkv7(*xs, initial_state=h0, output_final_state=True)
    assert_close(got[:2], [o_ref, ht_ref], CPU_TOL, "stress fwd vs naive")
    # Gradients: the fp64 chunked path (checked against the naive recurrence above) is the reference at this
    # length; autograd through 4096 naive steps would take a minute of CI.
    ref = run(lambda *a, **kw: chunk_rwkv7_torch(*a, compute_dtype=torch.float64, **kw), xs, h0, 1.0)
    assert_close(got, ref, CPU_TOL, "stress bwd")


# ---------------------------------------------------------------- CPU: Triton kernel under the interpreter


@pytest.mark.parametrize("B,T", [(1, 1), (2, 15), (1, 64), (1, 100)])
def test_triton_interpreter_matches_naive(B, T, interp):
    xs, h0 = make_inputs(B, T, 2, 32, 32, decay="wide", seed=T)
    assert_close(run(interp, xs, h0, 0.5), naive(xs, h0, 0.5), CPU_TOL, f"T={T}")


def test_triton_interpreter_varlen_no_initial_state(interp):
    cu = torch.tensor([0, 5, 37, 38, 100])
    xs, _ = make_inputs(1, 100, 2, 32, 32, decay="wide", n_seq=4, seed=5)
    assert_close(run(interp, xs, None, 1.0, cu), naive(xs, None, 1.0, cu), CPU_TOL, "varlen")


@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("V", [32, 64, 128])
def test_triton_interpreter_initial_state_kv_pairs(K, V, interp):
    xs, h0 = make_inputs(1, 20, 1, K, V, seed=K + V)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V}")


@pytest.mark.parametrize("K,V", [(32, 128), (128, 32)])
@pytest.mark.parametrize("bv", [16, 64])
def test_triton_interpreter_initial_state_block_sizes(K, V, bv, monkeypatch, interp):
    import kernels.rwkv7 as mod
    monkeypatch.setattr(mod, "SCAN_BV", bv)
    xs, h0 = make_inputs(1, 20, 1, K, V, seed=bv)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V} BV={bv}")


@pytest.mark.parametrize("K,V,decay,T,lens", [
    (32, 32, "stress", 200, None), (32, 128, "wide", 100, None), (128, 32, "model", 70, None),
    (32, 64, "wide", None, [1, 17, 80, 64, 9, 130])])
@pytest.mark.parametrize("scan", ["sequence", "blocked", "blocked of 2", "blocked of 4"])
def test_triton_interpreter_sequence_and_blocked_scans(scan, K, V, decay, T, lens, monkeypatch, interp):
    # The same results whether the scans walk every chunk of a sequence in order or run blocked (per-block maps,
    # one product per block in order, then the per-block fill): T not a multiple of a block, a short last block,
    # packed sequences shorter than a chunk or a block (spare block programs), K != V both ways (two M tiles).
    import kernels.rwkv7 as mod
    monkeypatch.setattr(mod, "BLOCK_SCAN", scan != "sequence")
    if scan.startswith("blocked of"):
        monkeypatch.setattr(mod, "BLOCK_CHUNKS", int(scan.split()[-1]))
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0)
    T = T or sum(lens)
    xs, h0 = make_inputs(1, T, 2, K, V, decay=decay, n_seq=1 if lens is None else len(lens), seed=K + T)
    assert_close(run(interp, xs, h0, 0.7, cu), naive(xs, h0, 0.7, cu), CPU_TOL, f"{scan} K={K} V={V} lens={lens}")


def test_blocked_scans_are_chosen_for_few_sequences():
    import kernels.rwkv7 as mod
    assert mod._blocked(2, 16, 64) and not mod._blocked(8, 16, 64)   # the benchmark's B=2 T=16384 and B=8 T=4096


def test_triton_interpreter_stress_decays(interp):
    xs, h0 = make_inputs(1, 200, 1, 32, 32, decay="stress", seed=6)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, "stress")


@pytest.mark.parametrize("sums,K,V,decay,T", [(False, 32, 32, "stress", 200), (True, 32, 32, "stress", 200),
                                               (False, 32, 128, "wide", 37), (True, 128, 32, "wide", 37)])
def test_triton_interpreter_level_sums(sums, K, V, decay, T, monkeypatch, interp):
    # the level decays gathered against a reference row or summed over half blocks (LEVEL_SUMS), forward and backward
    import kernels.rwkv7 as mod
    monkeypatch.setattr(mod, "LEVEL_SUMS", sums)
    xs, h0 = make_inputs(1, T, 2, K, V, decay=decay, seed=K + T)
    assert_close(run(interp, xs, h0, 0.7), naive(xs, h0, 0.7), CPU_TOL, f"sums={sums} K={K} V={V}")


def test_triton_kernel_under_torch_compile(interp):
    # The models compile their blocks (training.compile): the kernel call must stay a clean graph break (Dynamo
    # tracing into the launches fails), with the same output and gradients as eager.
    from tests.helpers import assert_compiled_matches_eager

    def f(r, w, k, v, a, b):
        return (interp(r * 2, w, k, v, a, b, scale=0.5)[0] * 3).sum()

    xs, _ = make_inputs(1, 20, 1, 16, 16, decay="wide", seed=1)
    assert_compiled_matches_eager(f, [x.requires_grad_(True) for x in xs])


@pytest.mark.parametrize("sums,blocked", [(False, False), (True, False), (True, True)])
def test_triton_interpreter_varlen_computes_no_invalid_value(sums, blocked, monkeypatch, interp):
    # A packed batch launches an upper bound of chunks (kernels.utils.chunk_tables); the spare programs return at
    # once instead of computing on unwritten state memory: no overflow or NaN anywhere, masked or not.
    import numpy as np

    import kernels.rwkv7 as mod
    monkeypatch.setattr(mod, "LEVEL_SUMS", sums)
    monkeypatch.setattr(mod, "BLOCK_SCAN", blocked)
    lens = [1, 17, 30, 64, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    xs, h0 = make_inputs(1, sum(lens), 2, 32, 64, n_seq=len(lens), seed=11)
    with np.errstate(all="raise"):
        got = run(interp, xs, h0, 1.0, cu)
    assert_close(got, naive(xs, h0, 1.0, cu), CPU_TOL, "varlen")


# ---------------------------------------------------------------- CPU: the kernels compile for an H100


def compile_for_sm90(K: int, V: int, what: str = "shared") -> dict:
    """Every RWKV-7 kernel at the shipped chunk / tiles / warps / register cap, and the per-chunk kernels with the
    other level form, compiled for sm_90: {kernel: shared memory bytes}, or registers / stack / shared /
    instructions with what="resources" (scripts/kernel_resources.py prints those)."""
    import kernels.rwkv7 as m
    from kernels.rwkv7.bwd import _bwd_chunk, _bwd_scan
    from kernels.rwkv7.fwd import _block_scan, _fwd_prep, _fwd_scan

    why = sm90.unavailable()
    if why:
        return {"unavailable": why}
    BT, BK, BV, SBV = m.CHUNK, max(16, K), min(m.CHUNK_BV, max(16, V)), m._scan_bv(V, 128)  # the widest scan tile
    f32 = {n: "*fp32" for n in ("w", "W", "Uv", "Arb", "Ark", "Aak", "Tinv", "h0", "h", "U", "ht", "dht", "dh",
                                "dZ", "dh0", "dw", "Sb", "dSb", "Mb", "Nb", "s0", "s_end", "wf")}
    chunk = dict(H=16, K=K, BT=BT, BK=BK, PREC=m.CHUNK_PREC, V=V, BV=BV, LEVELS=BT.bit_length() - 1)
    scan = dict(H=16, K=K, V=V, BT=BT, BK=BK, BV=SBV, PREC=m.PREC, L=m.BLOCK_CHUNKS, W_FM=m.W_FEATURE_MAJOR)
    # the blocked scan's per-block roles (wide tiles: one program per block, head and tile), and its sequential part
    # at the narrowest tile it takes
    fwd_seq = dict(scan, BLOCKED=False, OUT=True, HAS_H0=True, STORE_HT=True)
    BBV = min(m.BLOCK_BV, max(16, V))
    fwd_block = dict(fwd_seq, BLOCKED=True, BV=BBV, HAS_H0=False, STORE_HT=False)
    bwd_seq = dict(scan, BLOCKED=False, OUT=True, HAS_DHT=True, STORE_DH0=True)
    bwd_block = dict(bwd_seq, BLOCKED=True, BV=BBV, HAS_DHT=False, STORE_DH0=False)
    block_scan = dict(H=16, K=K, V=V, BL=BT * m.BLOCK_CHUNKS, BK=BK, BV=16, PREC=m.PREC, HAS_S0=True,
                      STORE_END=True)
    other = f"LEVEL_SUMS={not m.LEVEL_SUMS}"
    wf = m.W_FEATURE_MAJOR   # _fwd_prep stores w feature-major, the scans and _bwd_chunk read it
    sw = m.SCAN_WARPS
    kernels = {
        "_fwd_prep": sm90.build(_fwd_prep, dict(chunk, SUMS=m.LEVEL_SUMS, STORE_WF=wf), m.PREP_WARPS, f32,
                                m.PREP_MAXNREG),
        "_fwd_scan": sm90.build(_fwd_scan, fwd_seq, sw, f32),
        "_fwd_scan (block maps M, N)": sm90.build(
            _fwd_scan, dict(fwd_block, BV=min(m.BLOCK_MAP_BV, K + V), OUT=False), m.BLOCK_MAP_WARPS, f32),
        "_fwd_scan (block fill)": sm90.build(_fwd_scan, fwd_block, sw, f32),
        "_block_scan": sm90.build(_block_scan, dict(block_scan, REVERSE=False), sw, f32),
        "_block_scan (reverse)": sm90.build(_block_scan, dict(block_scan, REVERSE=True), sw, f32),
        "_bwd_scan": sm90.build(_bwd_scan, bwd_seq, sw, f32),
        "_bwd_scan (block map R)": sm90.build(_bwd_scan, dict(bwd_block, OUT=False), sw, f32),
        "_bwd_scan (block fill)": sm90.build(_bwd_scan, bwd_block, sw, f32),
        "_bwd_chunk": sm90.build(_bwd_chunk, dict(chunk, W_FM=wf), m.BWD_WARPS, f32),
        f"_fwd_prep ({other})": sm90.build(_fwd_prep, dict(chunk, SUMS=not m.LEVEL_SUMS, STORE_WF=wf), m.PREP_WARPS,
                                           f32, m.PREP_MAXNREG),
    }
    return sm90.report(kernels, what)


def test_kernel_resources_script_reports_every_kernel():
    # scripts/kernel_resources.py: registers and spills per kernel of both families from the offline sm_90 build
    why = sm90.shared_memory_in_subprocess("tests.kernels.sm90", "unavailable() or {}")
    if why:
        pytest.skip(f"this Triton cannot compile for CUDA: {why}")
    proc = subprocess.run([sys.executable, str(sm90.REPO / "scripts" / "kernel_resources.py"), "--kv", "32"],
                          cwd=sm90.REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| _")]
    assert len(rows) == RWKV7_KERNELS + GSA_KERNELS, proc.stdout
    for name, regs, stack, shared, instructions, loop in rows:
        assert 0 < int(regs) <= 255 and int(stack) >= 0 and 0 < int(shared) <= sm90.H100_SMEM, name
        # the scans are loops over chunks; their body is part of the kernel
        assert 0 < int(loop) < int(instructions) if "scan" in name else 0 <= int(loop) < int(instructions), name


RWKV7_KERNELS = 11   # compile_for_sm90's builds


@pytest.mark.parametrize("K,V", [(128, 128), (32, 128)])   # the largest tiles, and K != V
def test_triton_kernels_compile_for_h100(K, V):
    sm90.assert_fits_h100("tests.kernels.test_rwkv7", f"compile_for_sm90({K}, {V})", RWKV7_KERNELS)


# ---------------------------------------------------------------- GPU: the Triton kernel in bf16

gpu = pytest.mark.gpu


def gpu_ref(xs, h0, scale, cu=None):
    """fp64 naive recurrence on the GPU, or the fp64 chunked path past 4096 steps (checked against it on CPU)."""
    if xs[0].shape[1] <= 4096:
        return naive(xs, h0, scale, cu)
    return run(lambda *a, **kw: chunk_rwkv7_torch(*a, compute_dtype=torch.float64, **kw), xs, h0, scale, cu)


@gpu
@pytest.mark.parametrize("B,T,H,K,V", [
    (2, 1, 4, 64, 64), (2, 15, 4, 64, 64), (2, 64, 4, 64, 64), (2, 100, 4, 64, 64), (2, 1000, 4, 64, 64),
    (2, 4096, 4, 64, 64), (1, 16384, 2, 64, 64), (2, 500, 2, 32, 32), (2, 500, 2, 128, 128),
    (2, 300, 2, 64, 128), (2, 300, 2, 128, 64)])
def test_gpu_bf16_matches_naive(B, T, H, K, V):
    xs, h0 = make_inputs(B, T, H, K, V, device="cuda", dtype=torch.bfloat16, seed=T + K)
    got = run(chunk_rwkv7, xs, h0, K ** -0.5)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32 and got[-1].dtype == torch.float32
    assert_close(got, gpu_ref(xs, h0, K ** -0.5), GPU_TOL, f"{B=} {T=} {H=} {K=} {V=}")


@gpu
def test_gpu_varlen_many_sequences():
    lens = [1, 15, 16, 17, 64, 100, 333, 1000, 7]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = make_inputs(1, sum(lens), 4, 64, 64, device="cuda", dtype=torch.bfloat16, n_seq=len(lens), seed=7)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0, cu), naive(xs, h0, 1.0, cu), GPU_TOL, "varlen")


@gpu
@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("V", [32, 64, 128])
def test_gpu_initial_state_kv_pairs(K, V):
    xs, h0 = make_inputs(1, 150, 2, K, V, device="cuda", dtype=torch.bfloat16, seed=K * V)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0), naive(xs, h0, 1.0), GPU_TOL, f"{K=} {V=}")


@gpu
@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (32, 32)])
@pytest.mark.parametrize("bv", [16, 64])
def test_gpu_initial_state_block_sizes(K, V, bv, monkeypatch):
    import kernels.rwkv7 as mod
    monkeypatch.setattr(mod, "SCAN_BV", bv)
    xs, h0 = make_inputs(1, 150, 2, K, V, device="cuda", dtype=torch.bfloat16, seed=bv)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0), naive(xs, h0, 1.0), GPU_TOL, f"{K=} {V=} {bv=}")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_stress_decays_t4096(dtype):
    xs, h0 = make_inputs(1, 4096, 2, 64, 64, device="cuda", dtype=dtype, decay="stress", seed=8)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0), naive(xs, h0, 1.0), GPU_TOL, f"stress {dtype}")


@gpu
def test_gpu_matches_cpu_torch_path():
    xs, h0 = make_inputs(2, 300, 2, 64, 64, device="cuda", dtype=torch.float32, decay="wide", seed=9)
    got = run(chunk_rwkv7, xs, h0, 1.0)
    cpu = run(chunk_rwkv7_torch, [x.cpu() for x in xs], h0.cpu(), 1.0)
    assert_close(got, cpu, GPU_TOL, "gpu (tf32 products) vs cpu path")


@pytest.mark.parametrize("feature_major", [False, True])
def test_triton_interpreter_w_layouts(feature_major, monkeypatch, interp):
    # the scans and _bwd_chunk reading w from [T, H, K] or from the feature-major copy by chunk that _fwd_prep
    # stores: packed sequences with short last chunks, K != V, stress decays
    import kernels.rwkv7 as mod
    monkeypatch.setattr(mod, "W_FEATURE_MAJOR", feature_major)
    lens = [5, 40, 19]
    cu = torch.tensor([0] + lens).cumsum(0)
    xs, h0 = make_inputs(1, sum(lens), 2, 32, 64, decay="stress", n_seq=len(lens), seed=12)
    assert_close(run(interp, xs, h0, 0.9, cu), naive(xs, h0, 0.9, cu), CPU_TOL, f"feature_major={feature_major}")


# The other settings the sweep times, in bf16 on the GPU: stress decays at T = 4096 with initial states, and packed
# sequences with K != V.
VARIANTS = [dict(LEVEL_SUMS=False), dict(PREP_MAXNREG=None), dict(PREP_MAXNREG=128), dict(BLOCK_SCAN=False),
            dict(BLOCK_SCAN=True, BLOCK_CHUNKS=8), dict(W_FEATURE_MAJOR=False)]


@gpu
@pytest.mark.parametrize("settings", VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_gpu_variants_match_naive(settings, monkeypatch):
    import kernels.rwkv7 as mod
    for name, value in settings.items():
        monkeypatch.setattr(mod, name, value)
    xs, h0 = make_inputs(1, 4096, 2, 64, 64, device="cuda", dtype=torch.bfloat16, decay="stress", seed=10)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0), naive(xs, h0, 1.0), GPU_TOL, f"stress {settings}")
    lens = [1, 17, 300, 64, 90]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = make_inputs(1, sum(lens), 2, 32, 128, device="cuda", dtype=torch.bfloat16, n_seq=len(lens), seed=11)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0, cu), naive(xs, h0, 1.0, cu), GPU_TOL, f"varlen K != V {settings}")
