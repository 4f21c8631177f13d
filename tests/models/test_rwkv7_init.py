"""RWKV-7 initialization against RWKV-LM's rules, re-derived here independently.

RWKV-LM builds RWKV_Tmix_x070 / RWKV_CMix_x070 with their own vector inits, then `generate_init_weight` replaces
every 2-D `.weight`: orthogonal (gain 1; att.key 0.1), zero (att.output, ffn.value), uniform +-1e-4 (emb),
orthogonal gain 0.5 sqrt(V / C) (head, 0.5 when V <= C), and sets att.ln_x.weight to ((layer + 1) / n_layer) ** 0.7.
The vectors are recomputed below in RWKV-LM's loop form; the matrices are checked by their defining property.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.rwkv_init import (HEAD, HIDDEN, LAYERS, Parameters, assert_orthogonal, check_embedding_head_and_norms,
                                    check_layer, fresh_model, layer_ratios)


def lora_width(C: int, factor: float) -> int:
    return max(32, int(round((factor * (C ** 0.5)) / 32) * 32))


def reference_vectors(layer_id: int, n_layer: int, C: int, N: int) -> dict[str, torch.Tensor]:
    """RWKV_Tmix_x070 / RWKV_CMix_x070 construction-time vectors, written element by element as RWKV-LM does."""
    ratio_0_to_1, ratio_1_to_almost0, ddd = layer_ratios(layer_id, n_layer, C)
    out = {}
    for key, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9), ("x_g", 0.2)):
        out[key] = 1.0 - torch.pow(ddd, power * ratio_1_to_almost0)
    www, zigzag, linear = torch.zeros(C), torch.zeros(C), torch.zeros(C)
    for n in range(C):
        linear[n] = n / (C - 1) - 0.5
        zigzag[n] = ((n % N) - ((N - 1) / 2)) / ((N - 1) / 2)
        zigzag[n] = zigzag[n] * abs(zigzag[n])
        www[n] = -6 + 6 * (n / (C - 1)) ** (1 + 1 * ratio_0_to_1 ** 0.3)
    out["w0"] = www + 0.5 + zigzag * 2.5
    out["a0"] = torch.zeros(C) - 0.19 + zigzag * 0.3 + linear * 0.4
    out["v0"] = torch.zeros(C) + 0.73 - linear * 0.4
    out["k_k"] = torch.zeros(C) + 0.71 - linear * 0.1
    out["k_a"] = torch.zeros(C) + 1.02
    out["r_k"] = torch.zeros(C // N, N) - 0.04
    out["ffn.x_k"] = 1.0 - torch.pow(ddd, ratio_1_to_almost0 ** 4)
    return out


def ortho_init_gain(shape: tuple[int, int], scale: float) -> float:
    """RWKV-LM's ortho_init: gain sqrt(rows / cols) when rows > cols, times scale."""
    return (math.sqrt(shape[0] / shape[1]) if shape[0] > shape[1] else 1) * scale


@pytest.mark.parametrize("vocab", [300, 100], ids=["vocab>hidden", "vocab<hidden"])
def test_init_follows_rwkv_lm(vocab):
    model = fresh_model("rwkv7", vocab)
    C = HIDDEN
    params = Parameters(model)
    take = params.take
    check_embedding_head_and_norms(params, vocab)

    for i in range(LAYERS):
        p = f"layers.{i}"
        check_layer(params, i, {"r_proj": 1.0, "k_proj": 0.1, "v_proj": 1.0}, 4 * C)

        ref = reference_vectors(i, LAYERS, C, HEAD)
        lerp = take(f"{p}.attn.lerp")
        for row, key_name in enumerate(("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")):
            torch.testing.assert_close(lerp[row], ref[key_name], rtol=0, atol=1e-6, msg=f"{p} {key_name}")
        names = ("w0", "a0", "k_k", "k_a", "r_k") + (("v0",) if i > 0 else ())
        for name in names:
            torch.testing.assert_close(take(f"{p}.attn.{name}"), ref[name], rtol=0, atol=1e-6, msg=f"{p} {name}")
        torch.testing.assert_close(take(f"{p}.ffn.x_k"), ref["ffn.x_k"], rtol=0, atol=1e-6, msg=f"{p} ffn.x_k")

        lora = (("w", 2.5), ("a", 2.5), ("g", 5.0)) + ((("v", 1.7),) if i > 0 else ())
        for letter, factor in lora:
            D = lora_width(C, factor)
            down, up = take(f"{p}.attn.{letter}1"), take(f"{p}.attn.{letter}2")
            assert down.shape == (C, D) and up.shape == (D, C), (p, letter)
            assert torch.equal(down, torch.zeros(C, D)), f"{p} {letter}1"
            assert_orthogonal(up, ortho_init_gain((D, C), 0.1), f"{p} {letter}2")
        if i == 0:
            assert not hasattr(model.layers[0].attn, "v0"), "layer 0 supplies v_first: no value-residual path"

    params.assert_all_checked()
