"""Triton forward of RWKV-7's key prologue (README.md): one program per token tile and head, k and a_lora read once."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import head_tile

EPS = tl.constexpr(1e-12)   # F.normalize's: a head whose k * k_k is below it is divided by it instead of its norm


@triton.jit
def key_terms(k, a_lora, a0, k_k, k_a, offs, mask, ch, m_c):
    """fp32: k, a = sigmoid(a_lora + a0), k_k and k_a [1, BN], u = k * k_k, its norm [BT, 1],
    kk = u / max(norm, eps)."""
    kf = tl.load(k + offs, mask=mask, other=0.).to(tl.float32)
    bias = tl.load(a0 + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    a = tl.sigmoid(tl.load(a_lora + offs, mask=mask, other=0.).to(tl.float32) + bias)
    kkw = tl.load(k_k + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    ka = tl.load(k_a + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    u = kf * kkw
    norm = tl.sqrt(tl.sum(u * u, axis=1))[:, None]
    kk = u / tl.maximum(norm, EPS)
    return kf, a, kkw, ka, norm, kk


@triton.jit
def _key_fwd(k, a_lora, a0, k_k, k_a, k_new, neg_kk, kk_a, M, C: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
             BN: tl.constexpr):
    offs, mask, ch, m_c = head_tile(tl.program_id(0), tl.program_id(1), M, C, N, BT, BN)
    kf, a, kkw, ka, norm, kk = key_terms(k, a_lora, a0, k_k, k_a, offs, mask, ch, m_c)
    dt = k_new.dtype.element_ty
    tl.store(k_new + offs, (kf * (1 + (a - 1) * ka)).to(dt), mask=mask)
    tl.store(neg_kk + offs, (-kk).to(dt), mask=mask)
    tl.store(kk_a + offs, (kk * a).to(dt), mask=mask)
