"""RWKV-7 chunked kernels against the fp64 token-by-token recurrence.

CPU: the PyTorch chunked path, and the Triton kernel under TRITON_INTERPRET=1 (fp32; small shapes, the interpreter is
slow). GPU (`-m gpu`): the Triton kernel in bf16 over the broad shape sweep. Metric: RMSE(x - ref) / RMS(ref).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.rwkv7 import chunk_rwkv7, chunk_rwkv7_torch, naive_rwkv7
from kernels.rwkv7.chunk import Settings
from tests.kernels import common
from tests.kernels.common import CPU_TOL, GPU_TOL

NAMES = ("o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0")


def make_inputs(B, T, H, K, V, *, device="cpu", dtype=torch.float32, decay="model", seed=0, n_seq=None):
    """RWKV-7-shaped inputs: a = -kk, b = kk * rate (kk unit-norm per head), log decay w <= 0 (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    r, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    kk = F.normalize(rnd(B, T, H, K), dim=-1)
    rate = torch.rand(B, T, H, K, generator=gen)
    if decay == "model":      # the RWKV-7 layer's range: -exp(-0.5) * sigmoid(.)
        w = -math.exp(-0.5) * torch.sigmoid(2 * rnd(B, T, H, K))
    else:                     # "wide" or "stress"
        w = common.log_decays((B, T, H, K), decay, gen)
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


def assert_close(got, ref, tol, what="", names=NAMES):
    common.assert_close(got, ref, tol, what, names)


@pytest.fixture
def interp():
    return common.interpreted(chunk_rwkv7)


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
def test_triton_interpreter_initial_state_block_sizes(K, V, bv, interp):
    xs, h0 = make_inputs(1, 20, 1, K, V, seed=bv)
    got = run(interp, xs, h0, 1.0, settings=Settings(scan_bv=bv))
    assert_close(got, naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V} BV={bv}")


@pytest.mark.parametrize("K,V,decay,T,lens", [
    (32, 32, "stress", 200, None), (32, 128, "wide", 100, None), (128, 32, "model", 70, None),
    (32, 64, "wide", None, [1, 17, 80, 64, 9, 130])])
@pytest.mark.parametrize("scan", ["sequence", "blocked", "blocked of 2", "blocked of 4"])
def test_triton_interpreter_sequence_and_blocked_scans(scan, K, V, decay, T, lens, interp):
    # The same results whether the scans walk every chunk of a sequence in order or run blocked (per-block maps,
    # one product per block in order, then the per-block fill): T not a multiple of a block, a short last block,
    # packed sequences shorter than a chunk or a block (spare block programs), K != V both ways (two M tiles).
    settings = Settings(blocked_scan=scan != "sequence")
    if scan.startswith("blocked of"):
        settings = Settings(blocked_scan=True, block_chunks=int(scan.split()[-1]))
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0)
    T = T or sum(lens)
    xs, h0 = make_inputs(1, T, 2, K, V, decay=decay, n_seq=1 if lens is None else len(lens), seed=K + T)
    got = run(interp, xs, h0, 0.7, cu, settings=settings)
    assert_close(got, naive(xs, h0, 0.7, cu), CPU_TOL, f"{scan} K={K} V={V} lens={lens}")


def test_blocked_scans_are_chosen_for_few_sequences():
    # the benchmark's B=2 T=16384 and B=8 T=4096 (H=16, V=64)
    assert Settings().blocked(2, 16, 64) and not Settings().blocked(8, 16, 64)
    assert not Settings(blocked_scan=False).blocked(2, 16, 64) and Settings(blocked_scan=True).blocked(8, 16, 64)


def test_triton_interpreter_stress_decays(interp):
    xs, h0 = make_inputs(1, 200, 1, 32, 32, decay="stress", seed=6)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, "stress")


def test_triton_kernel_under_torch_compile(interp):
    # The models compile their blocks (training.compile): the kernel call is the custom op flame::chunk_rwkv7, which
    # Dynamo traces as one node instead of into the launches, with the same output and gradients as eager.
    from tests.helpers import assert_compiled_matches_eager

    def f(r, w, k, v, a, b):
        return (interp(r * 2, w, k, v, a, b, scale=0.5)[0] * 3).sum()

    xs, _ = make_inputs(1, 20, 1, 16, 16, decay="wide", seed=1)
    assert_compiled_matches_eager(f, [x.requires_grad_(True) for x in xs])


@pytest.mark.parametrize("blocked", [False, True])
def test_triton_interpreter_varlen_computes_no_invalid_value(blocked, interp):
    # A packed batch launches an upper bound of chunks (kernels.utils.chunk_tables); the spare programs return at
    # once instead of computing on unwritten state memory: no overflow or NaN anywhere, masked or not.
    import numpy as np

    lens = [1, 17, 30, 64, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    xs, h0 = make_inputs(1, sum(lens), 2, 32, 64, n_seq=len(lens), seed=11)
    with np.errstate(all="raise"):
        got = run(interp, xs, h0, 1.0, cu, settings=Settings(blocked_scan=blocked))
    assert_close(got, naive(xs, h0, 1.0, cu), CPU_TOL, f"varlen blocked={blocked}")


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
def test_gpu_initial_state_block_sizes(K, V, bv):
    xs, h0 = make_inputs(1, 150, 2, K, V, device="cuda", dtype=torch.bfloat16, seed=bv)
    got = run(chunk_rwkv7, xs, h0, 1.0, settings=Settings(scan_bv=bv))
    assert_close(got, naive(xs, h0, 1.0), GPU_TOL, f"{K=} {V=} {bv=}")


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


# Non-default settings, in bf16 on the GPU: stress decays at T = 4096 with initial states, and packed
# sequences with K != V.
VARIANTS = [dict(prep_maxnreg=None), dict(prep_maxnreg=128), dict(blocked_scan=False),
            dict(blocked_scan=True, block_chunks=8)]


@gpu
@pytest.mark.parametrize("fields", VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_gpu_variants_match_naive(fields):
    settings = Settings(**fields)
    xs, h0 = make_inputs(1, 4096, 2, 64, 64, device="cuda", dtype=torch.bfloat16, decay="stress", seed=10)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0, settings=settings), naive(xs, h0, 1.0), GPU_TOL, f"stress {fields}")
    lens = [1, 17, 300, 64, 90]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = make_inputs(1, sum(lens), 2, 32, 128, device="cuda", dtype=torch.bfloat16, n_seq=len(lens), seed=11)
    assert_close(run(chunk_rwkv7, xs, h0, 1.0, cu, settings=settings), naive(xs, h0, 1.0, cu), GPU_TOL,
                 f"varlen K != V {fields}")
