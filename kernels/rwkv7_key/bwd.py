"""Triton backward of RWKV-7's key prologue (README.md): per token tile and head, dk and da_lora, and the tile's sums
over its tokens for dk_k and dk_a (fp32 partials, one row per tile, summed by the launch code)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.rwkv7_key.fwd import EPS, key_terms
from kernels.tl_utils import head_tile


@triton.jit
def _key_bwd(k, a_lora, a0, k_k, k_a, dk_new, dneg_kk, dkk_a, dk, da_lora, dk_k_part, dk_a_part, M, C: tl.constexpr,
             N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    i_t = tl.program_id(0)
    offs, mask, ch, m_c = head_tile(i_t, tl.program_id(1), M, C, N, BT, BN)
    kf, a, kkw, ka, norm, kk = key_terms(k, a_lora, a0, k_k, k_a, offs, mask, ch, m_c)
    g_new = tl.load(dk_new + offs, mask=mask, other=0.).to(tl.float32)
    g_neg = tl.load(dneg_kk + offs, mask=mask, other=0.).to(tl.float32)
    g_ka = tl.load(dkk_a + offs, mask=mask, other=0.).to(tl.float32)
    g_kk = g_ka * a - g_neg
    g_a = g_ka * kk + g_new * kf * ka
    # kk = u / max(|u|, eps): the projection off kk over |u|, or (below eps, the clamp's gradient 0) g / eps
    proj = tl.sum(g_kk * kk, axis=1)[:, None]
    g_u = tl.where(norm > EPS, (g_kk - kk * proj) / tl.maximum(norm, EPS), g_kk / EPS)
    g_k = g_new * (1 + (a - 1) * ka) + g_u * kkw
    tl.store(dk + offs, g_k.to(dk.dtype.element_ty), mask=mask)
    tl.store(da_lora + offs, (g_a * a * (1 - a)).to(da_lora.dtype.element_ty), mask=mask)
    part = i_t.to(tl.int64) * C + ch
    tl.store(dk_k_part + part, tl.sum(g_u * kf, axis=0), mask=m_c)
    tl.store(dk_a_part + part, tl.sum(g_new * kf * (a - 1), axis=0), mask=m_c)
