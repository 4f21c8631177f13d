"""Triton forward of norm_shift_mix (README.md): one program per BT whole rows (tokens) of one sequence normalizes
them and the token before each (a second load of the tile shifted by one token, served from L1/L2), writes the n
lerped tiles, one to each of the n outputs (separate tensors: the models' n consumers give n separate grads), and
each token's mean and rstd for the backward."""

import triton
import triton.language as tl


@triton.jit
def pick(i: tl.constexpr, p0, p1, p2, p3, p4, p5):
    """The i-th of six pointers (i known at compile time; the unused ones may be None)."""
    if i == 0:
        p = p0
    elif i == 1:
        p = p1
    elif i == 2:
        p = p2
    elif i == 3:
        p = p3
    elif i == 4:
        p = p4
    else:
        p = p5
    return p


@triton.jit
def row_vector(v, t, c, m):
    """A per-channel vector [C] loaded for every row of a [BT, BC] tile in fp32 (from L1 after the first row), in the
    tile's own layout: a [BC] vector would change layout through shared memory, with barriers."""
    return tl.load(v + (c[None, :] + 0 * t[:, None]), mask=m, other=0.).to(tl.float32)


@triton.jit
def previous(b_p, t, c, i_b, keep, keep_stride, first, T, C, HAS_KEEP: tl.constexpr, HAS_FIRST: tl.constexpr):
    """xn_prev from the normalized tile one token earlier: first (or zero) at t = 0, zero at document starts (keep of
    row i_b at keep + i_b * keep_stride: 0 when every row shares it)."""
    b_p = tl.where((t > 0)[:, None], b_p, 0.)
    if HAS_FIRST:
        b_f = tl.load(first + i_b * C + c, mask=c < C, other=0.).to(tl.float32)
        b_p = tl.where((t == 0)[:, None], b_f[None, :], b_p)
    if HAS_KEEP:
        b_k = tl.load(keep + i_b * keep_stride + t, mask=t < T, other=1.)
        b_p = tl.where((b_k != 0)[:, None], b_p, 0.)
    return b_p


@triton.jit
def layer_norm_rows(x, offs, m, C, eps, b_w, b_b):
    """Whole rows of x [BT, BC >= C] normalized in fp32 (masked lanes zero), and their mean and rstd [BT]."""
    b_x = tl.load(x + offs, mask=m, other=0.).to(tl.float32)
    mean = tl.sum(b_x, axis=1) / C
    xc = tl.where(m, b_x - mean[:, None], 0.)
    rstd = 1. / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
    return xc * rstd[:, None] * b_w + b_b, mean, rstd


@triton.jit
def _norm_shift_mix_fwd(x, weight, bias, mix, keep, keep_stride, first, stats, o0, o1, o2, o3, o4, o5, B, T, C, eps,
                        N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_KEEP: tl.constexpr,
                        HAS_FIRST: tl.constexpr):
    i_t, i_b = tl.program_id(0), tl.program_id(1)
    t = i_t * BT + tl.arange(0, BT)
    c = tl.arange(0, BC)
    m = (t < T)[:, None] & (c < C)[None, :]
    offs = i_b.to(tl.int64) * T * C + t[:, None] * C + c[None, :]
    b_w, b_b = row_vector(weight, t, c, m), row_vector(bias, t, c, m)
    b_xn, mean, rstd = layer_norm_rows(x, offs, m, C, eps, b_w, b_b)
    b_pn, _, _ = layer_norm_rows(x, offs - C, m & (t > 0)[:, None], C, eps, b_w, b_b)
    d = previous(b_pn, t, c, i_b, keep, keep_stride, first, T, C, HAS_KEEP, HAS_FIRST) - b_xn
    for i in tl.static_range(N):
        b_m = row_vector(mix + i * C, t, c, m)
        tl.store(pick(i, o0, o1, o2, o3, o4, o5) + offs, (b_xn + d * b_m).to(o0.dtype.element_ty), mask=m)
    row = i_b * T + t
    tl.store(stats + row, mean, mask=t < T)
    tl.store(stats + B * T + row, rstd, mask=t < T)
