"""shift_mix (kernels/token_shift) against an independent fp64 reference: x_prev built token by token, out, dx and
dmix from fp64 autograd. CPU: the Triton kernels under TRITON_INTERPRET=1 (small tiles so that T = 37 and C = 80
cross tile edges) and the PyTorch path; the custom ops through opcheck and one torch.compile(fullgraph=True).
GPU (`-m gpu`): the Triton kernels in bf16 at RWKV-7 0.6B's width against the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from kernels.token_shift import Settings, shift_mix
from tests.kernels import common

NAMES = ("out", "dx", "dmix")
# tiles of 16 tokens (backward: 8 tokens, 2 tiles per program) and 64 channels: T = 37 and C = 80 end mid-tile
SMALL = Settings(fwd_bt=16, fwd_bc=64, bwd_bt=8, bwd_bc=64, bwd_tiles=2)
# document starts at t = 0, inside tiles (5, 21), on a backward tile's first token (8) and on a forward tile's and a
# backward program's first token (16)
STARTS = (0, 5, 8, 16, 21)


def make_inputs(B, T, C, n, dtype, *, keep_starts=None, with_first=False, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(device=device, dtype=dtype)
    mix = torch.rand(n, C, generator=gen).to(device)       # the model's lerps: fp32 parameters in [0, 1]
    keep = None
    if keep_starts is not None:
        keep = torch.ones(T, 1)
        keep[list(keep_starts)] = 0
        keep = keep.to(device=device, dtype=dtype)
    first = torch.randn(B, C, generator=gen).to(device=device, dtype=dtype) if with_first else None
    g = torch.randn(n, B, T, C, generator=gen).to(device=device, dtype=dtype)
    return x, mix, keep, first, g


def reference(x, mix, keep, first, g):
    """fp64: x_prev token by token, out = x + (x_prev - x) mix_i, dx and dmix by autograd of sum(g * out)."""
    x = x.detach().double().requires_grad_(True)
    mix = mix.detach().double().requires_grad_(True)
    B, T, C = x.shape
    prev = [torch.zeros(B, C, dtype=torch.float64) if first is None else first.double()]
    prev += [x[:, t - 1] for t in range(1, T)]
    if keep is not None:
        prev = [p if keep.reshape(-1)[t] != 0 else torch.zeros_like(p) for t, p in enumerate(prev)]
    x_prev = torch.stack(prev, dim=1)
    out = torch.stack([x + (x_prev - x) * mix[i] for i in range(mix.shape[0])])
    (out * g.double()).sum().backward()
    return out.detach(), x.grad, mix.grad


def ours(x, mix, keep, first, g, **kw):
    """(the n outputs stacked, dx, dmix)."""
    x = x.detach().clone().requires_grad_(True)
    mix = mix.detach().clone().requires_grad_(True)
    outs = shift_mix(x, mix, keep, first, **kw)
    assert len(outs) == mix.shape[0] and all(o.shape == x.shape for o in outs)
    torch.autograd.backward(outs, list(g.unbind(0)))
    return torch.stack(outs).detach(), x.grad, mix.grad


# bf16: out and dx are rounded once to bf16 (relative 2^-9); dmix sums exact bf16 products in fp32
TOL = {torch.float32: (1e-6, 1e-6, 1e-6), torch.bfloat16: (4e-3, 4e-3, 1e-5)}


# each n and dtype once with rows and once with packed documents; `first` with and without both
CASES = [(6, torch.float32, 2, None, True), (1, torch.float32, 1, STARTS, False),
         (6, torch.bfloat16, 1, STARTS[1:], True), (1, torch.bfloat16, 2, None, False),
         (6, torch.bfloat16, 1, STARTS, False)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n, dtype, B, keep_starts, with_first", CASES)
def test_matches_fp64_reference(backend, n, dtype, B, keep_starts, with_first):
    if backend == "triton":
        common.interpreted(lambda *a, **kw: None)   # skips unless the interpreter runs the kernels
    xs = make_inputs(B, 37, 80, n, dtype, keep_starts=keep_starts, with_first=with_first)
    got = ours(*xs, backend=backend, settings=SMALL)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == torch.float32
    ref = reference(*xs)
    for name, a, b, tol in zip(NAMES, got, ref, TOL[dtype]):
        common.assert_close([a], [b], tol, f"{backend} {dtype} n={n} B={B}", [name])


def test_default_tiles_and_program_walks_several_tiles():
    # the default settings (one channel tile wider than C = 80), and backward programs over 3 tiles of 4 tokens
    common.interpreted(lambda *a, **kw: None)
    xs = make_inputs(1, 29, 80, 6, torch.float32, keep_starts=(0, 12, 17), with_first=True)
    ref = reference(*xs)
    for s in (Settings(), Settings(bwd_bt=4, bwd_tiles=3, bwd_warps=4)):
        common.assert_close(ours(*xs, backend="triton", settings=s), ref, 1e-6, str(s), NAMES)


def test_dmix_and_dx_are_the_directional_derivatives_of_the_kernel_output():
    # out is linear in x and in mix: <g, out(x + u, mix + v)> - <g, out(x, mix)> = <dx, u> + <dmix, v> + <g, (u_prev
    # - u) v>, each side from the Triton kernels alone
    common.interpreted(lambda *a, **kw: None)
    x, mix, keep, first, g = make_inputs(1, 37, 80, 6, torch.float32, keep_starts=STARTS[1:], with_first=True)
    gen = torch.Generator().manual_seed(3)
    u, v = torch.randn(x.shape, generator=gen), torch.randn(mix.shape, generator=gen)
    run = lambda a, m, f: torch.stack(shift_mix(a, m, keep, f, backend="triton", settings=SMALL)).double()  # noqa: E731
    inner = lambda o: (o * g.double()).sum().item()  # noqa: E731
    _, dx, dmix = ours(x, mix, keep, first, g, backend="triton", settings=SMALL)
    # mix alone, then x alone (first held at zero change: it is not differentiated)
    assert inner(run(x, mix + v, first)) - inner(run(x, mix, first)) == pytest.approx(
        (dmix.double() * v).sum().item(), rel=1e-5)
    assert inner(run(x + u, mix, first)) - inner(run(x, mix, first)) == pytest.approx(
        (dx.double() * u).sum().item(), rel=1e-5)


def test_torch_path_passes_gradcheck():
    x, mix, keep, first, _ = make_inputs(1, 9, 5, 3, torch.float64, keep_starts=(0, 4), with_first=False)
    first = torch.randn(1, 5, dtype=torch.float64)
    fn = lambda a, m: tuple(shift_mix(a, m, keep, first, backend="torch"))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x.requires_grad_(True), mix.double().requires_grad_(True)))


def test_outputs_without_grads():
    # only the second of three outputs reaches the loss: the others' grads are None in the backward, i.e. zero
    x, mix, keep, first, g = make_inputs(1, 12, 16, 3, torch.float32, keep_starts=(0, 6))
    g[0], g[2] = 0, 0
    x_, mix_ = x.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    (shift_mix(x_, mix_, keep)[1] * g[1]).sum().backward()
    ref = reference(x, mix, keep, first, g)
    common.assert_close([x_.grad, mix_.grad], ref[1:], 1e-6, "one output used", NAMES[1:])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    if backend == "triton":
        common.interpreted(lambda *a, **kw: None)
    x, mix, keep, first, g = make_inputs(1, 11, 40, 2, torch.float32, keep_starts=(0, 5), with_first=True)
    s = SMALL.encode()
    torch.library.opcheck(torch.ops.flame.shift_mix.default,
                          (x.requires_grad_(True), mix.requires_grad_(True), keep.reshape(-1), first, backend, s))
    torch.library.opcheck(torch.ops.flame.shift_mix_bwd.default, (list(g.unbind(0)), x.detach(), mix.detach(),
                                                                   keep.reshape(-1), first, backend, s))


def test_compiles_without_graph_break():
    x, mix, keep, _, g = make_inputs(1, 16, 32, 6, torch.float32, keep_starts=(0, 7))
    fn = lambda a, m: sum(o * (i + 1) for i, o in enumerate(shift_mix(a, m, keep)))  # noqa: E731
    # aot_eager traces the op through Dynamo and AOTAutograd (fake and backward registration) without Inductor's
    # code generation: fullgraph fails on any graph break
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    xs = [t.detach().clone().requires_grad_(True) for t in (x, mix)]
    ys = [t.detach().clone().requires_grad_(True) for t in (x, mix)]
    compiled(*xs).backward(g.sum(0))
    fn(*ys).backward(g.sum(0))
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_bad_inputs_are_named():
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="first .* no gradient"):
        shift_mix(x, torch.rand(6, 8), first=torch.zeros(2, 8, requires_grad=True))
    with pytest.raises(ValueError, match="mix must be"):
        shift_mix(x, torch.rand(6, 7))
    with pytest.raises(ValueError, match="mix must be"):
        shift_mix(x, torch.rand(7, 8))
    with pytest.raises(ValueError, match="keep must be"):
        shift_mix(x, torch.rand(1, 8), keep=torch.ones(4))
    with pytest.raises(ValueError, match="first must be"):
        shift_mix(x, torch.rand(1, 8), first=torch.zeros(1, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_bf16_at_model_width(n, packed):
    # RWKV-7 0.6B's width, bf16: the Triton kernels against the PyTorch path (fp32 arithmetic) on the same inputs
    B, T, C = (1, 4096, 1280) if packed else (2, 4096, 1280)
    starts = (0, 17, 1000, 1024, 4095) if packed else None
    xs = make_inputs(B, T, C, n, torch.bfloat16, keep_starts=starts, with_first=not packed, device="cuda")
    got = ours(*xs, backend="triton")
    ref = ours(*xs, backend="torch")
    for name, a, b, tol in zip(NAMES, got, ref, (1e-2, 1e-2, 1e-5)):
        # out and dx may differ by one bf16 rounding where fp32 operation order differs
        common.assert_close([a], [b], tol, f"gpu n={n} packed={packed}", [name])
