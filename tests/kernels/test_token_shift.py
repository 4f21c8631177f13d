"""norm_shift_mix (kernels/token_shift) against an independent fp64 reference: PyTorch's layer_norm, x_prev built token
by token, the outputs and every gradient (x, the norm's weight and bias, mix) from fp64 autograd. CPU: the Triton
kernels under TRITON_INTERPRET=1 (small tiles so that T = 37 and C = 80 cross tile edges) and the PyTorch path; the
custom ops through opcheck and one torch.compile(fullgraph=True). GPU (`-m gpu`): the Triton kernels in bf16 at RWKV-7
0.6B's width against the PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.token_shift import Settings, norm_shift_mix
from tests.kernels import common

NAMES = ("out", "dx", "dweight", "dbias", "dmix", "dfirst")
EPS = 1e-5
# forward programs of 4 rows; backward tiles of 8 tokens, 2 tiles a program, and 64 channels (C = 80: two channel
# tiles, whose row sums the LayerNorm's backward adds); T = 37 and C = 80 end mid-tile
SMALL = Settings(fwd_bt=4, bwd_bt=8, bwd_bc=64, bwd_tiles=2, norm_bt=8)
# document starts at t = 0, inside tiles (5, 21), on a backward tile's first token (8) and on a forward tile's and a
# backward program's first token (16)
STARTS = (0, 5, 8, 16, 21)


def make_inputs(B, T, C, n, dtype, *, keep_starts=None, with_first=False, device="cpu", seed=0):
    """x with a mean and a scale of its own in each token (what the LayerNorm removes), the norm's weight and bias
    away from 1 and 0, the model's lerps (fp32 parameters in [0, 1]), cotangents g of the n outputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen) * (0.5 + torch.rand(B, T, 1, generator=gen) * 3)
    x = (x + torch.randn(B, T, 1, generator=gen)).to(device=device, dtype=dtype)
    weight = (1 + 0.3 * torch.randn(C, generator=gen)).to(device=device, dtype=dtype)
    bias = (0.3 * torch.randn(C, generator=gen)).to(device=device, dtype=dtype)
    mix = torch.rand(n, C, generator=gen).to(device)
    keep = None
    if keep_starts is not None:   # a tuple: one keep [T, 1] for every row; a list of tuples: each row's own [B, T]
        rows = keep_starts if isinstance(keep_starts, list) else [keep_starts]
        keep = torch.ones(len(rows), T)
        for row, starts in zip(keep, rows):
            row[list(starts)] = 0
        keep = (keep if isinstance(keep_starts, list) else keep.reshape(T, 1)).to(device=device, dtype=dtype)
    first = torch.randn(B, C, generator=gen).to(device=device, dtype=dtype) if with_first else None
    g = torch.randn(n, B, T, C, generator=gen).to(device=device, dtype=dtype)
    return x, weight, bias, mix, keep, first, g


def reference(x, weight, bias, mix, keep, first, g):
    """fp64: xn = layer_norm(x), xn_prev token by token, out = xn + (xn_prev - xn) mix_i, every gradient (first's
    too) by autograd of sum(g * out)."""
    x, weight, bias, mix = (t.detach().double().requires_grad_(True) for t in (x, weight, bias, mix))
    B, T, C = x.shape
    first = None if first is None else first.detach().double().requires_grad_(True)
    xn = F.layer_norm(x, (C,), weight, bias, EPS)
    prev = [torch.zeros(B, C, dtype=torch.float64) if first is None else first]
    prev += [xn[:, t - 1] for t in range(1, T)]
    if keep is not None:   # [T, 1]: every row's; [B, T]: each row's own
        rows = keep.reshape(-1, T).double()
        prev = [p * (rows[:, t, None] != 0) for t, p in enumerate(prev)]
    xn_prev = torch.stack(prev, dim=1)
    out = torch.stack([xn + (xn_prev - xn) * mix[i] for i in range(mix.shape[0])])
    (out * g.double()).sum().backward()
    return out.detach(), x.grad, weight.grad, bias.grad, mix.grad, None if first is None else first.grad


def ours(x, weight, bias, mix, keep, first, g, **kw):
    """(the n outputs stacked, dx, dweight, dbias, dmix, dfirst or None)."""
    x, weight, bias, mix = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias, mix))
    first = None if first is None else first.detach().clone().requires_grad_(True)
    outs = norm_shift_mix(x, weight, bias, EPS, mix, keep, first, **kw)
    assert len(outs) == mix.shape[0] and all(o.shape == x.shape for o in outs)
    torch.autograd.backward(outs, list(g.unbind(0)))
    return torch.stack(outs).detach(), x.grad, weight.grad, bias.grad, mix.grad, None if first is None else first.grad


# bf16: out, dweight and dbias are rounded once to bf16 (relative 2^-9), dx twice (dxn * weight, then dx); dmix sums
# fp32 products over tokens; dfirst sums n bf16 grads times mix in fp32, rounded once
TOL = {torch.float32: (1e-6,) * 6, torch.bfloat16: (4e-3, 8e-3, 4e-3, 4e-3, 1e-5, 4e-3)}


# each n and dtype once with rows and once with packed documents; `first` with and without both; a keep per row (a
# context-parallel piece's rows of packed documents), with row 0 starting a document and row 1 continuing `first`
CASES = [(6, torch.float32, 2, None, True), (1, torch.float32, 1, STARTS, False),
         (6, torch.bfloat16, 1, STARTS[1:], True), (1, torch.bfloat16, 2, None, False),
         (6, torch.bfloat16, 1, STARTS, False), (2, torch.float32, 2, STARTS, True),
         (6, torch.float32, 2, [STARTS, (9, 30)], True), (2, torch.bfloat16, 2, [(0, 9), STARTS[1:]], True)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n, dtype, B, keep_starts, with_first", CASES)
def test_matches_fp64_reference(backend, n, dtype, B, keep_starts, with_first):
    if backend == "triton":
        common.interpreted(lambda *a, **kw: None)   # skips unless the interpreter runs the kernels
    xs = make_inputs(B, 37, 80, n, dtype, keep_starts=keep_starts, with_first=with_first)
    got = ours(*xs, backend=backend, settings=SMALL)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[4].dtype == torch.float32
    assert got[2].dtype == dtype and got[3].dtype == dtype and (got[5] is None or got[5].dtype == dtype)
    ref = reference(*xs)
    for name, a, b, tol in zip(NAMES, got, ref, TOL[dtype]):
        common.assert_close([a], [b], tol, f"{backend} {dtype} n={n} B={B}", [name])


@pytest.mark.parametrize("n", [1, 6])
def test_default_tiles_and_program_walks_several_tiles(n):
    # the default settings (one channel tile wider than C = 80; its width and the tiles a program walks depend on n),
    # and backward programs over 3 tiles of 4 tokens with forward programs of one row
    common.interpreted(lambda *a, **kw: None)
    xs = make_inputs(1, 29, 80, n, torch.float32, keep_starts=(0, 12, 17), with_first=True)
    ref = reference(*xs)
    for s in (Settings(), Settings(fwd_bt=1, bwd_bt=4, bwd_tiles=3, bwd_warps=4, norm_bt=1)):
        common.assert_close(ours(*xs, backend="triton", settings=s), ref, 1e-6, str(s), NAMES)


def test_gradients_are_the_directional_derivatives_of_the_kernel_output():
    # out is linear in (weight, bias, mix) together: <g, out(p + v)> - <g, out(p)> = <dp, v> + the second-order
    # terms in v (weight or bias times mix), taken out by the central difference over +-v; and for x, a central
    # difference of the kernel's forward. Each side from the Triton kernels alone, in fp32.
    common.interpreted(lambda *a, **kw: None)
    x, weight, bias, mix, keep, first, g = make_inputs(1, 37, 80, 6, torch.float32, keep_starts=STARTS[1:],
                                                       with_first=True)
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(x.shape, generator=gen)
    vw, vb, vm, vf = (torch.randn(t.shape, generator=gen) * 1e-2 for t in (weight, bias, mix, first))

    def inner(a, w, b, m, f=first):
        outs = norm_shift_mix(a, w, b, EPS, m, keep, f, backend="triton", settings=SMALL)
        return (torch.stack(outs).double() * g.double()).sum().item()

    _, dx, dw, db, dmix, dfirst = ours(x, weight, bias, mix, keep, first, g, backend="triton", settings=SMALL)
    params = inner(x, weight + vw, bias + vb, mix + vm, first + vf) - inner(x, weight - vw, bias - vb, mix - vm,
                                                                             first - vf)
    expected = 2 * sum((d.double() * v).sum().item() for d, v in ((dw, vw), (db, vb), (dmix, vm), (dfirst, vf)))
    assert params == pytest.approx(expected, rel=1e-4)
    h = 1e-2
    assert (inner(x + h * u, weight, bias, mix) - inner(x - h * u, weight, bias, mix)) / (2 * h) == pytest.approx(
        (dx.double() * u).sum().item(), rel=1e-3)


def test_torch_path_passes_gradcheck():
    x, weight, bias, mix, keep, _, _ = make_inputs(1, 9, 5, 3, torch.float64, keep_starts=(0, 4))
    first = torch.randn(1, 5, dtype=torch.float64)
    fn = lambda a, w, b, m, f: tuple(norm_shift_mix(a, w, b, EPS, m, keep, f, backend="torch"))  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_(True) for t in (x, weight, bias, mix.double(), first)))


def test_outputs_without_grads():
    # only the second of three outputs reaches the loss: the others' grads are None in the backward, i.e. zero
    x, weight, bias, mix, keep, first, g = make_inputs(1, 12, 16, 3, torch.float32, keep_starts=(0, 6))
    g[0], g[2] = 0, 0
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias, mix)]
    (norm_shift_mix(leaves[0], leaves[1], leaves[2], EPS, leaves[3], keep)[1] * g[1]).sum().backward()
    ref = reference(x, weight, bias, mix, keep, first, g)
    common.assert_close([t.grad for t in leaves], ref[1:], 1e-6, "one output used", NAMES[1:])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    if backend == "triton":
        common.interpreted(lambda *a, **kw: None)
    x, weight, bias, mix, keep, first, g = make_inputs(1, 11, 40, 2, torch.float32, keep_starts=(0, 5),
                                                       with_first=True)
    s = SMALL.encode()
    leaves = [t.requires_grad_(True) for t in (x, weight, bias)]
    torch.library.opcheck(torch.ops.flame.norm_shift_mix.default,
                          (*leaves, EPS, mix.requires_grad_(True), keep.reshape(-1), first, backend, s))
    stats = torch.ops.flame.norm_shift_mix.default(x, weight, bias, EPS, mix, keep.reshape(-1), first, backend, s)[-1]
    torch.library.opcheck(torch.ops.flame.norm_shift_mix_bwd.default,
                          (list(g.unbind(0)), x.detach(), weight.detach(), bias.detach(), mix.detach(), stats.detach(),
                           keep.reshape(-1), first, backend, s))


def test_compiles_without_graph_break():
    x, weight, bias, mix, keep, _, g = make_inputs(1, 16, 32, 6, torch.float32, keep_starts=(0, 7))
    fn = lambda *p: sum(o * (i + 1) for i, o in enumerate(norm_shift_mix(p[0], p[1], p[2], EPS, p[3], keep)))  # noqa
    # aot_eager traces the op through Dynamo and AOTAutograd (fake and backward registration) without Inductor's
    # code generation: fullgraph fails on any graph break
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    xs = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias, mix)]
    ys = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias, mix)]
    compiled(*xs).backward(g.sum(0))
    fn(*ys).backward(g.sum(0))
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_bad_inputs_are_named():
    x, w, b = torch.randn(2, 5, 8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="mix must be"):
        norm_shift_mix(x, w, b, EPS, torch.rand(6, 7))
    with pytest.raises(ValueError, match="mix must be"):
        norm_shift_mix(x, w, b, EPS, torch.rand(7, 8))
    with pytest.raises(ValueError, match=r"keep must be \[T\], \[T, 1\] or \[B, T\] with B, T = 2, 5, got shape \(4,\)"):
        norm_shift_mix(x, w, b, EPS, torch.rand(1, 8), keep=torch.ones(4))
    with pytest.raises(ValueError, match="first must be"):
        norm_shift_mix(x, w, b, EPS, torch.rand(1, 8), first=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="weight and bias must be"):
        norm_shift_mix(x, w[:7], b, EPS, torch.rand(1, 8))


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
    for name, a, b, tol in zip(NAMES, got, ref, (1e-2, 1e-2, 1e-5, 1e-5, 1e-5, 1e-5)):
        # out and dx may differ by one bf16 rounding where fp32 operation order differs
        common.assert_close([a], [b], tol, f"gpu n={n} packed={packed}", [name])
