"""Triton backward of chunked RWKV-7 (derivation in README.md).

  _bwd_scan   (per sequence, head and V tile, chunks last to first): the state gradient dS (fp32), stored at each
              chunk end as dh, and dZ = T^T (scale A_rb^T do + b^ dS) for the parallel pass; dS at t=0 is dh0.
  _bwd_chunk  (per chunk and head, all at once): dv, then the pairwise-matrix gradients pushed back to r, k, a, b
              and the log decays, summed in reverse to dw.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.rwkv7.fwd import chunk_program, decay_on, diag_of, load_rows, scan_span, store_rows
from kernels.rwkv7.levels import level_split_t, level_sums_t
from kernels.tl_utils import load_cols, mm, spare_chunk, store_cols


@triton.jit
def _bwd_scan(r, w, a, b, do, cu, chunk_offsets, block_index, Arb, Tinv, dht, dh, dZ, dh0, dSb,
              scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, L: tl.constexpr, BLOCKED: tl.constexpr, OUT: tl.constexpr,
              HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr):
    """The state-gradient recursion over chunks, last to first, in one of three roles (as the forward's):
      sequence   (BLOCKED=False, OUT): from dht through all chunks, storing dS at each chunk's end as dh and dZ;
                 dS at t = 0 to dh0.
      block fill (BLOCKED, OUT): the same over one block of L chunks, from dS at its end, dSb[block].
      block map  (BLOCKED, not OUT): from zero over the block, storing its dS at the block's start to dSb[block]
                 (R in dS_start = M^T dS_end + R; M is the forward's block map)."""
    # Token tiles are feature-major ([BK or BV, BT], suffix T): every product has M = BK or BV rows.
    i_n, bos, eos, first, count, c0 = scan_span(cu, chunk_offsets, block_index, BT, L, BLOCKED)
    if BLOCKED:
        if count <= 0:   # a spare block of a packed batch
            return
    i_h, i_v = tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BT)
    cb = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    # the [K, V] offsets of a state tile: K rows always, whatever V and BV are
    s_off = ck[:, None] * V + cv[None, :]
    block_base = (tl.program_id(0) * H + i_h).to(tl.int64) * K * V
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if BLOCKED:
        if OUT:
            dS = tl.load(dSb + block_base + s_off, mask=m_kv, other=0.)
    elif HAS_DHT:
        dS = tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.).to(tl.float32)
    for j in range(count):
        i_t = first + count - 1 - j
        tok = bos + i_t * BT + rows
        m_t = tok < eos
        wT = load_cols(w, tok, i_h, H, K, ck, m_t, m_k)
        gT = tl.cumsum(wT, axis=1)
        gC = tl.sum(wT, axis=1)
        r_decT = load_cols(r, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(gT)
        a_decT = load_cols(a, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(gT - wT)
        b_endT = load_cols(b, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(gC[:, None] - gT)
        doT = load_cols(do, tok, i_h, H, V, cv, m_t, m_v)
        A_rb = load_rows(Arb, tok, i_h, H, BT, cb, m_t, cb < BT)
        T = load_rows(Tinv, tok, i_h, H, BT, cb, m_t, cb < BT)
        if OUT:
            tl.store(dh + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)
        dUT = scale * mm(doT, A_rb, PREC) + mm(tl.trans(dS), b_endT, PREC)
        dZT = mm(dUT, T, PREC)
        if OUT:
            store_cols(dZ, dZT, tok, i_h, H, V, cv, m_t, m_v)
        dS = tl.exp(gC)[:, None] * dS + scale * mm(r_decT, tl.trans(doT), PREC) \
            + mm(a_decT, tl.trans(dZT), PREC)
    if BLOCKED:
        if not OUT:
            tl.store(dSb + block_base + s_off, dS, mask=m_kv)
    elif STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)


@triton.jit
def v_tile_grads(v, do, h, dh, U, dZ, dv, tok, i_c, i_h, m_t, ck, m_k, k_endT, A_rk, A_ak, scale,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr):
    """The per-chunk backward's loop over V tiles: stores dv and returns the gradients of the chunk's linear pieces
    (feature-major [BK, BT]: r^, a^, b^, k^), of the chunk-end decay (raw) and of the pairwise matrices."""
    d_rdecT = tl.zeros([BK, BT], dtype=tl.float32)
    d_adecT = tl.zeros([BK, BT], dtype=tl.float32)
    d_bendT = tl.zeros([BK, BT], dtype=tl.float32)
    d_kendT = tl.zeros([BK, BT], dtype=tl.float32)
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
        UT = load_cols(U, tok, i_h, H, V, cv, m_t, m_v)
        dZT = load_cols(dZ, tok, i_h, H, V, cv, m_t, m_v)
        doT = load_cols(do, tok, i_h, H, V, cv, m_t, m_v)
        vT = load_cols(v, tok, i_h, H, V, cv, m_t, m_v)
        d_rdecT += mm(S0, doT, PREC)
        d_adecT += mm(S0, dZT, PREC)
        d_bendT += mm(dSC, UT, PREC)
        d_kendT += mm(dSC, vT, PREC)
        d_gC += tl.sum(S0 * dSC, axis=1)
        dA_rb += mm(tl.trans(doT), UT, PREC)
        dA_rk += mm(tl.trans(doT), vT, PREC)
        dA_ab += mm(tl.trans(dZT), UT, PREC)
        dA_ak += mm(tl.trans(dZT), vT, PREC)
        dvT = scale * mm(doT, A_rk, PREC) + mm(dZT, A_ak, PREC) \
            + mm(tl.trans(dSC), k_endT, PREC)
        store_cols(dv, dvT, tok, i_h, H, V, cv, m_t, m_v)
    return d_rdecT, d_adecT, d_bendT, d_kendT, d_gC, dA_rb, dA_rk, dA_ab, dA_ak


@triton.jit
def _bwd_chunk(r, w, k, v, a, b, do, cu, chunk_index, Ark, Aak, h, dh, U, dZ,
               dr, dw, dk, dv, da, db, scale,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr, PREC: tl.constexpr,
               SUMS: tl.constexpr):
    # Token tiles are held feature-major ([BK or BV, BT], suffix T), so the large products have M = 64.
    if spare_chunk(cu, chunk_index, BT):
        return
    i_c, i_h, rows, tok, m_t, ck, m_k = chunk_program(cu, chunk_index, BT, BK, K)
    cb = rows   # token offsets along the columns of [BT, BT] tiles
    # Only k^ = k e^{gC - g} is needed inside the V loop; the other token tiles are loaded after it, so that they
    # do not hold registers through the loop's products.
    gC = tl.sum(load_cols(w, tok, i_h, H, K, ck, m_t, m_k), axis=1)
    k_endT = load_cols(k, tok, i_h, H, K, ck, m_t, m_k) \
        * tl.exp(gC[:, None] - tl.cumsum(load_cols(w, tok, i_h, H, K, ck, m_t, m_k), axis=1))
    A_rk = load_rows(Ark, tok, i_h, H, BT, cb, m_t, cb < BT)
    A_ak = load_rows(Aak, tok, i_h, H, BT, cb, m_t, cb < BT)

    d_rdecT, d_adecT, d_bendT, d_kendT, d_gC, dA_rb, dA_rk, dA_ab, dA_ak = v_tile_grads(
        v, do, h, dh, U, dZ, dv, tok, i_c, i_h, m_t, ck, m_k, k_endT, A_rk, A_ak, scale, H, K, V, BT, BK, BV, PREC)
    incl = rows[:, None] >= cb[None, :]
    strict = rows[:, None] > cb[None, :]
    dA_rb = tl.where(incl, dA_rb * scale, 0.)
    dA_rk = tl.where(incl, dA_rk * scale, 0.)
    dA_ab = tl.where(strict, dA_ab, 0.)
    dA_ak = tl.where(strict, dA_ak, 0.)
    rT = load_cols(r, tok, i_h, H, K, ck, m_t, m_k)
    wT = load_cols(w, tok, i_h, H, K, ck, m_t, m_k)
    kT = load_cols(k, tok, i_h, H, K, ck, m_t, m_k)
    aT = load_cols(a, tok, i_h, H, K, ck, m_t, m_k)
    bT = load_cols(b, tok, i_h, H, K, ck, m_t, m_k)
    gT = tl.cumsum(wT, axis=1)
    geT = gT - wT
    to_endT = tl.exp(gC[:, None] - gT)

    # Everything but the pairwise terms first, so these accumulators die before the level loop.
    # The chunk end reads +gC: its gradient goes on the last row (the reverse cumsum hands it to every row).
    d_bendT *= to_endT
    d_kendT *= to_endT
    d_gC = d_gC * tl.exp(gC) + tl.sum(bT * d_bendT + kT * d_kendT, axis=1)
    d_rb = diag_of(dA_rb, rows, cb)[None, :]
    d_rk = diag_of(dA_rk, rows, cb)[None, :]
    drT = d_rb * bT + d_rk * kT + scale * d_rdecT * tl.exp(gT)
    daT = d_adecT * tl.exp(geT)
    dbT = d_rb * rT + d_bendT
    dkT = d_rk * rT + d_kendT

    # Pairwise matrices back to their factors, level by level as in the forward:
    # dx_t = e_row(t) * sum_s dA[t, s] y^_s and dy_s = e_col(s) * sum_t dA[t, s] x^_t.
    for lvl in tl.static_range(LEVELS):
        if SUMS:
            to_row, to_row_ex, from_col, second, first, pair = level_sums_t(wT, rows, cb, BT, BK, BT >> lvl)
            e_r = decay_on(second, to_row)
            e_a = decay_on(second, to_row_ex)
            e_col = decay_on(first, from_col)
        else:
            g_refT, second, first, pair = level_split_t(gT, rows, cb, BT >> lvl)
            e_r = decay_on(second, gT - g_refT)
            e_a = decay_on(second, geT - g_refT)
            e_col = decay_on(first, g_refT - gT)
        r_hat = rT * e_r
        a_hat = aT * e_a
        b_hat = bT * e_col
        k_hat = kT * e_col
        m_rb = tl.where(pair, dA_rb, 0.)
        m_rk = tl.where(pair, dA_rk, 0.)
        m_ab = tl.where(pair, dA_ab, 0.)
        m_ak = tl.where(pair, dA_ak, 0.)
        drT += e_r * (mm(b_hat, tl.trans(m_rb), PREC)
                      + mm(k_hat, tl.trans(m_rk), PREC))
        daT += e_a * (mm(b_hat, tl.trans(m_ab), PREC)
                      + mm(k_hat, tl.trans(m_ak), PREC))
        dbT += e_col * (mm(r_hat, m_rb, PREC) + mm(a_hat, m_ab, PREC))
        dkT += e_col * (mm(r_hat, m_rk, PREC) + mm(a_hat, m_ak, PREC))

    # log-decay gradients: rows read g_t (r) or ge_t (a), columns and chunk-end factors read -g_s
    d_g = rT * drT - bT * dbT - kT * dkT + tl.where(cb[None, :] == BT - 1, d_gC[:, None], 0.)
    d_ge = aT * daT
    dwT = tl.cumsum(d_g, axis=1, reverse=True) + tl.cumsum(d_ge, axis=1, reverse=True) - d_ge
    store_cols(dr, drT, tok, i_h, H, K, ck, m_t, m_k)
    store_cols(dw, dwT, tok, i_h, H, K, ck, m_t, m_k)
    store_cols(dk, dkT, tok, i_h, H, K, ck, m_t, m_k)
    store_cols(da, daT, tok, i_h, H, K, ck, m_t, m_k)
    store_cols(db, dbT, tok, i_h, H, K, ck, m_t, m_k)
