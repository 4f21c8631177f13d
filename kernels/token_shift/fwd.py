"""Triton forward of shift_mix (README.md): one program per [BT tokens, BC channels] tile of one row reads the tile
of x and the token before it (a second load of the tile shifted by one token, served from L1/L2) and writes the n
lerped tiles, one to each of the n outputs (separate tensors: the models' n consumers give n separate grads)."""

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
def tile_and_previous(x, keep, first, i_b, t, c, m, T, C, HAS_KEEP: tl.constexpr, HAS_FIRST: tl.constexpr):
    """The tile of x [BT, BC] and its x_prev in fp32 (first at t = 0, zero at document starts), and the offsets of
    the tile in a [B, T, C] tensor."""
    offs = i_b.to(tl.int64) * T * C + t[:, None] * C + c[None, :]
    b_x = tl.load(x + offs, mask=m, other=0.).to(tl.float32)
    b_p = tl.load(x + offs - C, mask=m & (t[:, None] > 0), other=0.).to(tl.float32)
    if HAS_FIRST:
        b_f = tl.load(first + i_b * C + c, mask=c < C, other=0.).to(tl.float32)
        b_p = tl.where(t[:, None] == 0, b_f[None, :], b_p)
    if HAS_KEEP:
        b_k = tl.load(keep + t, mask=t < T, other=1.)
        b_p = tl.where((b_k != 0)[:, None], b_p, 0.)
    return b_x, b_p, offs


@triton.jit
def _shift_mix_fwd(x, mix, keep, first, o0, o1, o2, o3, o4, o5, T, C, N: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_FIRST: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    m = (t < T)[:, None] & (c < C)[None, :]
    b_x, b_p, offs = tile_and_previous(x, keep, first, i_b, t, c, m, T, C, HAS_KEEP, HAS_FIRST)
    d = b_p - b_x
    for i in tl.static_range(N):
        # loaded for every row of the tile (from L1 after the first), in the tile's own layout: a [BC] vector would
        # change layout through shared memory, with barriers
        b_m = tl.load(mix + i * C + (c[None, :] + 0 * t[:, None]), mask=m, other=0.).to(tl.float32)
        tl.store(pick(i, o0, o1, o2, o3, o4, o5) + offs, (b_x + d * b_m).to(o0.dtype.element_ty), mask=m)
