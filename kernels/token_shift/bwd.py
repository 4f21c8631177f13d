"""Triton backward of shift_mix (README.md): one program per TILES x BT tokens and BC channels of one row, a tile of
BT tokens at a time. Per tile it reads the n grads once (and each shifted by one token for the path through the next
token's x_prev, from L1/L2), x and its previous token, writes dx, and sums g_i * (x_prev - x) over its tokens in
fp32 registers: one partial dmix [n, BC] per program, summed over programs afterwards."""

import triton
import triton.language as tl

from kernels.token_shift.fwd import pick, tile_and_previous


@triton.jit
def _shift_mix_bwd(x, mix, keep, first, g0, g1, g2, g3, g4, g5, dx, dmix_part, T, C, N: tl.constexpr, NP: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr, HAS_KEEP: tl.constexpr,
                   HAS_FIRST: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = i_c * BC + tl.arange(0, BC)
    m_c = c < C
    rows = tl.arange(0, NP)
    b_dmix = tl.zeros([NP, BC], dtype=tl.float32)
    for j in range(TILES):
        t = (i_t * TILES + j) * BT + tl.arange(0, BT)
        m = (t < T)[:, None] & m_c[None, :]
        b_x, b_p, offs = tile_and_previous(x, keep, first, i_b, t, c, m, T, C, HAS_KEEP, HAS_FIRST)
        d = b_p - b_x
        # x[t] is x_prev of token t + 1 unless t + 1 starts a document (or is past the row)
        m_n = m & (t + 1 < T)[:, None]
        if HAS_KEEP:
            b_kn = tl.load(keep + t + 1, mask=t + 1 < T, other=0.)
            m_n = m_n & (b_kn != 0)[:, None]
        b_dx = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(N):
            b_m = tl.load(mix + i * C + c, mask=m_c, other=0.).to(tl.float32)[None, :]
            g = pick(i, g0, g1, g2, g3, g4, g5)
            b_g = tl.load(g + offs, mask=m, other=0.).to(tl.float32)
            b_gn = tl.load(g + offs + C, mask=m_n, other=0.).to(tl.float32)
            b_dx += b_g * (1. - b_m) + b_gn * b_m
            b_dmix += tl.where(rows[:, None] == i, tl.sum(b_g * d, axis=0)[None, :], 0.)
        tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)
    i_p = i_b * tl.num_programs(0) + i_t
    tl.store(dmix_part + (i_p * N + rows[:, None]) * C + c[None, :], b_dmix, mask=(rows < N)[:, None] & m_c[None, :])
