"""Triton backward of the GSA output norm (README.md): each program walks its rows a tile at a time, recomputing
u = silu(o) and 1 / rms from o, writes do, and keeps its rows' sum for dw (an fp32 partial, one row per program,
summed by the launch code)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.silu_rms_norm.fwd import norm_terms
from kernels.tl_utils import head_tile


@triton.jit
def _silu_norm_bwd(o, w, dy, do, dw_part, M, eps, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   TILES: tl.constexpr):
    i_p = tl.program_id(0)
    ch = tl.arange(0, BC)
    wf = tl.load(w + ch, mask=ch < C, other=0.).to(tl.float32)[None, :]
    acc = tl.zeros([BC], dtype=tl.float32)
    # Each tile's o and dy are loaded one tile ahead: a tile's work waits on its two row sums, and the next loads
    # then run under it instead of after it
    offs_next, mask_next, _, _ = head_tile(i_p * TILES, 0, M, C, C, BT, BC)
    o_next = tl.load(o + offs_next, mask=mask_next, other=0.)
    dy_next = tl.load(dy + offs_next, mask=mask_next, other=0.)
    for j in range(TILES):
        offs, mask, o_j, dy_j = offs_next, mask_next, o_next, dy_next
        offs_next, mask_next, _, _ = head_tile(i_p * TILES + j + 1, 0, M, C, C, BT, BC)
        mask_next = mask_next & (j + 1 < TILES)
        o_next = tl.load(o + offs_next, mask=mask_next, other=0.)
        dy_next = tl.load(dy + offs_next, mask=mask_next, other=0.)
        of, u, rstd = norm_terms(o_j, eps, C)
        uhat = u * rstd
        gy = dy_j.to(tl.float32)
        g = gy * wf
        du = rstd * (g - uhat * (tl.sum(g * uhat, axis=1) / C)[:, None])
        sig = tl.sigmoid(of)
        tl.store(do + offs, (du * sig * (1. + of * (1. - sig))).to(do.dtype.element_ty), mask=mask)
        acc += tl.sum(gy * uhat, axis=0)
    tl.store(dw_part + i_p.to(tl.int64) * C + ch, acc, mask=ch < C)
