"""What RWKV-LM's initialization does alike for RWKV-6 and RWKV-7, checked on a freshly built flame model: the
embedding, the head, the LayerNorms, the projections `generate_init_weight` replaces, ln_x. Each version's init test
(test_rwkv6_init.py, test_rwkv7_init.py) adds its own vectors and low-rank tensors, and asserts it read them all."""

from __future__ import annotations

import math

import torch

from flame.models import build_model, model_args_class

LAYERS, HIDDEN, HEAD = 4, 128, 64


def fresh_model(name: str, vocab: int):
    """As the trainer builds it: on the meta device, materialized, NaN-filled, then init_weights()."""
    args = model_args_class(name)(name=name, vocab_size=vocab, hidden_size=HIDDEN, num_layers=LAYERS, head_dim=HEAD)
    args.validate()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    return model


def assert_orthogonal(w: torch.Tensor, gain: float, name: str) -> None:
    """Rows (wide or square) or columns (tall) orthonormal up to `gain`: the property torch's orthogonal_ gives."""
    w = w.double()
    rows, cols = w.shape
    gram = w @ w.T if rows <= cols else w.T @ w
    eye = torch.eye(min(rows, cols), dtype=torch.float64)
    err = (gram - gain ** 2 * eye).abs().max().item()
    assert err < 1e-5 * max(1.0, gain ** 2), f"{name}: |W W^T - gain^2 I| = {err:.2e} (gain {gain})"


def layer_ratios(layer_id: int, n_layer: int, C: int) -> tuple[float, float, torch.Tensor]:
    """RWKV-LM's per-layer ratio_0_to_1, ratio_1_to_almost0 and ddd[i] = i / C, in its loop form."""
    ddd = torch.zeros(C)
    for i in range(C):
        ddd[i] = i / C
    return layer_id / (n_layer - 1), 1.0 - (layer_id / n_layer), ddd


class Parameters:
    """A model's parameters by name, remembering every one a test reads, so that it can assert it read them all."""

    def __init__(self, model):
        self.params = dict(model.named_parameters())
        self.checked: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        self.checked.add(name)
        return self.params[name].detach()

    def ones_and_zeros(self, prefix: str) -> None:
        C = HIDDEN
        assert torch.equal(self.take(f"{prefix}.weight"), torch.ones(C)), prefix
        assert torch.equal(self.take(f"{prefix}.bias"), torch.zeros(C)), prefix

    def assert_all_checked(self) -> None:
        unchecked = set(self.params) - self.checked
        assert not unchecked, f"parameters this test does not check: {sorted(unchecked)}"


def check_embedding_head_and_norms(params: Parameters, vocab: int) -> None:
    """emb uniform +-1e-4, head orthogonal of gain 0.5 sqrt(V / C) (0.5 when V <= C), ln0 and ln_out ones/zeros."""
    C, V = HIDDEN, vocab
    emb = params.take("embed.weight")
    assert emb.abs().max() <= 1e-4 and emb.std() > 0.5e-4, "embedding: uniform in +-1e-4"
    assert_orthogonal(params.take("lm_head.weight"), 0.5 * math.sqrt(V / C) if V > C else 0.5, "lm_head")
    params.ones_and_zeros("embed_norm")
    params.ones_and_zeros("norm")


def check_layer(params: Parameters, i: int, proj_gains: dict[str, float], ffn_width: int) -> None:
    """Layer i's LayerNorms, its attention projections (orthogonal of the gains given, output zero), the channel
    mix's key (orthogonal) and value (zero), and ln_x: weight ((i + 1) / n_layer) ** 0.7, bias zero."""
    C, F, p = HIDDEN, ffn_width, f"layers.{i}"
    params.ones_and_zeros(f"{p}.attn_norm")
    params.ones_and_zeros(f"{p}.ffn_norm")
    for name, gain in proj_gains.items():
        assert_orthogonal(params.take(f"{p}.attn.{name}.weight"), gain, f"{p} {name}")
    assert torch.equal(params.take(f"{p}.attn.o_proj.weight"), torch.zeros(C, C)), f"{p} output"
    key = params.take(f"{p}.ffn.key.weight")
    assert key.shape == (F, C)
    assert_orthogonal(key, 1.0, f"{p} ffn.key")
    assert torch.equal(params.take(f"{p}.ffn.value.weight"), torch.zeros(C, F)), f"{p} ffn.value"
    ln_x = ((i + 1) / LAYERS) ** 0.7
    assert torch.allclose(params.take(f"{p}.attn.ln_x.weight"), torch.full((C,), ln_x), rtol=0, atol=1e-7), p
    assert torch.equal(params.take(f"{p}.attn.ln_x.bias"), torch.zeros(C)), p
