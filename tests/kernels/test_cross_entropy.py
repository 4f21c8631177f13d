"""linear_cross_entropy_sum (kernels/cross_entropy) against an independent fp64 reference: F.cross_entropy's autograd
on fp64 logits plus L2Wrap's gradient written out from its definition (factor * max at the first arg-max of each
labelled row), then d hidden = G W and d weight = G^T h in fp64. CPU: the PyTorch rows and the Triton kernel under
TRITON_INTERPRET=1 (64-column tiles, so V = 97 and 300 end mid-tile), chunks that do not divide N and a chunk
with no label, exact ties at the arg-max within a tile and across tiles; the custom ops through opcheck and one
torch.compile(fullgraph=True). GPU (`-m gpu`): bf16 at V = 50304 against the fp32-logits path it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cross_entropy import linear_cross_entropy_sum
from tests.kernels import common

IGNORE = -100
TIE = 5   # vocab rows TIE, TIE + 1 (same tile) and V - 2 (last tile) are equal: rows 0..9 have a 3-way max there
UPSTREAM = 0.37   # the incoming gradient: the backward must scale by it


def problem(V, dtype, N=50, D=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=gen) * 0.7
    weight[TIE] *= 3
    weight[TIE + 1] = weight[V - 2] = weight[TIE]
    hidden = torch.randn(N, D, generator=gen)
    hidden[:10] += 0.5 * weight[TIE]                # rows 0..9: the largest logit is the tie
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[[0, 3]] = TIE                            # the label on the first of the tied columns ...
    labels[4] = V - 2                               # ... and on the last
    labels[16:32] = IGNORE                          # chunk_size 16: the second chunk has no label
    labels[[1, N - 10, N - 1]] = IGNORE
    return hidden.to(dtype), weight.to(dtype), labels


def reference(hidden, weight, labels, factor):
    """fp64 loss and UPSTREAM * (d hidden, d weight). Logits are the inputs' matmul (bf16 in, bf16 logits, as the op
    defines them) taken to fp64; fp32 inputs multiply in fp64."""
    h, w = hidden.double(), weight.double()
    logits = (h @ w.t() if hidden.dtype == torch.float32 else hidden @ weight.t()).double().requires_grad_(True)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    loss.backward()
    grad = logits.grad.clone()
    x = logits.detach()
    top = x.max(dim=-1, keepdim=True).values
    V = x.shape[1]
    first = torch.arange(V).expand_as(x).where(x == top, V).min(dim=-1).values    # the first column holding the max
    labelled = labels != IGNORE
    grad[labelled, first[labelled]] += factor * top[labelled, 0]
    return loss.detach(), UPSTREAM * grad @ w, UPSTREAM * grad.t() @ h


def ours(hidden, weight, labels, **kw):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = linear_cross_entropy_sum(h, w, labels, **kw)
    (loss * UPSTREAM).backward()
    return loss.detach(), h.grad, w.grad


def run(backend):
    if backend == "triton":
        return common.interpreted(linear_cross_entropy_sum)
    return lambda *a, **kw: linear_cross_entropy_sum(*a, backend="torch", **kw)


# bf16: the logits' gradient and both products are rounded once to bf16 (relative 2^-9)
TOL = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (2e-6, 6e-3)}   # (loss relative, gradients RMSE / RMS)
CASES = [  # (backend, dtype, V, chunk_size, L2Wrap factor: large, so its gradient is a real share of the total)
    ("torch", torch.float32, 97, 16, 0.0), ("torch", torch.float32, 300, 16, 0.05),
    ("torch", torch.bfloat16, 97, 16, 0.05), ("torch", torch.bfloat16, 300, 20, 0.0),
    ("triton", torch.float32, 97, 16, 0.05), ("triton", torch.bfloat16, 300, 16, 0.05),
    ("triton", torch.float32, 300, 20, 0.0),
]


@pytest.mark.parametrize("backend,dtype,V,chunk_size,factor", CASES, ids=str)
def test_loss_and_grads_match_fp64_reference(backend, dtype, V, chunk_size, factor):
    fn = run(backend)
    hidden, weight, labels = problem(V, dtype)
    logits = hidden @ weight.t()
    assert (logits[:10, TIE] == logits[:10].max(-1).values).all()          # the ties are real in these logits
    assert (logits[:10, TIE] == logits[:10, TIE + 1]).all() and (logits[:10, TIE] == logits[:10, V - 2]).all()
    got = (lambda h, w, y: fn(h, w, y, chunk_size=chunk_size, l2wrap_factor=factor, block_v=64))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = got(h, w, labels)
    (loss * UPSTREAM).backward()
    ref = reference(hidden, weight, labels, factor)
    assert loss.dtype == torch.float32 and h.grad.dtype == dtype and w.grad.dtype == dtype
    assert loss.item() == pytest.approx(ref[0].item(), rel=TOL[dtype][0])
    common.assert_close((h.grad, w.grad), ref[1:], TOL[dtype][1], f"{backend} {dtype}", ("dhidden", "dweight"))
    assert (h.grad[labels == IGNORE] == 0).all()
    if factor:   # the L2Wrap part is large enough that a missing or misplaced pull fails the comparison above
        plain = reference(hidden, weight, labels, 0.0)
        assert (plain[1] - ref[1]).norm() > 20 * TOL[dtype][1] * ref[1].norm()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_label_at_all_gives_zero_loss_and_zero_grads(backend):
    if backend == "triton":
        common.interpreted(None)
    hidden, weight, labels = problem(97, torch.float32, N=20)
    loss, dh, dw = ours(hidden, weight, torch.full_like(labels, IGNORE), chunk_size=8, l2wrap_factor=0.05,
                        backend=backend, block_v=64)
    assert loss.item() == 0 and (dh == 0).all() and (dw == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_only_gives_the_same_loss_and_no_gradients(backend):
    if backend == "triton":
        common.interpreted(None)
    hidden, weight, labels = problem(97, torch.bfloat16, N=20)
    kw = dict(chunk_size=16, l2wrap_factor=1e-4, backend=backend, block_v=64)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden.requires_grad_(True), weight.requires_grad_(True), labels, **kw)
    assert torch.equal(loss, ours(hidden.detach(), weight.detach(), labels, **kw)[0])
    # the op itself computes no gradient when none is wanted
    _, dh, dw = torch.ops.flame.linear_cross_entropy(hidden.detach(), weight.detach(), labels, 16, 1e-4, IGNORE,
                                                     False, False, backend, 64)
    assert dh.numel() == 0 and dw.numel() == 0


def test_autocast_multiplies_in_the_autocast_dtype():
    """fp32 parameters under bf16 autocast: the loss of bf16 logits, gradients back in fp32 (as the plain matmul
    under autocast would give)."""
    hidden, weight, labels = problem(97, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, dh, dw = ours(hidden, weight, labels, chunk_size=16, backend="torch")
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        ref = F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE, reduction="sum")
    (ref * UPSTREAM).backward()
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    common.assert_close((dh, dw), (h.grad, w.grad), 6e-3, "autocast", ("dhidden", "dweight"))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden .* weight .* labels"):
        linear_cross_entropy_sum(torch.randn(4, 8), torch.randn(10, 6), torch.zeros(4, dtype=torch.long))


def test_opcheck():
    hidden, weight, labels = problem(97, torch.float32, N=20)
    args = (hidden.requires_grad_(True), weight.requires_grad_(True), labels, 8, 0.05, IGNORE)
    torch.library.opcheck(torch.ops.flame.linear_cross_entropy.default, args + (True, True, "torch", 64))
    torch.library.opcheck(torch.ops.flame.linear_cross_entropy.default, args + (False, True, "torch", 64))
    _, dh, dw = torch.ops.flame.linear_cross_entropy(*args, True, True, "torch", 64)
    torch.library.opcheck(torch.ops.flame.linear_cross_entropy_bwd.default,
                          (torch.tensor(UPSTREAM), dh, dw, torch.float32, torch.float32))


def test_compiles_without_graph_break():
    hidden, weight, labels = problem(97, torch.float32)
    fn = lambda h, w: linear_cross_entropy_sum(torch.tanh(h), w, labels, chunk_size=16, l2wrap_factor=0.05)  # noqa
    # aot_eager traces the op through Dynamo and AOTAutograd (fake and backward registration) without Inductor's
    # code generation: fullgraph fails on any graph break
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    xs = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    ys = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    a, b = compiled(*xs), fn(*ys)
    (a * UPSTREAM).backward()
    (b * UPSTREAM).backward()
    assert torch.equal(a, b)
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [0.0, 1e-4])
def test_gpu_bf16_matches_fp32_logits_path(factor):
    """At a real vocabulary: the path it replaces (bf16 logits taken to fp32, F.cross_entropy, L2Wrap by autograd
    of max) against ours; loss to fp32 summation noise, gradients to bf16 rounding."""
    N, D, V = 4096, 1280, 50304
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(V, D, device="cuda", generator=gen) / D ** 0.5 * 4).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda", generator=gen)
    labels[::7] = IGNORE
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = (h @ w.t()).float()
    ref = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    top = logits.max(dim=-1).values.masked_fill(labels == IGNORE, 0.0)
    pull = 0.5 * factor * top.square().sum()
    ((ref + pull - pull.detach()) * UPSTREAM).backward()
    loss, dh, dw = ours(hidden, weight, labels, chunk_size=1024, l2wrap_factor=factor)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    common.assert_close((dh, dw), (h.grad, w.grad), 1e-2, "gpu bf16", ("dhidden", "dweight"))
