"""flame's GSA is FLA 0.6.0's GSA (the paper authors' implementation): same parameter names and shapes up to a prefix
rename, the same logits from the same weights (FLA's own model on CPU, tests/fla_cpu.py), and FLA's init."""

from __future__ import annotations

import math

import pytest
import torch

from flame.models import build_model, model_args_class
from tests.fla_cpu import fla_gsa

VOCAB, HIDDEN, LAYERS, HEADS, SLOTS = 300, 64, 2, 2, 8


def flame_name(fla_name: str) -> str:
    """FLA's state_dict key -> flame's: the two models differ by these prefixes only."""
    if fla_name.startswith("model.embeddings."):
        return "embed." + fla_name.removeprefix("model.embeddings.")
    return fla_name.removeprefix("model.")


def flame_gsa(hidden=HIDDEN, conv=False, device="cpu", **kwargs):
    args = model_args_class("gsa")(name="gsa", vocab_size=VOCAB, hidden_size=hidden, num_layers=LAYERS,
                                   num_heads=HEADS, num_slots=SLOTS, use_short_conv=conv, **kwargs)
    args.validate()
    with torch.device(device):
        return build_model(args)


def reference(hidden=HIDDEN, conv=False, seed=0):
    return fla_gsa(seed=seed, hidden_size=hidden, num_hidden_layers=LAYERS, num_heads=HEADS, num_slots=SLOTS,
                   vocab_size=VOCAB, use_short_conv=conv)


@pytest.mark.parametrize("conv", [False, True])
def test_same_weights_give_fla_logits(conv):
    fla = reference(conv=conv)
    ours = flame_gsa(conv=conv)
    converted = {flame_name(k): v for k, v in fla.state_dict().items()}
    assert set(converted) == set(ours.state_dict()), set(converted) ^ set(ours.state_dict())
    ours.load_state_dict(converted)     # strict: every name and shape as FLA's, conv weights as they are
    # FLA runs its recurrent kernel up to 64 tokens and its chunk kernel (chunks of 64) above
    for shape in ((2, 40), (1, 100)):
        ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(shape[1]))
        with torch.no_grad():
            want = fla(ids).logits
            got = ours(ids)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-4, (shape, err)


def test_fresh_init_follows_fla():
    """Every matrix, convolution and the embedding ~ normal(0, 0.02) with no residual rescaling, norms at 1: as a
    fresh FLA model, parameter by parameter (the tolerances are a few standard errors of the std estimate; a
    1/sqrt(2 L) scaling of o_proj or down_proj, or nn.Conv1d's default conv init, lands far outside)."""
    hidden = 128
    fla = dict(reference(hidden=hidden, conv=True).named_parameters())
    ours = flame_gsa(hidden=hidden, conv=True, device="meta")
    ours.to_empty(device="cpu")
    torch.manual_seed(0)
    ours.init_weights()
    checked = 0
    for name, p in ours.named_parameters():
        ref = fla[next(k for k in fla if flame_name(k) == name)].detach()
        assert p.shape == ref.shape, name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)) and torch.equal(ref, torch.ones_like(ref)), name
            continue
        n = p.numel()
        tol = max(0.05, 4 / math.sqrt(2 * n))     # relative standard error of a std estimate: 1 / sqrt(2 n)
        for who, w in (("flame", p), ("FLA", ref)):
            assert abs(w.std().item() / 0.02 - 1) < tol, (who, name, w.std().item())
            assert abs(w.mean().item()) < 4 * 0.02 / math.sqrt(n), (who, name, w.mean().item())
        checked += 1
    assert checked == 2 + LAYERS * 11     # embed, lm_head; q k v f o, 3 convs, 3 MLP matrices per layer


def test_output_gate_is_an_extra_off_by_default():
    assert not any("g_proj" in name for name, _ in flame_gsa().named_parameters())
    gated = flame_gsa(output_gate=True)
    names = set(dict(gated.named_parameters()))
    assert "layers.0.attn.g_proj.weight" in names
    assert gated.layers[0].attn.g_norm.weight.shape == (HIDDEN // HEADS,)
