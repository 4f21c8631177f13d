"""Triton backward of norm_shift_mix (README.md), two kernels.

`_shift_mix_bwd`: one program per TILES x BT tokens and BC channels of one sequence, a tile of BT tokens at a time.
Per tile it reads the n grads once (and each shifted by one token for the path through the next token's xn_prev, from
L1/L2), x and its previous token (normalized again from the forward's row stats), forms the gradient dxn of the
LayerNorm's output and writes dxn * weight; it sums g_i * (xn_prev - xn), dxn * xh and dxn over its tokens in fp32
registers (one partial [n + 2, BC] per program: dmix, dweight, dbias), and writes each token's two sums over the tile's
channels that the LayerNorm's backward needs, sum(dxn * weight) and sum(dxn * weight * xh).

`_norm_bwd`: elementwise over [BT, BC] tiles, dx = rstd * (gw - (S1 + xh * S2) / C) with S1, S2 the sums over a
token's channel tiles, written over gw."""

import triton
import triton.language as tl

from kernels.token_shift.fwd import pick, previous


@triton.jit
def _shift_mix_bwd(x, weight, bias, mix, keep, keep_stride, first, stats, g0, g1, g2, g3, g4, g5, gw, row_part,
                   param_part, B, T, C, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   TILES: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_FIRST: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = i_c * BC + tl.arange(0, BC)
    m_c = c < C
    rows = tl.arange(0, NP)
    b_w = tl.load(weight + c, mask=m_c, other=0.).to(tl.float32)[None, :]
    b_b = tl.load(bias + c, mask=m_c, other=0.).to(tl.float32)[None, :]
    b_acc = tl.zeros([NP, BC], dtype=tl.float32)
    for j in range(TILES):
        t = (i_t * TILES + j) * BT + tl.arange(0, BT)
        m = (t < T)[:, None] & m_c[None, :]
        row = i_b * T + t
        offs = i_b.to(tl.int64) * T * C + t[:, None] * C + c[None, :]
        mean = tl.load(stats + row, mask=t < T, other=0.)[:, None]
        rstd = tl.load(stats + B * T + row, mask=t < T, other=0.)[:, None]
        m_p = m & (t > 0)[:, None]
        mean_p = tl.load(stats + row - 1, mask=(t < T) & (t > 0), other=0.)[:, None]
        rstd_p = tl.load(stats + B * T + row - 1, mask=(t < T) & (t > 0), other=0.)[:, None]
        b_xh = (tl.load(x + offs, mask=m, other=0.).to(tl.float32) - mean) * rstd
        b_xn = b_xh * b_w + b_b
        b_pn = ((tl.load(x + offs - C, mask=m_p, other=0.).to(tl.float32) - mean_p) * rstd_p) * b_w + b_b
        d = previous(b_pn, t, c, i_b, keep, keep_stride, first, T, C, HAS_KEEP, HAS_FIRST) - b_xn
        # xn[t] is xn_prev of token t + 1 unless t + 1 starts a document (or is past the row)
        m_n = m & (t + 1 < T)[:, None]
        if HAS_KEEP:
            b_kn = tl.load(keep + i_b * keep_stride + t + 1, mask=t + 1 < T, other=0.)
            m_n = m_n & (b_kn != 0)[:, None]
        b_dxn = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(N):
            b_m = tl.load(mix + i * C + c, mask=m_c, other=0.).to(tl.float32)[None, :]
            g = pick(i, g0, g1, g2, g3, g4, g5)
            b_g = tl.load(g + offs, mask=m, other=0.).to(tl.float32)
            b_gn = tl.load(g + offs + C, mask=m_n, other=0.).to(tl.float32)
            b_dxn += b_g * (1. - b_m) + b_gn * b_m
            b_acc += tl.where(rows[:, None] == i, tl.sum(b_g * d, axis=0)[None, :], 0.)
        b_acc += tl.where(rows[:, None] == N, tl.sum(b_dxn * b_xh, axis=0)[None, :], 0.)
        b_acc += tl.where(rows[:, None] == N + 1, tl.sum(b_dxn, axis=0)[None, :], 0.)
        b_gw = tl.where(m, b_dxn * b_w, 0.)
        tl.store(gw + offs, b_gw.to(gw.dtype.element_ty), mask=m)
        n_c = tl.num_programs(1)
        tl.store(row_part + (row * n_c + i_c) * 2, tl.sum(b_gw, axis=1), mask=t < T)
        tl.store(row_part + (row * n_c + i_c) * 2 + 1, tl.sum(b_gw * b_xh, axis=1), mask=t < T)
    i_p = i_b * tl.num_programs(0) + i_t
    tl.store(param_part + (i_p * (N + 2) + rows[:, None]) * C + c[None, :], b_acc,
             mask=(rows < N + 2)[:, None] & m_c[None, :])


@triton.jit
def _norm_bwd(x, stats, gw, row_part, B, T, C, NC: tl.constexpr, NCP: tl.constexpr, BT: tl.constexpr,
              BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i_t * BT + tl.arange(0, BT)
    c = i_c * BC + tl.arange(0, BC)
    m = (t < T)[:, None] & (c < C)[None, :]
    row = i_b * T + t
    parts = tl.arange(0, NCP)
    m_part = (t < T)[:, None] & (parts < NC)[None, :]
    s1 = tl.sum(tl.load(row_part + (row[:, None] * NC + parts[None, :]) * 2, mask=m_part, other=0.), axis=1)
    s2 = tl.sum(tl.load(row_part + (row[:, None] * NC + parts[None, :]) * 2 + 1, mask=m_part, other=0.), axis=1)
    mean = tl.load(stats + row, mask=t < T, other=0.)
    rstd = tl.load(stats + B * T + row, mask=t < T, other=0.)
    offs = i_b.to(tl.int64) * T * C + t[:, None] * C + c[None, :]
    b_xh = (tl.load(x + offs, mask=m, other=0.).to(tl.float32) - mean[:, None]) * rstd[:, None]
    b_gw = tl.load(gw + offs, mask=m, other=0.).to(tl.float32)
    b_dx = rstd[:, None] * (b_gw - (s1[:, None] + b_xh * s2[:, None]) / C)
    tl.store(gw + offs, b_dx.to(gw.dtype.element_ty), mask=m)
