"""Triton forward of the GSA output norm (README.md): one program per tile of rows, o read once, y written once."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import head_tile


@triton.jit
def norm_terms(o, eps, C: tl.constexpr):
    """From a loaded tile of o (masked lanes 0), fp32 [BT, BC]: o, u = silu(o), and 1 / rms(u) [BT, 1] over the
    row's C channels."""
    of = o.to(tl.float32)
    u = of * tl.sigmoid(of)
    rstd = 1 / tl.sqrt(tl.sum(u * u, axis=1) / C + eps)[:, None]
    return of, u, rstd


@triton.jit
def _silu_norm_fwd(o, w, y, M, eps, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    offs, mask, ch, m_c = head_tile(tl.program_id(0), 0, M, C, C, BT, BC)   # a row is one "head" of C channels
    _, u, rstd = norm_terms(tl.load(o + offs, mask=mask, other=0.), eps, C)
    wf = tl.load(w + ch, mask=m_c, other=0.).to(tl.float32)[None, :]
    tl.store(y + offs, (u * rstd * wf).to(y.dtype.element_ty), mask=mask)
