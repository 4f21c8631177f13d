"""kernels.gsa.chunk_gsa_from_projection: GSA's feature maps and the chunk op from the stacked projection y, whose
Triton backward forms y's gradient where the features' gradients are formed. The reference is the plain composition:
the feature maps by autograd and the fp64 token-by-token recurrence (naive_gsa).

CPU: the Triton kernel under TRITON_INTERPRET=1 and the PyTorch path; GPU (-m gpu): bf16 at the model's layer shape
against the same kernel without the projection (chunk_gsa on the feature maps, autograd through them).
"""

from __future__ import annotations

import pytest
import torch

from kernels.gsa import chunk_gsa, chunk_gsa_from_projection, feature_maps, naive_gsa
from tests.kernels import common
from tests.kernels.common import CPU_TOL, GPU_TOL

NORMALIZER = 8.0


def make_y(B, T, H, D, M, *, dtype=torch.float32, device="cpu", seed=0):
    """A projection's output: q, k, v parts ~ N(0, 1), gate logits ~ N(0, 4) (gates from near 1 to near 0)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(B, T, 3 * H * D + H * M, generator=gen)
    y[..., 3 * H * D:] *= 2
    return y.to(device=device, dtype=dtype)


def reference(y, H, D, M, cu_seqlens=None):
    """o by the fp64 recurrence on the feature maps, autograd through both."""
    B, T, _ = y.shape
    q, k, v, f = y.double().split([H * D] * 3 + [H * M], dim=-1)
    q, k, v, s, g = feature_maps(q, k, v, f, NORMALIZER)
    shape = lambda x, d: x.reshape(B, T, H, d)  # noqa: E731
    return naive_gsa(shape(q, D), shape(k, D), shape(v, D), shape(s, M), shape(g, M), scale=1.0,
                     cu_seqlens=cu_seqlens)[0]


def run(fn, y, seed=1):
    """(o, dy) of fn(y) for a fixed random cotangent on o."""
    y = y.detach().clone().requires_grad_(True)
    o = fn(y)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o.device)
    (o.double() * do.double()).sum().backward()
    return [o.detach(), y.grad]


@pytest.fixture
def interp():
    return common.interpreted(chunk_gsa_from_projection)


def composed(y, H, D, M, backend=None):
    """chunk_gsa on the feature maps of y, autograd through them: what chunk_gsa_from_projection replaces."""
    B, T, _ = y.shape
    q, k, v, f = y.split([H * D] * 3 + [H * M], dim=-1)
    q, k, v, s, g = feature_maps(q, k, v, f, NORMALIZER)
    shape = lambda x, d: x.reshape(B, T, H, d)  # noqa: E731
    return chunk_gsa(shape(q, D), shape(k, D), shape(v, D), shape(s, M), shape(g, M), scale=1.0, backend=backend)[0]


def segments(dy, H, D, M):
    """dy's parts: dq, dk, dv and the gate logits' (each checked apart: a small one could hide in the whole)."""
    return dy.split([H * D] * 3 + [H * M], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_interpreter_matches_the_composition(dtype, interp):
    # fp32: each of dy's segments (q, k, v through silu, f through the gate and the slot writes) to fp64 accuracy;
    # bf16: within the bf16 bar, and each segment no further from fp64 than the same kernel's composition (chunk_gsa
    # on the bf16 feature maps, autograd through them). Two heads, K = 48 over two D tiles of 32.
    H, D, M = 2, 48, 32
    y = make_y(1, 70, H, D, M, dtype=dtype, seed=3)
    got = run(lambda t: interp(t, H, D, M, NORMALIZER), y)
    ref = run(lambda t: reference(t, H, D, M), y.double())
    names = ("dq", "dk", "dv", "df")
    if dtype == torch.float32:
        common.assert_close(got, ref, CPU_TOL, "fp32", ("o", "dy"))
        common.assert_close(segments(got[1], H, D, M), segments(ref[1], H, D, M), CPU_TOL, "fp32", names)
        return
    common.assert_close(got, ref, GPU_TOL, "bf16", ("o", "dy"))
    comp = run(lambda t: composed(t, H, D, M, backend="triton"), y)
    for name, x, c, r in zip(names, segments(got[1], H, D, M), segments(comp[1], H, D, M), segments(ref[1], H, D, M)):
        assert common.rel_rmse(x, r) <= 1.05 * common.rel_rmse(c, r), name


def test_triton_interpreter_packed(interp):
    H, D, M = 1, 32, 32
    cu = torch.tensor([0, 5, 40, 64])
    y = make_y(1, 64, H, D, M, seed=4)
    got = run(lambda t: interp(t, H, D, M, NORMALIZER, cu_seqlens=cu), y)
    ref = run(lambda t: reference(t, H, D, M, cu), y.double())
    common.assert_close(got, ref, CPU_TOL, "packed", ("o", "dy"))


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_triton_interpreter_under_torch_compile(backend, interp):
    # the models compile their blocks: AOTAutograd must route y's gradient through the op (the features' own
    # gradients are None) and drop the feature maps' backward, giving eager's gradient
    H, D, M = 1, 32, 16
    y = make_y(1, 40, H, D, M, seed=5)
    x = torch.randn(40, 40, generator=torch.Generator().manual_seed(6))

    def f(y, x):   # something upstream of y, so the gradient goes on past it
        return (interp(torch.einsum("st,btc->bsc", x, y), H, D, M, NORMALIZER) * 3).sum()

    xs = [y.requires_grad_(True), x.requires_grad_(True)]
    ref = f(*xs)
    ref_grads = torch.autograd.grad(ref, xs)
    torch._dynamo.reset()
    out = torch.compile(f, backend=backend)(*xs)
    grads = torch.autograd.grad(out, xs)
    torch.testing.assert_close(out, ref)
    for g, g0 in zip(grads, ref_grads):
        torch.testing.assert_close(g, g0)
    assert grads[0].abs().sum() > 0


def test_torch_path_matches_the_composition():
    H, D, M = 2, 16, 16
    y = make_y(2, 50, H, D, M, seed=7)
    got = run(lambda t: chunk_gsa_from_projection(t, H, D, M, NORMALIZER), y)
    ref = run(lambda t: reference(t, H, D, M), y.double())
    common.assert_close(got, ref, CPU_TOL, "torch path", ("o", "dy"))


def test_wrong_width_is_one_clear_error():
    with pytest.raises(ValueError, match="3 heads head_dim"):
        chunk_gsa_from_projection(torch.zeros(1, 4, 10), 1, 2, 2, NORMALIZER)


# ---------------------------------------------------------------- GPU: bf16, the Triton kernel

@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,D,M", [(8, 4096, 5, 256, 64), (1, 2000, 2, 64, 32)])
def test_gpu_matches_chunk_gsa_on_the_feature_maps(B, T, H, D, M):
    # the same kernel without the projection (its backward stores dq, dk, dv, ds, dg; autograd takes them through
    # the feature maps): the two differ by roundings only, dy here is formed in fp32 before its one rounding
    y = make_y(B, T, H, D, M, dtype=torch.bfloat16, device="cuda", seed=8)
    got = run(lambda t: chunk_gsa_from_projection(t, H, D, M, NORMALIZER), y)
    ref = run(lambda t: composed(t, H, D, M), y)
    common.assert_close(got, ref, GPU_TOL, "projection vs composition", ("o", "dy"))
    common.assert_close(segments(got[1], H, D, M), segments(ref[1], H, D, M), GPU_TOL, "segments",
                        ("dq", "dk", "dv", "df"))
    compiled = run(torch.compile(lambda t: chunk_gsa_from_projection(t, H, D, M, NORMALIZER)), y)
    common.assert_close(compiled, ref, GPU_TOL, "compiled", ("o", "dy"))


def test_unsupported_slots_refused_in_one_line():
    # the model's call checks as chunk_gsa does, before anything launches (meta tensors: no kernel could run)
    H, D, M = 2, 64, 512
    y = torch.empty(1, 8, 3 * H * D + H * M, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^chunk_gsa: head size K=64, V=64, M=512 is not supported [^\n]*$"):
        chunk_gsa_from_projection(y, H, D, M, 8.0, backend="triton")
