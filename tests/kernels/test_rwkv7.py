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
from tests.kernels.common import CPU_TOL, GPU_TOL, run

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


OP = common.ChunkOp(chunk_rwkv7, chunk_rwkv7_torch, naive_rwkv7, make_inputs, NAMES)
naive, assert_close = OP.naive, OP.assert_close


@pytest.fixture
def interp():
    return common.interpreted(chunk_rwkv7)


# ---------------------------------------------------------------- CPU: PyTorch chunked path


@pytest.mark.parametrize("B,T", [(2, 1), (2, 15), (2, 64), (2, 100), (1, 1000)])
def test_torch_path_matches_naive(B, T):
    common.torch_path_matches_naive(OP, B, T)


def test_torch_path_is_the_cpu_default():
    xs, h0 = make_inputs(1, 20, 1, 16, 16)
    o, ht = chunk_rwkv7(*xs, initial_state=h0, output_final_state=True)
    o2, ht2 = chunk_rwkv7_torch(*xs, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_torch_path_varlen():
    common.torch_path_varlen(OP)


def test_torch_path_stress_decays_t4096():
    common.torch_path_stress_decays_t4096(OP, K=32)


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
    common.interpreter_initial_state_kv_pairs(OP, interp, K, V)


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


@pytest.mark.parametrize("decay", ["model", "stress"])
def test_triton_interpreter_bf16_products(decay, interp):
    # (with bf16 products, h and U are also kept for the backward in bf16)
    common.interpreter_bf16_products(OP, interp, Settings, decay)


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


@gpu
@pytest.mark.parametrize("B,T,H,K,V", common.GPU_SHAPES)
def test_gpu_bf16_matches_naive(B, T, H, K, V):
    common.gpu_bf16_matches_naive(OP, B, T, H, K, V)


@gpu
def test_gpu_varlen_many_sequences():
    common.gpu_varlen_many_sequences(OP)


@gpu
@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("V", [32, 64, 128])
def test_gpu_initial_state_kv_pairs(K, V):
    common.gpu_initial_state_kv_pairs(OP, K, V)


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
    common.gpu_stress_decays_t4096(OP, dtype, seed=8)


@gpu
def test_gpu_matches_cpu_torch_path():
    common.gpu_matches_cpu_torch_path(OP)


# Non-default settings, in bf16 on the GPU: stress decays at T = 4096 with initial states, and packed
# sequences with K != V.
VARIANTS = [dict(prep_maxnreg=None), dict(prep_maxnreg=128), dict(blocked_scan=False),
            dict(blocked_scan=True, block_chunks=8)]


@gpu
@pytest.mark.parametrize("fields", VARIANTS, ids=common.settings_id)
def test_gpu_variants_match_naive(fields):
    settings = Settings(**fields)
    common.gpu_stress_decays_t4096(OP, torch.bfloat16, seed=10, settings=settings)
    common.gpu_varlen_k_ne_v(OP, torch.bfloat16, settings=settings)
