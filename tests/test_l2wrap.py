"""L2Wrap in the chunked output loss, against plain PyTorch: mean cross entropy over the target tokens, wrapped in
an autograd function written from RWKV-LM's L2Wrap (backward: grad_output, and grad_output * 1e-4 / N * max at each
row's arg-max logit, N the rows the mean divides by). The loss value does not change; l2wrap=False is plain CE."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flame.loss import IGNORE_INDEX, output_loss_sum
from flame.models import build_model, model_args_class


class ReferenceL2Wrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, logits):
        ctx.save_for_backward(logits)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (logits,) = ctx.saved_tensors
        factor = 1e-4 / logits.shape[0]
        top, where = torch.max(logits, -1, keepdim=True)
        extra = torch.zeros_like(logits).scatter_(-1, where, top * factor)
        return grad_output, grad_output * extra


def reference_mean_loss(hidden, weight, labels, l2wrap):
    """Mean CE over the positions with a label; L2Wrap on exactly those positions' logits."""
    keep = labels.reshape(-1) != IGNORE_INDEX
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()[keep]
    loss = F.cross_entropy(logits, labels.reshape(-1)[keep])
    return ReferenceL2Wrap.apply(loss, logits) if l2wrap else loss


def problem(seed=0, T=40, D=24, V=50):
    """Large logits (max ~ 10-30), so the L2Wrap gradient (1e-4 max / N per row) stands far above fp32 noise."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (2, T), generator=g)
    labels[0, :7] = IGNORE_INDEX
    labels[1, 30:] = IGNORE_INDEX
    return hidden, weight, labels


def grads(loss_fn, hidden, weight, upstream=3.0):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(h, w)
    (loss * upstream).backward()   # an upstream gradient != 1: RWKV-LM's original L2Wrap got this case wrong
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [16, 4096])
def test_l2wrap_gradient_matches_reference_and_loss_is_unchanged(chunk_size):
    hidden, weight, labels = problem()
    n = int((labels != IGNORE_INDEX).sum())
    ours = {wrap: grads(lambda h, w: output_loss_sum(h, w, labels, chunk_size, l2wrap=wrap) / n, hidden, weight)
            for wrap in (False, True)}
    ref = {wrap: grads(lambda h, w: reference_mean_loss(h, w, labels, wrap), hidden, weight)
           for wrap in (False, True)}
    assert torch.equal(ours[True][0], ours[False][0])            # same loss value, bit for bit
    assert math.isclose(ours[True][0].item(), ref[True][0].item(), rel_tol=1e-6)
    # atol 1e-8 (the gradients reach 0.5): fp32 rounding in another order than autograd's (the loss kernel forms the
    # logits' gradient before the upstream scale) leaves a few entries ~5e-9 apart where cancellation makes them small
    for i in (1, 2):                                             # d hidden, d weight
        torch.testing.assert_close(ours[False][i], ref[False][i], rtol=1e-5, atol=1e-8)   # plain CE unchanged
        torch.testing.assert_close(ours[True][i], ref[True][i], rtol=1e-5, atol=1e-8)
        # the L2Wrap part alone, sharply: it is ~1e-3 of the CE gradient
        delta, ref_delta = ours[True][i] - ours[False][i], ref[True][i] - ref[False][i]
        assert ref_delta.norm() > 1e-4 * ref[False][i].norm()
        torch.testing.assert_close(delta, ref_delta, rtol=2e-3, atol=2e-3 * ref_delta.abs().max().item())


def test_ignored_positions_get_no_l2wrap_gradient():
    hidden, weight, labels = problem()
    labels[:] = IGNORE_INDEX
    labels[0, 10] = 3
    _, h_plain, _ = grads(lambda h, w: output_loss_sum(h, w, labels, 16), hidden, weight)
    _, h_wrap, _ = grads(lambda h, w: output_loss_sum(h, w, labels, 16, l2wrap=True), hidden, weight)
    changed = ((h_wrap - h_plain).abs().sum(-1) > 0).nonzero().tolist()
    assert changed == [[0, 10]]


@pytest.mark.parametrize("name,extra,default", [
    ("rwkv7", dict(hidden_size=64, num_layers=2, head_dim=32), True),
    ("transformer", dict(hidden_size=64, num_layers=2, num_heads=4), False),
    ("gsa", dict(hidden_size=64, num_layers=2, num_heads=2, num_slots=16), False),
])
def test_models_pass_their_l2wrap_setting(name, extra, default):
    """RWKV-7 trains with L2Wrap by default (RWKV-LM), the Transformer and GSA without (FLA's GSAConfig); the
    model's loss path equals the reference built on its own logits."""
    args = model_args_class(name)(name=name, vocab_size=96, **extra)
    assert args.l2wrap is default
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)   # large logits, so L2Wrap's share of the head gradient is visible
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    n = int((labels != IGNORE_INDEX).sum())

    def head_grad(loss_of_model):
        model.zero_grad()
        loss_of_model().backward()
        return model.lm_head.weight.grad.clone()

    def reference(wrap):
        keep = labels.flatten() != IGNORE_INDEX
        logits = model(ids).flatten(0, 1)[keep]
        loss = F.cross_entropy(logits, labels.flatten()[keep])
        return ReferenceL2Wrap.apply(loss, logits) if wrap else loss

    ours = {}
    for wrap in (False, True):
        args.l2wrap = wrap
        ours[wrap] = head_grad(lambda: model(ids, labels=labels) / n)
        torch.testing.assert_close(ours[wrap], head_grad(lambda: reference(wrap)), rtol=1e-4, atol=1e-7)
    assert (ours[True] - ours[False]).abs().max() > 10 * (1e-7 + 1e-4 * ours[False].abs().max())
