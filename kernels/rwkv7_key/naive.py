"""RWKV-7's key prologue in plain PyTorch, forward and backward: the CPU path of rwkv7_key."""

from __future__ import annotations

import torch

EPS = 1e-12   # F.normalize's


def _terms(k, a_lora, a0, k_k, head_dim):
    """fp32 k, a = sigmoid(a_lora + a0), u = k * k_k per head [..., H, head_dim], its norm and
    kk = u / max(norm, eps)."""
    kf, a = k.float(), torch.sigmoid(a_lora.float() + a0.float())
    u = (kf * k_k.float()).view(*k.shape[:-1], k.shape[-1] // head_dim, head_dim)
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    return kf, a, u, norm, u / norm.clamp_min(EPS)


def naive_rwkv7_key(k, a_lora, a0, k_k, k_a, head_dim: int):
    """(k_new, -kk, kk * a) in k's dtype, from k and a_lora [..., C]; fp32 inside: a = sigmoid(a_lora + a0),
    kk = normalize(k * k_k) over each head's head_dim channels, k_new = k (1 + (a - 1) k_a)."""
    kf, a, _, _, kk = _terms(k, a_lora, a0, k_k, head_dim)
    kk = kk.view(k.shape)
    k_new = kf * (1 + (a - 1) * k_a.float())
    return k_new.to(k.dtype), (-kk).to(k.dtype), (kk * a).to(k.dtype)


def naive_rwkv7_key_bwd(k, a_lora, a0, k_k, k_a, dk_new, dneg_kk, dkk_a, head_dim: int):
    """(dk, da_lora, dk_k, dk_a) of naive_rwkv7_key for the output gradients given (in the inputs' dtypes); a0's
    gradient is da_lora's sum over the tokens (the op's autograd forms it)."""
    kf, a, u, norm, kk = _terms(k, a_lora, a0, k_k, head_dim)
    ka = k_a.float()
    g_new = dk_new.float()
    g_kk = (dkk_a.float() * a - dneg_kk.float()).view(u.shape)
    g_a = dkk_a.float() * kk.view(k.shape) + g_new * kf * ka
    # below eps the norm is clamped (gradient 0): u / eps
    g_u = torch.where(norm > EPS, (g_kk - kk * (g_kk * kk).sum(-1, keepdim=True)) / norm.clamp_min(EPS),
                      g_kk / EPS).view(k.shape)
    dk = g_new * (1 + (a - 1) * ka) + g_u * k_k.float()
    sum_tokens = lambda x: x.reshape(-1, x.shape[-1]).sum(0)  # noqa: E731
    return (dk.to(k.dtype), (g_a * a * (1 - a)).to(a_lora.dtype), sum_tokens(g_u * kf).to(k_k.dtype),
            sum_tokens(g_new * kf * (a - 1)).to(k_a.dtype))
