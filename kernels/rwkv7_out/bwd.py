"""Triton backward of RWKV-7's output epilogue (README.md): per token tile and head, do, dr, dk, dv, dg (the
statistics recomputed from o), and the tile's sums over its tokens for dr_k, dln_w, dln_b (fp32 partials, one row
per tile, summed by the launch code)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.rwkv7_out.fwd import out_terms
from kernels.tl_utils import head_tile


@triton.jit
def _out_bwd(o, r, k, v, r_k, ln_w, ln_b, g, dy, do, dr, dk, dv, dg, dr_k_part, dln_w_part, dln_b_part, M, eps,
             C: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    i_t = tl.program_id(0)
    offs, mask, ch, m_c = head_tile(i_t, tl.program_id(1), M, C, N, BT, BN)
    xhat, rstd, rf, kf, vf, rk, w, s = out_terms(o, r, k, v, r_k, ln_w, offs, mask, ch, m_c, eps, N)
    b = tl.load(ln_b + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    gf = tl.load(g + offs, mask=mask, other=0.).to(tl.float32)
    gy = tl.load(dy + offs, mask=mask, other=0.).to(tl.float32)
    tl.store(dg + offs, (gy * (xhat * w + b + s * vf)).to(dg.dtype.element_ty), mask=mask)
    dz = gy * gf
    tl.store(dv + offs, (dz * s).to(dv.dtype.element_ty), mask=mask)
    ds = tl.sum(dz * vf, axis=1)[:, None]
    tl.store(dr + offs, (ds * kf * rk).to(dr.dtype.element_ty), mask=mask)
    tl.store(dk + offs, (ds * rf * rk).to(dk.dtype.element_ty), mask=mask)
    dxhat = dz * w
    mean_dx = tl.sum(dxhat, axis=1)[:, None] / N
    mean_dxx = tl.sum(dxhat * xhat, axis=1)[:, None] / N
    tl.store(do + offs, (rstd * (dxhat - mean_dx - xhat * mean_dxx)).to(do.dtype.element_ty), mask=mask)
    part = i_t.to(tl.int64) * C + ch
    tl.store(dr_k_part + part, tl.sum(ds * rf * kf, axis=0), mask=m_c)
    tl.store(dln_w_part + part, tl.sum(dz * xhat, axis=0), mask=m_c)
    tl.store(dln_b_part + part, tl.sum(dz, axis=0), mask=m_c)
