"""Triton backward of chunked RWKV-7 (derivation in README.md).

  _bwd_scan   (per sequence, head and V tile, chunks last to first): the state gradient dS (fp32), stored at each
              chunk end as dh, and dZ = T^T (scale A_rb^T do + b^ dS) for the parallel pass; dS at t=0 is dh0.
  _bwd_chunk  (per chunk and head, all at once): dv, then the pairwise-matrix gradients pushed back to r, k, a, b
              and the log decays, summed in reverse to dw (or, from logits, through the sigmoid to them).
Over equal rows the two alternate per group of chunks (sequence scans: segments of every sequence, the last first;
blocked scans: runs of blocks): dh then holds one group's chunk-end gradients (fp32 K x V per chunk), not all.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.rwkv7.fwd import decay_from_logits_t, load_w, scan_span
from kernels.tl_utils import (chunk_bounds, decay_on, exp, first_half, load_cols, load_rows, mm, pair_mask, run_sums_t,
                               second_half, store_cols)


@triton.jit
def _bwd_scan(r, w, w_bias, wf, a, b, do, cu, chunk_offsets, block_index, Arb, Tinv, dht, dh, dZ, dh0, dSb,
              scale, TT, decay_scale, seg_first, seg_count, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L: tl.constexpr, BLOCKED: tl.constexpr,
              OUT: tl.constexpr, SEGMENT: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
              FORM_W: tl.constexpr, PREC: tl.constexpr):
    """The state-gradient recursion over chunks, last to first, in one of three roles (as the forward's):
      sequence   (BLOCKED=False, OUT): from dht through all chunks, storing dS at each chunk's end as dh and dZ;
                 dS at t = 0 to dh0.
      block fill (BLOCKED, OUT): the same over one block of L chunks, from dS at its end, dSb[block].
      block map  (BLOCKED, not OUT): from zero over the block, storing its dS at the block's start to dSb[block]
                 (R in dS_start = M^T dS_end + R; M is the forward's block map).
    dh holds the chunks from global chunk seg_first on (row: global chunk - seg_first), or with SEGMENT (sequence
    role over equal rows) only chunks seg_first .. seg_first + seg_count - 1 of each sequence, from dht (the gradient
    carried from the later segment) to dh0, dh by sequence (row i_n * seg_count + chunk - seg_first); as
    _bwd_chunk's programs read them. FORM_W: the log decays formed from the logits w and w_bias (the forward kept no
    w by chunk: chunk._forms_w), else read from wf."""
    # Token tiles are feature-major ([BK or BV, BT], suffix T): every product has M = BK or BV rows.
    i_n, bos, eos, first, count, c0 = scan_span(cu, chunk_offsets, block_index, BT, L, BLOCKED)
    if BLOCKED:
        if count <= 0:   # a spare block of a packed batch
            return
    if SEGMENT:
        first = seg_first
        count = seg_count
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
        if FORM_W:
            wT = decay_from_logits_t(w, w_bias, tok, i_h, H, K, ck, m_t, m_k, decay_scale)
        else:
            wT = load_w(wf, c0 + i_t, i_h, K, ck, m_k, rows, TT, BT)
        gT = tl.cumsum(wT, axis=1)
        gC = tl.sum(wT, axis=1)
        r_decT = load_cols(r, tok, i_h, H, K, ck, m_t, m_k) * exp(gT)
        a_decT = load_cols(a, tok, i_h, H, K, ck, m_t, m_k) * exp(tl.minimum(gT - wT, 0.))
        b_endT = load_cols(b, tok, i_h, H, K, ck, m_t, m_k) * exp(tl.minimum(gC[:, None] - gT, 0.))
        doT = load_cols(do, tok, i_h, H, V, cv, m_t, m_v)
        A_rb = load_rows(Arb, tok, i_h, H, BT, cb, m_t, cb < BT)
        T = load_rows(Tinv, tok, i_h, H, BT, cb, m_t, cb < BT)
        if OUT:
            if SEGMENT:
                dh_row = i_n * seg_count + i_t - seg_first
            else:
                dh_row = c0 + i_t - seg_first
            tl.store(dh + (dh_row * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)
        dUT = scale * tl.dot(doT, A_rb, input_precision=PREC) + tl.dot(tl.trans(dS), b_endT, input_precision=PREC)
        dZT = tl.dot(dUT, T, input_precision=PREC)
        if OUT:
            store_cols(dZ, dZT, tok, i_h, H, V, cv, m_t, m_v)
        dS = exp(gC)[:, None] * dS + scale * tl.dot(r_decT, tl.trans(doT), input_precision=PREC) \
            + tl.dot(a_decT, tl.trans(dZT), input_precision=PREC)
    if BLOCKED:
        if not OUT:
            tl.store(dSb + block_base + s_off, dS, mask=m_kv)
    elif STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)


@triton.jit
def level_sums_t(wT, rows, BS: tl.constexpr):
    """fwd.level_sums of a feature-major [BK, BT] chunk: g_t - g_m, ge_t - g_m, g_m - g_s and the half masks
    [1, BT] (_bwd_chunk masks its pairs at the paired width)."""
    to_row_ex = run_sums_t(wT, rows, BS // 2, True)
    from_col = run_sums_t(wT, rows, BS // 2, False)
    return to_row_ex + wT, to_row_ex, from_col, second_half(rows, BS)[None, :], first_half(rows, BS)[None, :]


@triton.jit
def load_pair_cols(p_lo, p_hi, tok2, lo, i_h, H: tl.constexpr, D: tl.constexpr, feats, m_t2, m_f):
    """[BD, 2 BT] feature-major: columns c < BT are token c of p_lo, the others token c - BT of p_hi."""
    x_lo = load_cols(p_lo, tok2, i_h, H, D, feats, m_t2 & lo, m_f)
    x_hi = load_cols(p_hi, tok2, i_h, H, D, feats, m_t2 & ~lo, m_f)
    return tl.where(lo[None, :], x_lo, x_hi)


@triton.jit
def load_pair_raw(p_lo, p_hi, tok2, lo, i_h, H: tl.constexpr, D: tl.constexpr, feats, m_t2, m_f):
    """load_pair_cols in the tensors' own dtype: a bf16 pair held through the kernel takes half the registers of
    an fp32 one (_bwd_chunk converts [r | a] and [b | k] at each use, spilling less). The pairs that mix dtypes
    ([do | dZ], [U | v]) are loaded as fp32 by load_pair_cols."""
    p = tok2[None, :].to(tl.int64) * H * D + i_h * D + feats[:, None]
    m = m_f[:, None] & m_t2[None, :]
    return tl.where(lo[None, :], tl.load(p_lo + p, mask=m & lo[None, :], other=0.),
                    tl.load(p_hi + p, mask=m & ~lo[None, :], other=0.))


@triton.jit
def store_pair_cols(p_lo, p_hi, x, tok2, lo, i_h, H: tl.constexpr, D: tl.constexpr, feats, m_t2, m_f):
    store_cols(p_lo, x, tok2, i_h, H, D, feats, m_t2 & lo, m_f)
    store_cols(p_hi, x, tok2, i_h, H, D, feats, m_t2 & ~lo, m_f)


@triton.jit
def fold_pairs(x, BK: tl.constexpr, BT: tl.constexpr):
    """[BK, 2 BT] -> [BK, BT]: the two halves of a paired tile added."""
    return tl.sum(tl.reshape(x, [BK, 2, BT]), axis=1)


@triton.jit
def pair_cols(x, y, BK: tl.constexpr, BT: tl.constexpr):
    """[BK, BT] twice -> [BK, 2 BT]: x's columns, then y's."""
    return tl.reshape(tl.permute(tl.join(x, y), (0, 2, 1)), [BK, 2 * BT])


@triton.jit
def _bwd_chunk(r, w, w_bias, wf, k, v, a, b, do, cu, chunk_index, Ark, Aak, h, dh, U, dZ,
               dr, dw, dk, dv, da, db, scale, TT, decay_scale, seg_first, seg_count, seq_chunks,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr, LOGITS: tl.constexpr,
               FORM_W: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr):
    """Token tiles are feature-major and paired: [BK or BV, 2 BT], the chunk's tokens twice along the columns, the
    first BT for one tensor and the next BT for its partner, so that the four pairwise matrices form one
    [2 BT, 2 BT] block matrix dA = [[dA_rb, dA_rk], [dA_ab, dA_ak]] (rows: r then a; columns: b then k). Each
    product then does the work of four (every level pushes dA back with two products instead of eight): the kernel
    is bound by the latency of its many small products, not by their arithmetic.
    Program p takes global chunk (p // seg_count) seq_chunks + seg_first + p % seg_count (seq_chunks > 0: segments
    of equal rows of seq_chunks chunks, _bwd_scan's SEGMENT layout; seq_chunks = 0: the chunks from seg_first on)
    and its dS_C from row p of dh. LOGITS: w holds the decay's logits (dw goes through the sigmoid to them); FORM_W:
    the log decays formed from them (as _bwd_scan's), else read from wf."""
    p = tl.program_id(0)
    i_c = (p // seg_count) * seq_chunks + seg_first + p % seg_count   # the global chunk (h, w by chunk)
    t0, eos = chunk_bounds(cu, chunk_index, i_c, BT)
    if t0 >= eos:   # a spare program of a packed batch
        return
    i_h = tl.program_id(1)
    rows = tl.arange(0, BT)
    tok = t0 + rows
    m_t = tok < eos
    ck = tl.arange(0, BK)
    m_k = ck < K
    c2 = tl.arange(0, 2 * BT)
    t2 = c2 % BT            # the token of each paired column (and row of dA)
    lo = c2 < BT            # first of the pair: r, b, do, U (rows of dA: r; columns: b)
    tok2 = t0 + t2
    m_t2 = tok2 < eos

    # Only k^ = k e^{gC - g} (for dv) is needed inside the V loop besides the paired loads; g and e^{gC - g} are
    # formed again after the loop rather than held through its products (registers: the kernel is at 255).
    if FORM_W:
        wT = decay_from_logits_t(w, w_bias, tok, i_h, H, K, ck, m_t, m_k, decay_scale)
    else:
        wT = load_w(wf, i_c, i_h, K, ck, m_k, rows, TT, BT)
    gC = tl.sum(wT, axis=1)
    k_endT = load_cols(k, tok, i_h, H, K, ck, m_t, m_k) * exp(tl.minimum(run_sums_t(wT, rows, BT, False), 0.))
    # [scale A_rk ; A_ak]: dv = scale A_rk^T do + A_ak^T dZ = ([do | dZ] Ak2) (feature-major)
    Ak2 = tl.where(lo[:, None], scale, 1.) * (
        load_rows(Ark, tok2, i_h, H, BT, rows, m_t2 & lo, rows < BT)
        + load_rows(Aak, tok2, i_h, H, BT, rows, m_t2 & ~lo, rows < BT))

    d_x = tl.zeros([BK, 2 * BT], dtype=tl.float32)     # [S0 do | S0 dZ]
    d_y = tl.zeros([BK, 2 * BT], dtype=tl.float32)     # [dS_C U | dS_C v]
    dA = tl.zeros([2 * BT, 2 * BT], dtype=tl.float32)
    d_gC = tl.zeros([BK], dtype=tl.float32)
    h_base = (i_c * H + i_h).to(tl.int64) * K * V
    dh_base = (p * H + i_h).to(tl.int64) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        s_off = ck[:, None] * V + cv[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        S0 = tl.load(h + h_base + s_off, mask=m_kv, other=0.).to(tl.float32)   # bf16 with bf16 products
        dSC = tl.load(dh + dh_base + s_off, mask=m_kv, other=0.)
        X2 = load_pair_cols(do, dZ, tok2, lo, i_h, H, V, cv, m_t2, m_v)   # [BV, 2 BT]
        Y2 = load_pair_cols(U, v, tok2, lo, i_h, H, V, cv, m_t2, m_v)
        d_x += mm(S0, X2, BF16, PREC)
        d_y += mm(dSC, Y2, BF16, PREC)
        d_gC += tl.sum(S0 * dSC, axis=1)
        dA += mm(tl.trans(X2), Y2, BF16, PREC)
        dvT = mm(X2, Ak2, BF16, PREC) + mm(tl.trans(dSC), k_endT, BF16, PREC)
        store_cols(dv, dvT, tok, i_h, H, V, cv, m_t, m_v)

    # The r rows of dA carry the output's scale; pairs run t > s (levels) and t = s for r rows only (diagonal).
    dA = tl.where(lo[:, None], scale * dA, dA)
    # [r | a] and [b | k] stay in the inputs' dtype (half the registers when bf16) until each use
    X = load_pair_raw(r, a, tok2, lo, i_h, H, K, ck, m_t2, m_k)
    Y = load_pair_raw(b, k, tok2, lo, i_h, H, K, ck, m_t2, m_k)
    geT = run_sums_t(wT, rows, BT, True)
    # x rows read g (r, inclusive) or ge (a, exclusive); y columns and the chunk end read -g
    to_endT = exp(tl.minimum(run_sums_t(wT, rows, BT, False), 0.))
    d_y *= pair_cols(to_endT, to_endT, BK, BT)
    d_gC = d_gC * exp(gC) + tl.sum(Y.to(tl.float32) * d_y, axis=1)
    d_x *= pair_cols(scale * exp(tl.minimum(geT + wT, 0.)), exp(tl.minimum(geT, 0.)), BK, BT)
    # the diagonal (decay 1): dr_t += dA_rb[t,t] b_t + dA_rk[t,t] k_t; db_t, dk_t += the same entries times r_t
    diag = lo[:, None] & (c2[:, None] == t2[None, :])
    Dg = tl.where(diag, dA, 0.)
    d_x += mm(Y.to(tl.float32), tl.trans(Dg), BF16, PREC)
    d_y += mm(X.to(tl.float32), Dg, BF16, PREC)
    # Pairwise matrices back to their factors, level by level as in the forward:
    # dx_t = e_row(t) * sum_s dA[t, s] y^_s and dy_s = e_col(s) * sum_t dA[t, s] x^_t.
    for lvl in tl.static_range(LEVELS):
        to_row, to_row_ex, from_col, second, first = level_sums_t(wT, rows, BT >> lvl)
        e_x = pair_cols(decay_on(second, to_row), decay_on(second, to_row_ex), BK, BT)
        e_c = decay_on(first, from_col)
        e_y = pair_cols(e_c, e_c, BK, BT)
        m_pair = tl.where(pair_mask(t2, t2, BT >> lvl), dA, 0.)
        d_x += e_x * mm(Y.to(tl.float32) * e_y, tl.trans(m_pair), BF16, PREC)
        d_y += e_y * mm(X.to(tl.float32) * e_x, m_pair, BF16, PREC)

    # log-decay gradients: r rows read +g, a rows +ge, b and k columns -g, the chunk end +gC (on its last row, which
    # the reverse cumulative sum hands to every row)
    xd = X.to(tl.float32) * d_x
    d_g = fold_pairs(tl.where(lo[None, :], xd, 0.) - Y.to(tl.float32) * d_y, BK, BT) \
        + tl.where(rows[None, :] == BT - 1, d_gC[:, None], 0.)
    d_ge = fold_pairs(tl.where(lo[None, :], 0., xd), BK, BT)
    dwT = run_sums_t(d_g + d_ge, rows, BT, False) + d_g
    if LOGITS:   # w = -c sigmoid(z): dw/dz = -c sigmoid (1 - sigmoid) = w (1 + w / c)
        dwT = dwT * wT * (1. + wT / decay_scale)
    store_cols(dw, dwT, tok, i_h, H, K, ck, m_t, m_k)
    store_pair_cols(dr, da, d_x, tok2, lo, i_h, H, K, ck, m_t2, m_k)
    store_pair_cols(db, dk, d_y, tok2, lo, i_h, H, K, ck, m_t2, m_k)
