"""RWKV-7's fused key prologue (kernels.rwkv7_key) and output epilogue (kernels.rwkv7_out) against fp64 references
written here from the math (not naive.py's code): outputs and every gradient, bf16 and fp32, with extreme inputs
(a's pre-sigmoid input at +-30, tokens whose head has k = 0 so the normalize divides by its eps, o constant over a
head so the GroupNorm divides by sqrt(eps)).

CPU: the Triton kernels under TRITON_INTERPRET=1 and the PyTorch path the op takes on CPU; opcheck of the four
custom ops; one torch.compile(fullgraph=True) of both ops. GPU (`-m gpu`): Triton in bf16 at the model's shape.
Metric: RMSE(x - ref) / RMS(ref) (tests/kernels/common.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.rwkv7_key import rwkv7_key
from kernels.rwkv7_key.op import Settings as KeySettings
from kernels.rwkv7_out import rwkv7_out
from kernels.rwkv7_out.op import Settings as OutSettings
from tests.kernels.common import assert_close, opcheck
from tests.kernels.fused import outputs_and_grads, reference, skip_without_interpreter

EPS_OUT = 64e-5
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
KEY_NAMES = ("k_new", "neg_kk", "kk_a", "dk", "da_lora", "da0", "dk_k", "dk_a")
OUT_NAMES = ("y", "do", "dr", "dk", "dv", "dr_k", "dln_w", "dln_b", "dg")


def ref_key(k, a_lora, a0, k_k, k_a, N):
    """fp64: a = sigmoid(a_lora + a0); kk = u / max(|u|, 1e-12) with u = k k_k per head;
    (k (1 + (a - 1) k_a), -kk, kk a)."""
    a = 1 / (1 + torch.exp(-(a_lora + a0)))
    u = (k * k_k).unflatten(-1, (-1, N))
    # |u| without sqrt's infinite slope at 0 (there the clamp below takes over and its gradient is 0)
    norm = (u * u).sum(-1, keepdim=True).clamp_min(1e-300).sqrt()
    kk = (u / norm.clamp_min(1e-12)).flatten(-2)
    return k * (1 + (a - 1) * k_a), -kk, kk * a


def ref_out(o, r, k, v, r_k, ln_w, ln_b, g, eps):
    """fp64: per head, (o - mean) / sqrt(biased var + eps) ln_w + ln_b + (sum_N r k r_k) v, times g."""
    mean = o.mean(-1, keepdim=True)
    var = ((o - mean) ** 2).mean(-1, keepdim=True)
    xhat = (o - mean) / torch.sqrt(var + eps)
    z = xhat * ln_w.view(r_k.shape) + ln_b.view(r_k.shape) + (r * k * r_k).sum(-1, keepdim=True) * v
    return z.flatten(-2) * g


def key_inputs(B, T, H, N, dtype, gen):
    C = H * N
    k = torch.randn(B, T, C, generator=gen)
    a_lora = 2 * torch.randn(B, T, C, generator=gen)
    a_lora[:, ::5, :7] = 30.0
    a_lora[:, 2::5, 3:11] = -30.0
    a0 = -0.2 + 0.6 * torch.rand(C, generator=gen)
    k[:, 4:7, N:2 * N] = 0.0                  # head 1 of tokens 4..6: |k k_k| = 0 < eps
    k_k = 0.71 - 0.1 * torch.rand(C, generator=gen)
    k_a = 1.02 + 0.1 * torch.randn(C, generator=gen)
    return [k.to(dtype), a_lora.to(dtype), a0, k_k, k_a]


def out_inputs(B, T, H, N, dtype, gen):
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    o, r, k, v = (rnd(B, T, H, N) for _ in range(4))
    o[:, 3:6, 0] = 0.7                        # constant over head 0: variance 0, 1 / sqrt(eps)
    o[:, -1] = 50 * o[:, -1]                  # a token with large outputs
    r_k = 0.1 * rnd(H, N)
    ln_w, ln_b = 1 + 0.3 * rnd(H * N), 0.1 * rnd(H * N)
    g = rnd(B, T, H * N)
    return [x.to(dtype) for x in (o, r, k, v)] + [r_k, ln_w, ln_b, g.to(dtype)]


def backend_param():
    return pytest.mark.parametrize("backend", ["triton", "torch"])


SHAPES = pytest.mark.parametrize("B,N", [(2, 16), (1, 64)])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@backend_param()
@SHAPES
@DTYPES
def test_key_matches_fp64_reference(backend, B, N, dtype):
    skip_without_interpreter(backend)
    H, T = 2, 37
    xs = key_inputs(B, T, H, N, dtype, torch.Generator().manual_seed(0))
    got = outputs_and_grads(lambda *x: rwkv7_key(*x, N, backend=backend, settings=KeySettings(16, 8)), xs, seed=1)
    ref = reference(ref_key, xs, 1, N)
    for x, name in zip(got[:3], KEY_NAMES):
        assert x.dtype == dtype, name
    assert got[5].dtype == got[6].dtype == got[7].dtype == torch.float32
    assert_close(got, ref, TOL[dtype], f"rwkv7_key {backend} {dtype}", KEY_NAMES)
    # dk of the k = 0 head is dkk / eps (~1e12): the other tokens' dk on their own
    normal = torch.ones(B, T, H * N, dtype=torch.bool)
    normal[:, 4:7, N:2 * N] = False
    assert got[3][~normal].abs().max() > 1e9
    assert_close([got[3][normal]], [ref[3][normal]], TOL[dtype], f"rwkv7_key {backend} {dtype}", ["dk (k != 0)"])
    # the k = 0 head: no removal key, no replacement
    assert (got[1][:, 4:7, N:2 * N] == 0).all() and (got[2][:, 4:7, N:2 * N] == 0).all()


@backend_param()
@SHAPES
@DTYPES
def test_out_matches_fp64_reference(backend, B, N, dtype):
    skip_without_interpreter(backend)
    H, T = 2, 37
    xs = out_inputs(B, T, H, N, dtype, torch.Generator().manual_seed(2))
    got = outputs_and_grads(lambda *x: rwkv7_out(*x, EPS_OUT, backend=backend, settings=OutSettings(16, 8)), xs,
                            seed=3)
    ref = reference(ref_out, xs, 3, EPS_OUT)
    assert got[0].dtype == dtype and got[0].shape == (B, T, H * N)
    assert all(x.dtype == torch.float32 for x in got[5:8])
    assert_close(got, ref, TOL[dtype], f"rwkv7_out {backend} {dtype}", OUT_NAMES)


def test_partial_tiles_and_odd_head_dim():
    # tokens not a multiple of the tile and a head_dim below its power-of-two tile (masked channels)
    skip_without_interpreter("triton")
    gen = torch.Generator().manual_seed(4)
    B, T, H, N = 1, 13, 3, 24
    xs = key_inputs(B, T, H, N, torch.float32, gen)
    got = outputs_and_grads(lambda *x: rwkv7_key(*x, N, backend="triton"), xs, seed=5)
    assert_close(got, reference(ref_key, xs, 5, N), 1e-5, "rwkv7_key N=24", KEY_NAMES)
    xs = out_inputs(B, T, H, N, torch.float32, gen)
    got = outputs_and_grads(lambda *x: rwkv7_out(*x, EPS_OUT, backend="triton"), xs, seed=6)
    assert_close(got, reference(ref_out, xs, 6, EPS_OUT), 1e-5, "rwkv7_out N=24", OUT_NAMES)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    # schema, autograd registration and the fakes against each path's real outputs (the AOT tracing of the ops and
    # their backward: test_both_ops_compile_without_graph_break)
    skip_without_interpreter(backend)

    gen = torch.Generator().manual_seed(7)
    B, T, H, N = 1, 5, 2, 16
    ks = KeySettings().encode()
    xs = key_inputs(B, T, H, N, torch.float32, gen)
    xs[0] = torch.cat((xs[0], xs[0]), -1)[..., :H * N]            # strided inputs: contiguous outputs, as the fakes
    xs = [x.detach().requires_grad_(True) for x in xs]
    opcheck(torch.ops.flame.rwkv7_key.default, (*xs, N, backend, ks))
    dys = [torch.randn(B, T, H * N, generator=gen) for _ in range(3)]
    opcheck(torch.ops.flame.rwkv7_key_bwd.default, (*[x.detach() for x in xs], *dys, N, backend, ks))
    os_ = OutSettings().encode()
    xs = out_inputs(B, T, H, N, torch.float32, gen)
    xs[1] = xs[1].transpose(1, 2).contiguous().transpose(1, 2)   # r strided as [B, H, T, N]
    xs = [x.detach().requires_grad_(True) for x in xs]
    opcheck(torch.ops.flame.rwkv7_out.default, (*xs, EPS_OUT, backend, os_))
    dy = torch.randn(B, T, H * N, generator=gen)
    opcheck(torch.ops.flame.rwkv7_out_bwd.default, (*[x.detach() for x in xs], dy, EPS_OUT, backend, os_))


def test_both_ops_compile_without_graph_break():
    B, T, H, N = 1, 6, 2, 16
    gen = torch.Generator().manual_seed(8)
    k, a_lora, a0, k_k, k_a = key_inputs(B, T, H, N, torch.float32, gen)
    o, r, _, v, r_k, ln_w, ln_b, g = out_inputs(B, T, H, N, torch.float32, gen)
    xs = [x.requires_grad_(True) for x in (k, a_lora, a0, k_k, k_a, o, r, v, r_k, ln_w, ln_b, g)]

    def block(k, a_lora, a0, k_k, k_a, o, r, v, r_k, ln_w, ln_b, g):
        k_new, neg_kk, kk_a = rwkv7_key(k, a_lora, a0, k_k, k_a, N)
        heads = lambda t: t.view(B, T, H, N)  # noqa: E731
        y = rwkv7_out(o + neg_kk.view(o.shape) * kk_a.view(o.shape), r, heads(k_new), v, r_k, ln_w, ln_b, g)
        return y.square().sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager_grads = torch.autograd.grad(block(*xs), xs)
    torch._dynamo.reset()
    got_grads = torch.autograd.grad(compiled(*xs), xs)
    for e, c in zip(eager_grads, got_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["key", "out"])
def test_gpu_model_shape_bf16(op):
    B, T, H, N = 2, 4096, 20, 64     # C = 1280
    gen = torch.Generator().manual_seed(9)
    dt = torch.bfloat16
    if op == "key":
        xs = [x.cuda() for x in key_inputs(B, T, H, N, dt, gen)]
        got = outputs_and_grads(lambda *x: rwkv7_key(*x, N), xs, seed=10)
        ref = reference(ref_key, xs, 10, N)
        normal = torch.ones(B, T, H * N, dtype=torch.bool, device="cuda")
        normal[:, 4:7, N:2 * N] = False
        assert_close([got[3][normal]], [ref[3][normal]], TOL[dt], "rwkv7_key GPU", ["dk (k != 0)"])
        names = KEY_NAMES
    else:
        xs = [x.cuda() for x in out_inputs(B, T, H, N, dt, gen)]
        got = outputs_and_grads(lambda *x: rwkv7_out(*x, EPS_OUT), xs, seed=11)
        ref = reference(ref_out, xs, 11, EPS_OUT)
        names = OUT_NAMES
    assert_close(got, ref, TOL[dt], f"rwkv7_{op} GPU bf16", names)
