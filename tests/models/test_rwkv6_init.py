"""RWKV-6 initialization against RWKV-LM's rules (RWKV-v5/src/model.py), re-derived here independently.

RWKV-LM builds RWKV_Tmix_x060 / RWKV_CMix_x060 with their own vector inits (time_maa_*, time_decay, time_faaaa; the
low-rank time_maa_w1 / time_decay_w1 zero and time_maa_w2 / time_decay_w2 uniform +-0.01), then
`generate_init_weight` keeps every `time_*`, `ln*` and `_w1` / `_w2` tensor and replaces every other 2-D `.weight`:
zero (att.output, ffn.value, ffn.receptance), orthogonal gain 0.1 (att.key, att.gate), orthogonal gain 1 (the rest:
its current code applies no shape gain; the older sqrt(in / out) rule would only touch ffn.value, which is zero),
uniform +-1e-4 (emb), orthogonal gain 0.5 sqrt(V / C) (head, 0.5 when V <= C); att.ln_x.weight becomes
((layer + 1) / n_layer) ** 0.7. The vectors are recomputed below in RWKV-LM's loop form; the matrices are checked by
their defining property.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.rwkv_init import (HEAD, HIDDEN, LAYERS, Parameters, check_embedding_head_and_norms, check_layer,
                                    fresh_model, layer_ratios)


def assert_uniform(w: torch.Tensor, bound: float, name: str) -> None:
    """Within +-bound and spread over it (std of U(-b, b) is b / sqrt(3))."""
    assert w.abs().max() <= bound, name
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.1 * bound, name


def reference_vectors(layer_id: int, n_layer: int, C: int, N: int) -> dict[str, torch.Tensor]:
    """RWKV_Tmix_x060 / RWKV_CMix_x060 construction-time vectors, written element by element as RWKV-LM does."""
    ratio_0_to_1, ratio_1_to_almost0, ddd = layer_ratios(layer_id, n_layer, C)
    out = {
        "maa_x": 1.0 - torch.pow(ddd, ratio_1_to_almost0),
        "maa_w": 1.0 - torch.pow(ddd, ratio_1_to_almost0),
        "maa_k": 1.0 - torch.pow(ddd, ratio_1_to_almost0),
        "maa_v": 1.0 - (torch.pow(ddd, ratio_1_to_almost0) + 0.3 * ratio_0_to_1),
        "maa_r": 1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0),
        "maa_g": 1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0),
    }
    decay_speed, faaaa = torch.zeros(C), torch.zeros(C)
    for n in range(C):
        decay_speed[n] = -6 + 5 * (n / (C - 1)) ** (0.7 + 1.3 * ratio_0_to_1)
        zigzag = ((n + 1) % 3 - 1) * 0.1
        faaaa[n] = ratio_0_to_1 * (1 - (n / (C - 1))) + zigzag
    out["decay"] = decay_speed
    out["bonus"] = faaaa.reshape(C // N, N)
    out["ffn.maa_k"] = 1.0 - torch.pow(ddd, ratio_1_to_almost0)
    out["ffn.maa_r"] = 1.0 - torch.pow(ddd, ratio_1_to_almost0)
    return out


@pytest.mark.parametrize("vocab", [300, 100], ids=["vocab>hidden", "vocab<hidden"])
def test_init_follows_rwkv_lm(vocab):
    model = fresh_model("rwkv6", vocab)
    C, F = HIDDEN, int(HIDDEN * 3.5) // 32 * 32
    params = Parameters(model)
    take = params.take
    check_embedding_head_and_norms(params, vocab)

    for i in range(LAYERS):
        p = f"layers.{i}"
        check_layer(params, i, {"r_proj": 1.0, "k_proj": 0.1, "v_proj": 1.0, "g_proj": 0.1}, F)
        assert torch.equal(take(f"{p}.ffn.receptance.weight"), torch.zeros(C, C)), f"{p} ffn.receptance"
        assert model.layers[i].attn.ln_x.eps == 64e-5   # 1e-5 * head_size_divisor (8) ** 2

        ref = reference_vectors(i, LAYERS, C, HEAD)
        maa = take(f"{p}.attn.maa")
        for row, x in enumerate("wkvrg"):
            torch.testing.assert_close(maa[row], ref[f"maa_{x}"], rtol=0, atol=1e-6, msg=f"{p} time_maa_{x}")
        for name in ("maa_x", "decay", "bonus"):
            torch.testing.assert_close(take(f"{p}.attn.{name}"), ref[name], rtol=0, atol=1e-6, msg=f"{p} {name}")
        for name in ("ffn.maa_k", "ffn.maa_r"):
            torch.testing.assert_close(take(f"{p}.{name}"), ref[name], rtol=0, atol=1e-6, msg=f"{p} {name}")

        w1, w2 = take(f"{p}.attn.maa_w1"), take(f"{p}.attn.maa_w2")
        assert w1.shape == (C, 5 * 32) and w2.shape == (5, 32, C)
        assert torch.equal(w1, torch.zeros_like(w1)), f"{p} time_maa_w1"
        assert_uniform(w2, 0.01, f"{p} time_maa_w2")
        w1, w2 = take(f"{p}.attn.decay_w1"), take(f"{p}.attn.decay_w2")
        assert w1.shape == (C, 64) and w2.shape == (64, C)
        assert torch.equal(w1, torch.zeros_like(w1)), f"{p} time_decay_w1"
        assert_uniform(w2, 0.01, f"{p} time_decay_w2")

    params.assert_all_checked()
