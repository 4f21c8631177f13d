"""Triton backward of chunked RWKV-6 (derivation in README.md). The state gradient at every chunk's end (dh) and at
the start (dh0) comes first from scan._scan (REVERSE).

  _bwd_chunk  (per chunk and head, all at once): dA pushed back through the halving levels to r and k, the
              log-decay gradients summed in reverse to dw, the chunk's share of du (summed over chunks by the launch
              code), and dv from the forward's A.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.rwkv6.fwd import chunk_decays, chunk_start, level_factors, rkw_tiles
from kernels.tl_utils import diag_of, exp, load_rows, load_rows_raw, load_state, mm, run_sums, store_rows


@triton.jit
def _bwd_chunk(r, k, v, w, u, do, h, dh, a, cu, chunk_index, dr, dk, dv, dw, du, scale,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, LEVELS: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr):
    """The program waits on its loads (at 255 registers one block of 8 warps fits an SM): every global load of the
    chunk, the first V tile's too, is issued at once in its own dtype and converted where first used, and no branch
    precedes them (a spare chunk of a packed batch runs with all-false masks instead of returning early: it reads
    and stores nothing)."""
    # m_s: the state's rows and du's features (none for a spare chunk)
    i_c, i_h, rows, tok, m_t, ck, m_k, m_s, cv0, h_base, x_r, x_k, x_w, x_u = chunk_start(
        r, k, w, u, cu, chunk_index, H, K, V, BT, BK, BV)
    x_do = load_rows_raw(do, tok, i_h, H, V, cv0, m_t, cv0 < V)
    x_v = load_rows_raw(v, tok, i_h, H, V, cv0, m_t, cv0 < V)
    S0_first = load_state(h, h_base, ck, cv0, V, m_s, cv0 < V)
    dSC_first = load_state(dh, h_base, ck, cv0, V, m_s, cv0 < V)
    b_r, b_k, b_w = rkw_tiles(x_r, x_k, x_w, m_t, m_k)
    b_u = x_u.to(tl.float32)
    e_before, e_after = chunk_decays(b_w, rows, BT)
    k_end = b_k * e_after

    d_rS = tl.zeros([BT, BK], dtype=tl.float32)    # do h^T: the output's read of the entering state
    d_kS = tl.zeros([BT, BK], dtype=tl.float32)    # v dh^T: the writes' reach to the chunk's end
    dA = tl.zeros([BT, BT], dtype=tl.float32)      # do v^T (the output's scale included, as in do below)
    d_gC = tl.zeros([BK], dtype=tl.float32)
    for i_v in tl.static_range((V + BV - 1) // BV):
        cv = i_v * BV + cv0
        m_v = cv < V
        if i_v == 0:   # (the no-op selects as above: for the transposes of dSC, S0 and v)
            S0 = tl.where(m_s[:, None], S0_first, 0.)
            dSC = tl.where(m_s[:, None], dSC_first, 0.)
            b_do = x_do.to(tl.float32) * scale
            b_v = tl.where(m_t[:, None], x_v.to(tl.float32), 0.)
        else:
            S0 = load_state(h, h_base, ck, cv, V, m_s, m_v)
            dSC = load_state(dh, h_base, ck, cv, V, m_s, m_v)
            b_do = load_rows(do, tok, i_h, H, V, cv, m_t, m_v) * scale
            b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        d_rS += mm(b_do, tl.trans(S0), BF16, PREC)
        d_kS += mm(b_v, tl.trans(dSC), BF16, PREC)
        dA += mm(b_do, tl.trans(b_v), BF16, PREC)
        d_gC += tl.sum(S0 * dSC, axis=1)

    d_r = e_before * d_rS
    d_k = e_after * d_kS
    # the chunk-end decay: S_C = e^{g_C} S_0 + sum_s (k_s e^{g_C - g_s})^T v_s
    d_gC = d_gC * exp(tl.sum(b_w, axis=0)) + tl.sum(b_k * d_k, axis=0)
    # dA back to the factors of A level by level, as the forward formed them: dr_t = e_row(t) sum_s dA[t, s] k^_s
    # and dk_s = e_col(s) sum_t dA[t, s] r^_t
    for lvl in tl.static_range(LEVELS):
        e_row, e_col, pair = level_factors(b_w, rows, BT >> lvl)
        m_pair = tl.where(pair, dA, 0.)
        d_r += e_row * mm(m_pair, b_k * e_col, BF16, PREC)
        d_k += e_col * mm(tl.trans(m_pair), b_r * e_row, BF16, PREC)
    # log-decay gradients: every r_t reads +ge_t, every k_s -g_s, the chunk end +g_C (every step of the chunk):
    # dw_j = sum_{t >= j} (d_ge - k dk)_t - d_ge_j + d_gC
    d_ge = b_r * d_r
    x = d_ge - b_k * d_k
    dw_ = run_sums(x, rows, BT, False) + x - d_ge + d_gC[None, :]
    # the bonus: A[t, t] = r_t . (u * k_t)
    dD = diag_of(dA, rows, rows)[:, None]
    d_r += dD * b_u[None, :] * b_k
    d_k += dD * b_u[None, :] * b_r
    tl.store(du + (i_c * H + i_h).to(tl.int64) * K + ck, tl.sum(dD * b_r * b_k, axis=0), mask=m_s)
    store_rows(dr, d_r, tok, i_h, H, K, ck, m_t, m_k)
    store_rows(dk, d_k, tok, i_h, H, K, ck, m_t, m_k)
    store_rows(dw, dw_, tok, i_h, H, K, ck, m_t, m_k)
    # dv = A^T do + (k e^{g_C - g}) dS_C, per V tile (do and dS_C read again: cheaper than holding every tile); A
    # loaded after them, and dS_C through a no-op select, so that no layout conversion comes between the three loads
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + cv0
        m_v = cv < V
        dSC = load_state(dh, h_base, ck, cv, V, m_s, m_v)
        b_do = load_rows(do, tok, i_h, H, V, cv, m_t, m_v) * scale
        A = tl.load(a + (i_c * H + i_h).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :])
        b_dv = mm(tl.trans(A), b_do, BF16, PREC) + mm(k_end, tl.where(m_s[:, None], dSC, 0.), BF16, PREC)
        store_rows(dv, b_dv, tok, i_h, H, V, cv, m_t, m_v)
