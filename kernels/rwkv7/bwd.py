"""Triton backward of chunked RWKV-7 (derivation in README.md).

  _bwd_scan   (per sequence, head and V tile, chunks last to first): the state gradient dS (fp32), stored at each
              chunk end as dh, and dZ = T^T (scale A_rb^T do + b^ dS) for the parallel pass; dS at t=0 is dh0.
  _bwd_chunk  (per chunk and head, all at once): dv, then the pairwise-matrix gradients pushed back to r, k, a, b
              and the log decays, summed in reverse to dw.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.rwkv7.fwd import chunk_bounds, chunk_decays, decay_on, diag_of, level_split, load_rows, store_rows


@triton.jit
def _bwd_scan(r, w, a, b, do, cu, chunk_offsets, Arb, Tinv, dht, dh, dZ, dh0,
              scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr):
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
    # the [K, V] offsets of a state tile: K rows always, whatever V and BV are
    s_off = ck[:, None] * V + cv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS = tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.).to(tl.float32)
    nt = tl.cdiv(eos - bos, BT)
    for j in range(nt):
        i_t = nt - 1 - j
        tok = bos + i_t * BT + rows
        m_t = tok < eos
        b_w = load_rows(w, tok, i_h, H, K, ck, m_t, m_k)
        g, ge, gC = chunk_decays(b_w)
        r_dec = load_rows(r, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(g)
        a_dec = load_rows(a, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(ge)
        b_end = load_rows(b, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(gC[None, :] - g)
        b_do = load_rows(do, tok, i_h, H, V, cv, m_t, m_v)
        A_rb = load_rows(Arb, tok, i_h, H, BT, cb, m_t, cb < BT)
        T = load_rows(Tinv, tok, i_h, H, BT, cb, m_t, cb < BT)
        tl.store(dh + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)
        dU = scale * tl.dot(tl.trans(A_rb), b_do, input_precision=PREC) + tl.dot(b_end, dS, input_precision=PREC)
        b_dZ = tl.dot(tl.trans(T), dU, input_precision=PREC)
        store_rows(dZ, b_dZ, tok, i_h, H, V, cv, m_t, m_v)
        dS = tl.exp(gC)[:, None] * dS + scale * tl.dot(tl.trans(r_dec), b_do, input_precision=PREC) \
            + tl.dot(tl.trans(a_dec), b_dZ, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)


@triton.jit
def _bwd_chunk(r, w, k, v, a, b, do, cu, chunk_index, Ark, Aak, h, dh, U, dZ,
               dr, dw, dk, dv, da, db, scale,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr, PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu, chunk_index, i_c, BT)
    rows = tl.arange(0, BT)
    tok = t0 + rows
    m_t = tok < eos
    cb = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    m_k = ck < K
    b_r = load_rows(r, tok, i_h, H, K, ck, m_t, m_k)
    b_w = load_rows(w, tok, i_h, H, K, ck, m_t, m_k)
    b_k = load_rows(k, tok, i_h, H, K, ck, m_t, m_k)
    b_a = load_rows(a, tok, i_h, H, K, ck, m_t, m_k)
    b_b = load_rows(b, tok, i_h, H, K, ck, m_t, m_k)
    g, ge, gC = chunk_decays(b_w)
    to_end = tl.exp(gC[None, :] - g)
    k_end = b_k * to_end
    A_rk = load_rows(Ark, tok, i_h, H, BT, cb, m_t, cb < BT)
    A_ak = load_rows(Aak, tok, i_h, H, BT, cb, m_t, cb < BT)

    # Gradients of the chunk's linear pieces, summed over V tiles.
    d_rdec = tl.zeros([BT, BK], dtype=tl.float32)
    d_adec = tl.zeros([BT, BK], dtype=tl.float32)
    d_bend = tl.zeros([BT, BK], dtype=tl.float32)
    d_kend = tl.zeros([BT, BK], dtype=tl.float32)
    d_gC = tl.zeros([BK], dtype=tl.float32)
    dA_rb = tl.zeros([BT, BT], dtype=tl.float32)
    dA_rk = tl.zeros([BT, BT], dtype=tl.float32)
    dA_ab = tl.zeros([BT, BT], dtype=tl.float32)
    dA_ak = tl.zeros([BT, BT], dtype=tl.float32)
    h_base = (i_c * H + i_h).to(tl.int64) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        s_off = ck[:, None] * V + cv[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        S0 = tl.load(h + h_base + s_off, mask=m_kv, other=0.)
        dSC = tl.load(dh + h_base + s_off, mask=m_kv, other=0.)
        b_U = load_rows(U, tok, i_h, H, V, cv, m_t, m_v)
        b_dZ = load_rows(dZ, tok, i_h, H, V, cv, m_t, m_v)
        b_do = load_rows(do, tok, i_h, H, V, cv, m_t, m_v)
        b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        d_rdec += tl.dot(b_do, tl.trans(S0), input_precision=PREC)
        d_adec += tl.dot(b_dZ, tl.trans(S0), input_precision=PREC)
        d_bend += tl.dot(b_U, tl.trans(dSC), input_precision=PREC)
        d_kend += tl.dot(b_v, tl.trans(dSC), input_precision=PREC)
        d_gC += tl.sum(S0 * dSC, axis=1)
        dA_rb += tl.dot(b_do, tl.trans(b_U), input_precision=PREC)
        dA_rk += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        dA_ab += tl.dot(b_dZ, tl.trans(b_U), input_precision=PREC)
        dA_ak += tl.dot(b_dZ, tl.trans(b_v), input_precision=PREC)
        b_dv = scale * tl.dot(tl.trans(A_rk), b_do, input_precision=PREC) \
            + tl.dot(tl.trans(A_ak), b_dZ, input_precision=PREC) + tl.dot(k_end, dSC, input_precision=PREC)
        store_rows(dv, b_dv, tok, i_h, H, V, cv, m_t, m_v)
    incl = rows[:, None] >= cb[None, :]
    strict = rows[:, None] > cb[None, :]
    dA_rb = tl.where(incl, dA_rb * scale, 0.)
    dA_rk = tl.where(incl, dA_rk * scale, 0.)
    dA_ab = tl.where(strict, dA_ab, 0.)
    dA_ak = tl.where(strict, dA_ak, 0.)
    d_gC = d_gC * tl.exp(gC)

    # Pairwise matrices back to their factors, level by level as in the forward:
    # dx_t = e_row(t) * sum_s dA[t, s] y^_s and dy_s = e_col(s) * sum_t dA[t, s] x^_t, plus the diagonal.
    d_rb = diag_of(dA_rb, rows, cb)[:, None]
    d_rk = diag_of(dA_rk, rows, cb)[:, None]
    dr_p = d_rb * b_b + d_rk * b_k
    db_p = d_rb * b_r
    dk_p = d_rk * b_r
    da_p = tl.zeros([BT, BK], dtype=tl.float32)
    for lvl in tl.static_range(LEVELS):
        g_ref, second, first, pair = level_split(g, rows, cb, BT >> lvl)
        e_r = decay_on(second, g - g_ref)
        e_a = decay_on(second, ge - g_ref)
        e_col = decay_on(first, g_ref - g)
        r_hat = b_r * e_r
        a_hat = b_a * e_a
        b_hat = b_b * e_col
        k_hat = b_k * e_col
        m_rb = tl.where(pair, dA_rb, 0.)
        m_rk = tl.where(pair, dA_rk, 0.)
        m_ab = tl.where(pair, dA_ab, 0.)
        m_ak = tl.where(pair, dA_ak, 0.)
        dr_p += e_r * (tl.dot(m_rb, b_hat, input_precision=PREC) + tl.dot(m_rk, k_hat, input_precision=PREC))
        da_p += e_a * (tl.dot(m_ab, b_hat, input_precision=PREC) + tl.dot(m_ak, k_hat, input_precision=PREC))
        db_p += e_col * (tl.dot(tl.trans(m_rb), r_hat, input_precision=PREC)
                         + tl.dot(tl.trans(m_ab), a_hat, input_precision=PREC))
        dk_p += e_col * (tl.dot(tl.trans(m_rk), r_hat, input_precision=PREC)
                         + tl.dot(tl.trans(m_ak), a_hat, input_precision=PREC))

    b_dr = dr_p + scale * d_rdec * tl.exp(g)
    b_da = da_p + d_adec * tl.exp(ge)
    b_db = db_p + d_bend * to_end
    b_dk = dk_p + d_kend * to_end
    # log-decay gradients: rows read g_t (r) or ge_t (a), columns and chunk-end factors read -g_s,
    # the chunk end reads +gC (added on the last row, so the reverse cumsum hands it to every row).
    d_gC += tl.sum(b_b * d_bend * to_end + k_end * d_kend, axis=0)
    d_g = b_r * b_dr - b_b * b_db - b_k * b_dk + tl.where(rows[:, None] == BT - 1, d_gC[None, :], 0.)
    d_ge = b_a * b_da
    b_dw = tl.cumsum(d_g, axis=0, reverse=True) + tl.cumsum(d_ge, axis=0, reverse=True) - d_ge
    store_rows(dr, b_dr, tok, i_h, H, K, ck, m_t, m_k)
    store_rows(dw, b_dw, tok, i_h, H, K, ck, m_t, m_k)
    store_rows(dk, b_dk, tok, i_h, H, K, ck, m_t, m_k)
    store_rows(da, b_da, tok, i_h, H, K, ck, m_t, m_k)
    store_rows(db, b_db, tok, i_h, H, K, ck, m_t, m_k)
