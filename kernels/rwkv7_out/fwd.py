"""Triton forward of RWKV-7's output epilogue (README.md): one program per token tile and head, every input read
once, y written once."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import head_tile


@triton.jit
def out_terms(o, r, k, v, r_k, ln_w, offs, mask, ch, m_c, eps, N: tl.constexpr):
    """fp32: xhat (o normalized over the head's N channels, biased variance), 1 / std [BT, 1], r, k, v, r_k and ln_w
    [1, BN], the bonus weight s = sum_N r k r_k [BT, 1]."""
    of = tl.load(o + offs, mask=mask, other=0.).to(tl.float32)
    xc = tl.where(mask, of - (tl.sum(of, axis=1) / N)[:, None], 0.)
    rstd = 1 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)[:, None]
    rf = tl.load(r + offs, mask=mask, other=0.).to(tl.float32)
    kf = tl.load(k + offs, mask=mask, other=0.).to(tl.float32)
    vf = tl.load(v + offs, mask=mask, other=0.).to(tl.float32)
    rk = tl.load(r_k + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    w = tl.load(ln_w + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    s = tl.sum(rf * kf * rk, axis=1)[:, None]
    return xc * rstd, rstd, rf, kf, vf, rk, w, s


@triton.jit
def _out_fwd(o, r, k, v, r_k, ln_w, ln_b, g, y, M, eps, C: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
             BN: tl.constexpr):
    offs, mask, ch, m_c = head_tile(tl.program_id(0), tl.program_id(1), M, C, N, BT, BN)
    xhat, rstd, rf, kf, vf, rk, w, s = out_terms(o, r, k, v, r_k, ln_w, offs, mask, ch, m_c, eps, N)
    b = tl.load(ln_b + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    gf = tl.load(g + offs, mask=mask, other=0.).to(tl.float32)
    tl.store(y + offs, ((xhat * w + b + s * vf) * gf).to(y.dtype.element_ty), mask=mask)
