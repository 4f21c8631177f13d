"""Triton forward of chunked RWKV-7 (math and notation in README.md).

Two launches:
  _fwd_prep  (one program per chunk and head, all chunks at once): cumulative log decays, the pairwise chunk
             matrices (by halving, one product per level) A_rb, A_rk, A_ak, T = (I - A_ab)^{-1}, and the state-independent W = T a~, Uv = T A_ak v;
  _fwd_scan  (one program per sequence, head and V tile, chunks in order): U = W S + Uv, the output, the next state.
Every exp() argument is <= 0 by construction: masked entries are replaced by 0 before the exp and the result by 0
after.
Inputs are packed sequences [1, T_total, H, *]; states and everything the backward reuses are fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

# bwd.py imports these from here too
from kernels.rwkv7.levels import level_split, level_sums
from kernels.tl_utils import chunk_program, decay_on, diag_of, load_cols, load_rows, mm, spare_chunk, store_cols, store_rows  # noqa: F401


@triton.jit
def chunk_decays(w):
    """Inclusive g, exclusive ge (both <= 0, non-increasing down the rows) and the chunk total gC [BK]."""
    g = tl.cumsum(w, axis=0)
    return g, g - w, tl.sum(w, axis=0)


@triton.jit
def _fwd_prep(r, w, k, v, a, b, cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, LEVELS: tl.constexpr, PREC: tl.constexpr, SUMS: tl.constexpr):
    if spare_chunk(cu, chunk_index, BT):
        return
    i_c, i_h, rows, tok, m_t, ck, m_k = chunk_program(cu, chunk_index, BT, BK, K)
    cb = rows   # token offsets along the columns of [BT, BT] tiles
    # Padded rows load as zeros: w = 0 keeps g flat, zero r/k/a/b add nothing.
    b_r = load_rows(r, tok, i_h, H, K, ck, m_t, m_k)
    b_w = load_rows(w, tok, i_h, H, K, ck, m_t, m_k)
    b_k = load_rows(k, tok, i_h, H, K, ck, m_t, m_k)
    b_a = load_rows(a, tok, i_h, H, K, ck, m_t, m_k)
    b_b = load_rows(b, tok, i_h, H, K, ck, m_t, m_k)
    g, ge, gC = chunk_decays(b_w)

    # Pairwise matrices A_xy[t, s] = sum_k x_tk y_sk exp(gx_tk - g_sk) by halving: at each level, a pair (t, s)
    # straddling the middle of its block factors through that middle row m as exp(gx_t - g_m) * exp(g_m - g_s),
    # both <= 0, so each level is one matrix product; the diagonal (t = s, decay 1) is added apart.
    eye = rows[:, None] == cb[None, :]
    A_rb = tl.where(eye, tl.sum(b_r * b_b, axis=1)[:, None], 0.)
    A_rk = tl.where(eye, tl.sum(b_r * b_k, axis=1)[:, None], 0.)
    A_ab = tl.zeros([BT, BT], dtype=tl.float32)
    A_ak = tl.zeros([BT, BT], dtype=tl.float32)
    for lvl in tl.static_range(LEVELS):
        if SUMS:
            to_row, to_row_ex, from_col, second, first, pair = level_sums(b_w, rows, cb, BT, BK, BT >> lvl)
            r_hat = b_r * decay_on(second, to_row)
            a_hat = b_a * decay_on(second, to_row_ex)
            e_col = decay_on(first, from_col)
        else:
            g_ref, second, first, pair = level_split(g, rows, cb, BT >> lvl)
            r_hat = b_r * decay_on(second, g - g_ref)
            a_hat = b_a * decay_on(second, ge - g_ref)
            e_col = decay_on(first, g_ref - g)
        b_hat = tl.trans(b_b * e_col)
        k_hat = tl.trans(b_k * e_col)
        A_rb += tl.where(pair, mm(r_hat, b_hat, PREC), 0.)
        A_rk += tl.where(pair, mm(r_hat, k_hat, PREC), 0.)
        A_ab += tl.where(pair, mm(a_hat, b_hat, PREC), 0.)
        A_ak += tl.where(pair, mm(a_hat, k_hat, PREC), 0.)

    # T = (I - A_ab)^{-1} = (I + A)(I + A^2)(I + A^4)... (A is nilpotent: A^BT = 0), exact fp32 products.
    T = tl.where(eye, 1., 0.) + A_ab
    P = A_ab
    for _ in tl.static_range(LEVELS - 1):
        P = tl.dot(P, P, input_precision="ieee")
        T = T + tl.dot(T, P, input_precision="ieee")

    store_rows(Arb, A_rb, tok, i_h, H, BT, cb, m_t, cb < BT)
    store_rows(Ark, A_rk, tok, i_h, H, BT, cb, m_t, cb < BT)
    store_rows(Aak, A_ak, tok, i_h, H, BT, cb, m_t, cb < BT)
    store_rows(Tinv, T, tok, i_h, H, BT, cb, m_t, cb < BT)
    b_W = mm(T, b_a * tl.exp(ge), PREC)
    store_rows(W, b_W, tok, i_h, H, K, ck, m_t, m_k)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        b_Uv = mm(T, mm(A_ak, b_v, PREC), PREC)
        store_rows(Uv, b_Uv, tok, i_h, H, V, cv, m_t, m_v)


@triton.jit
def _fwd_scan(r, w, k, v, b, cu, chunk_offsets, W, Uv, Arb, Ark, h0, o, h, U, ht,
              scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    # Token tiles are feature-major ([BK or BV, BT], suffix T): every product has M = BK or BV rows.
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n)
    eos = tl.load(cu + i_n + 1)
    c0 = tl.load(chunk_offsets + i_n)
    rows = tl.arange(0, BT)
    cb = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    # state tile S [BK, BV], fp32 throughout
    s_off = ck[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S = tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.).to(tl.float32)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        tok = bos + i_t * BT + rows
        m_t = tok < eos
        wT = load_cols(w, tok, i_h, H, K, ck, m_t, m_k)
        gT = tl.cumsum(wT, axis=1)
        gC = tl.sum(wT, axis=1)
        to_endT = tl.exp(gC[:, None] - gT)
        r_decT = load_cols(r, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(gT)
        b_endT = load_cols(b, tok, i_h, H, K, ck, m_t, m_k) * to_endT
        k_endT = load_cols(k, tok, i_h, H, K, ck, m_t, m_k) * to_endT
        WT = load_cols(W, tok, i_h, H, K, ck, m_t, m_k)
        UvT = load_cols(Uv, tok, i_h, H, V, cv, m_t, m_v)
        vT = load_cols(v, tok, i_h, H, V, cv, m_t, m_v)
        A_rb = load_rows(Arb, tok, i_h, H, BT, cb, m_t, cb < BT)
        A_rk = load_rows(Ark, tok, i_h, H, BT, cb, m_t, cb < BT)
        tl.store(h + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
        St = tl.trans(S)
        UT = mm(St, WT, PREC) + UvT
        store_cols(U, UT, tok, i_h, H, V, cv, m_t, m_v)
        oT = mm(St, r_decT, PREC) + mm(UT, tl.trans(A_rb), PREC) \
            + mm(vT, tl.trans(A_rk), PREC)
        store_cols(o, oT * scale, tok, i_h, H, V, cv, m_t, m_v)
        S = tl.exp(gC)[:, None] * S + mm(b_endT, tl.trans(UT), PREC) \
            + mm(k_endT, tl.trans(vT), PREC)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
