"""Triton forward of chunked RWKV-6 (math and notation in README.md): the output kernel, and the chunk decays and
halving-level factors it shares with the backward. The states it reads (h, the state entering each chunk) come from
scan._scan.

  _fwd_out   (one program per chunk and head, all chunks at once): the chunk's pairwise matrix A (by halving, one
             product per level, the bonus on its diagonal), kept for the backward, and the output
             o = scale (r e^{ge} h + A v).
Every exp() argument is <= 0 by construction: a decay is a sum of log decays over a span of steps (tl_utils.run_sums,
for every row of a tile, so no entry of it can be positive), never a difference of cumulative sums, and clamped to
<= 0 against rounding.
Inputs are packed sequences [1, T_total, H, *]; w and the states are fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import (chunk_bounds, exp, load_rows, load_rows_raw, load_state, mm, pair_mask, run_sums,
                               store_rows)


@triton.jit
def level_factors(w, rows, BS: tl.constexpr):
    """One halving level of a token-major [BT, BK] chunk of log decays (tl_utils' halving levels, blocks of BS rows):
    for a row t of a second half e^{ge_t - g_m} (the steps strictly between the block's middle row m and t), for a
    row s of a first half e^{g_m - g_s} (the steps after s up to m), and the pair mask [BT, BT]. Each exponent is a
    run sum of log decays, clamped to <= 0 against rounding; at BS = 2 both spans are empty."""
    if BS == 2:
        ones = tl.full(w.shape, 1., tl.float32)
        return ones, ones, pair_mask(rows, rows, BS)
    e_row = exp(tl.minimum(run_sums(w, rows, BS // 2, True), 0.))
    e_col = exp(tl.minimum(run_sums(w, rows, BS // 2, False), 0.))
    return e_row, e_col, pair_mask(rows, rows, BS)


@triton.jit
def chunk_decays(w, rows, BT: tl.constexpr):
    """Of a token-major [BT, BK] chunk of log decays: exp(ge_t) (the steps before t) and exp(g_C - g_t) (the steps
    after t), each a sum of log decays over the span itself, clamped to <= 0 against rounding."""
    before = run_sums(w, rows, BT, True)
    after = run_sums(w, rows, BT, False)
    return exp(tl.minimum(before, 0.)), exp(tl.minimum(after, 0.))


@triton.jit
def pairwise(b_r, b_k, b_w, b_u, rows, LEVELS: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr):
    """A [BT, BT]: A[t, s] = sum_k r_tk k_sk exp(ge_tk - g_sk) for s < t and r_t . (u * k_t) on the diagonal. By
    halving: a pair (t, s) straddling the middle m of its block factors as exp(ge_t - g_m) exp(g_m - g_s), both
    sums over at most BS/2 steps, so each level is one product."""
    BT: tl.constexpr = b_r.shape[0]
    A = tl.where(rows[:, None] == rows[None, :], tl.sum(b_r * b_u[None, :] * b_k, axis=1)[:, None], 0.)
    for lvl in tl.static_range(LEVELS):
        e_row, e_col, pair = level_factors(b_w, rows, BT >> lvl)
        A += tl.where(pair, mm(b_r * e_row, tl.trans(b_k * e_col), BF16, PREC), 0.)
    return A


@triton.jit
def chunk_start(r, k, w, u, cu, chunk_index, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """The per-chunk kernels' prologue, up to their first loads (r, k, w in their own dtype, and u): the program's
    chunk and head, rows, tokens and their mask, features and their mask, the state's rows (none for a spare chunk
    of a packed batch), the first V tile's columns and the chunk's state offset."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu, chunk_index, i_c, BT)
    rows = tl.arange(0, BT)
    tok = t0 + rows
    m_t = tok < eos
    ck = tl.arange(0, BK)
    m_k = ck < K
    m_s = ck < tl.where(t0 < eos, K, 0)
    cv0 = tl.arange(0, BV)
    h_base = (i_c * H + i_h).to(tl.int64) * K * V
    x_r = load_rows_raw(r, tok, i_h, H, K, ck, m_t, m_k)
    x_k = load_rows_raw(k, tok, i_h, H, K, ck, m_t, m_k)
    x_w = load_rows_raw(w, tok, i_h, H, K, ck, m_t, m_k)
    x_u = tl.load(u + i_h * K + ck, mask=m_k, other=0.)
    return i_c, i_h, rows, tok, m_t, ck, m_k, m_s, cv0, h_base, x_r, x_k, x_w, x_u


@triton.jit
def rkw_tiles(x_r, x_k, x_w, m_t, m_k):
    """r, k and w of chunk_start as fp32 tiles, once every load is issued. k and w pass through a select that changes
    nothing (masked loads give 0): Triton moves a tile's layout conversions up to its load when only elementwise ops
    lie between, each a shared-memory round trip with a barrier that would hold back the loads after it."""
    m_tk = m_t[:, None] & m_k[None, :]
    return x_r.to(tl.float32), tl.where(m_tk, x_k.to(tl.float32), 0.), tl.where(m_tk, x_w, 0.)


@triton.jit
def _fwd_out(r, k, v, w, u, h, o, a, cu, chunk_index, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr, BF16: tl.constexpr,
             PREC: tl.constexpr):
    """The program waits on its loads (at its register count few blocks fit an SM): every global load of the chunk,
    the first V tile's state and v too, is issued at once in its own dtype and converted where first used, and no
    branch precedes them (a spare chunk of a packed batch runs with all-false masks instead of returning early: it
    reads nothing and stores only zeros, in its own slot of a, which no result depends on)."""
    i_c, i_h, rows, tok, m_t, ck, m_k, m_s, cv0, h_base, x_r, x_k, x_w, x_u = chunk_start(
        r, k, w, u, cu, chunk_index, H, K, V, BT, BK, BV)
    x_v = load_rows_raw(v, tok, i_h, H, V, cv0, m_t, cv0 < V)
    S0_first = load_state(h, h_base, ck, cv0, V, m_s, cv0 < V)
    b_r, b_k, b_w = rkw_tiles(x_r, x_k, x_w, m_t, m_k)
    e_before, _ = chunk_decays(b_w, rows, BT)
    r_dec = b_r * e_before
    o_first = mm(r_dec, S0_first, BF16, PREC)
    A = pairwise(b_r, b_k, b_w, x_u.to(tl.float32), rows, LEVELS, BF16, PREC)
    # kept for the backward's dv = A^T do (one fp32 [BT, BT] per chunk and head: cheaper than forming it again)
    tl.store(a + (i_c * H + i_h).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :], A)
    for i_v in tl.static_range((V + BV - 1) // BV):
        cv = i_v * BV + cv0
        m_v = cv < V
        if i_v == 0:
            b_o = o_first + mm(A, x_v.to(tl.float32), BF16, PREC)
        else:
            S0 = load_state(h, h_base, ck, cv, V, m_s, m_v)
            b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
            b_o = mm(r_dec, S0, BF16, PREC) + mm(A, b_v, BF16, PREC)
        store_rows(o, b_o * scale, tok, i_h, H, V, cv, m_t, m_v)
