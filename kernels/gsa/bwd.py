"""Triton backward of chunked GSA (derivation in README.md).

Chunk-start states are recomputed by the forward's _state_scan (between the passes only the inputs and small
[T, H, M] factors are kept).
  _bwd_dz     (per chunk and head): from the forward's slot logits and p (kept by _fwd_out), forms dp and the
              softmax backward dZr = scale dZ and the row part of the log-gate gradient; stores dZr.
  _state_scan (REVERSE, per sequence, head and D tile): the state gradients at every chunk end (fp32, or fp16 with
              scales for bf16 data: Settings.fp16_states) of both states in one launch: (w = dZr, x = q) for Hk^T and
              (w = p, x = do) for Hv; at t = 0 they are the initial-state gradients.
  _bwd_pairs  (per chunk and head, on a second stream beside the reverse scan): what needs the pairwise decays
              within the chunk apart from the states and A2 (kept by _fwd_out): the pair matrix dA1 and ds's part
              within the chunk.
  _bwd_dkvsg  (per chunk and head): dq, dk, dv, ds and the log gate (reverse cumulative sum within the chunk); it
              forms no pairwise decay, only streams the states and the features.
The per-chunk kernels' decays are span sums (fwd.span_sums: products with a 0/1 matrix). For bf16 inputs the
products of features and pair matrices take bf16 operands with fp32 accumulation (BF16); those that carry the
logits' gradient (dP's gated sum, dA1's levels), ds's levels (the gate's gradient cancels them against the logits'),
those with a state or state gradient, and the reverse scans' keep fp32 operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gsa.fwd import chunk_state, from_start, gated_sum, level, load_gates_by_chunk, store_split, to_end
from kernels.tl_utils import (cast_for, chunk_program, diag_of, exp, load_rows, load_rows_raw, mm, spare_chunk,
                              store_rows)


@triton.jit
def _bwd_dz(v, s, g, do, cu, chunk_index, hv, hv_sc, p, z, dz_out, dg, pe_out, dze_out, d2_out, scale, TT,
            H: tl.constexpr, V: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
            BM: tl.constexpr, LEVELS: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
            SC: tl.constexpr):
    """g slot-major (load_gates_by_chunk). Also keeps D2 = do v^T ([T, H, BT], row t of the chunk's tile) for
    _bwd_pairs, and the reverse scans' weights p e^{G} and dZr e^{G} (split in bf16 halves with SPLIT)."""
    if spare_chunk(cu, chunk_index, BT):   # a spare program of a packed batch (kernels.utils.chunk_tables): its
        return                             # chunk's state was never written
    i_c, i_h, eos, rows, tok, m_t, cm, m_m = chunk_program(cu, chunk_index, BT, BM, M)
    cols = tl.arange(0, BT)
    # the chunk's loads issued together, g last (the compiler places its layout conversion right after its load)
    x_s = load_rows_raw(s, tok, i_h, H, M, cm, m_t, m_m)
    # the forward's softmax p and slot logits Zr (kept by _fwd_out: recomputing them costs Hk, q and k here)
    Zr = load_rows_raw(z, tok, i_h, H, M, cm, m_t, m_m)
    P = load_rows_raw(p, tok, i_h, H, M, cm, m_t, m_m)
    b_g = load_gates_by_chunk(g, i_c, i_h, M, cm, m_m, rows, TT, BT)
    b_s = x_s.to(tl.float32)
    eG = exp(from_start(b_g, rows))
    hbase = (i_c * H + i_h).to(tl.int64) * M
    # dp_t = e^{G_t} (Hv_0 do_t) + sum_{s<=t} (do_t . v_s) e^{G_t - G_s} s_s
    D2 = tl.zeros([BT, BT], dtype=tl.float32)
    dPH = tl.zeros([BT, BM], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        b_do = load_rows(do, tok, i_h, H, V, cv, m_t, m_v)
        D2 += mm(b_do, tl.trans(load_rows(v, tok, i_h, H, V, cv, m_t, m_v)), BF16, PREC)
        dPH += tl.dot(b_do, tl.trans(chunk_state(hv, hv_sc, hbase * V, cm, cv, i_v * BV, V, m_m, m_v, SC)),
                      input_precision=PREC)
    store_rows(d2_out, D2, tok, i_h, H, BT, cols, m_t, cols < BT)
    dP = gated_sum(eG * dPH, D2, b_s, b_g, rows, cols, LEVELS, PREC)
    dZr = scale * P * (dP - tl.sum(P * dP, axis=1)[:, None])
    # Every term of Zr[t, m] and every use of p[t, m] carries e^{+G[t, m]}: the row part of dG.
    store_rows(dg, dZr * Zr + P * dP, tok, i_h, H, M, cm, m_t, m_m)
    store_rows(dz_out, dZr, tok, i_h, H, M, cm, m_t, m_m)
    if SPLIT:   # the reverse scans' inputs with their decay e^{G} applied
        store_split(pe_out, P * eG, tok, i_h, H, M, cm, m_t, m_m)
        store_split(dze_out, dZr * eG, tok, i_h, H, M, cm, m_t, m_m)
    else:
        store_rows(pe_out, P * eG, tok, i_h, H, M, cm, m_t, m_m)
        store_rows(dze_out, dZr * eG, tok, i_h, H, M, cm, m_t, m_m)


@triton.jit
def _bwd_pairs(s, g, p_in, dz_in, a1, d2, cu, chunk_index, dsi_out, da1_out,
               H: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, LEVELS: tl.constexpr,
               BF16: tl.constexpr, PREC: tl.constexpr):
    """Everything of the backward that needs the pairwise decays within a chunk, apart from the states: the pair
    matrix dA1 (dZr against s) and ds's part within the chunk,
    sum_{t>=s} e^{G_t - G_s} (A1[t, s] dZr_t + D2[t, s] P_t) (A1 = q k^T kept by _fwd_out with A2, D2 = do v^T by
    _bwd_dz). g token-major: on the slot-major copy this kernel spills. ds's levels take fp32 operands: dg cancels
    each pair's share here (-G_s) against the logits' (+G_t, fp32 operands too), and bf16 ones rounded the two apart
    (dg 1e-2 off fp64 under log gates near -50, 2.6e-3 with these). Every store is masked by the token mask: a
    spare chunk of a packed batch runs with all-false masks."""
    i_c, i_h, eos, rows, tok, m_t, cm, m_m = chunk_program(cu, chunk_index, BT, BM, M)
    cols = tl.arange(0, BT)
    m_c = cols < BT
    # the loads of dA1's part issued together; A1, D2 and p, first used after dA1's levels, load after them (issued
    # before, they spill)
    x_s = load_rows_raw(s, tok, i_h, H, M, cm, m_t, m_m)
    dZr = load_rows_raw(dz_in, tok, i_h, H, M, cm, m_t, m_m)
    b_g = load_rows_raw(g, tok, i_h, H, M, cm, m_t, m_m)   # (fp32) padded rows read 0
    b_s = x_s.to(tl.float32)
    # dZr and g through a select that changes nothing (masked loads give 0): it keeps their layout conversions (a
    # shared-memory round trip with a barrier, which no later load passes) at their first use, not at their loads
    m_tm = m_t[:, None] & m_m[None, :]
    dZr = tl.where(m_tm, dZr, 0.)
    b_g = tl.where(m_tm, b_g, 0.)
    # level by level, so that each level's decays die with it: dA1 first, stored before ds's part
    dA1 = tl.where(rows[:, None] == cols[None, :], tl.sum(dZr * b_s, axis=1)[:, None], 0.)
    for lvl in tl.static_range(LEVELS):
        e_row, e_col, pair = level(b_g, rows, cols, BT >> lvl)
        # fp32 operands: dA1 carries the logits' gradient (gated_sum)
        dA1 += tl.where(pair, tl.dot(dZr * e_row, tl.trans(b_s * e_col), input_precision=PREC), 0.)
    store_rows(da1_out, dA1, tok, i_h, H, BT, cols, m_t, m_c)
    A1 = load_rows(a1, tok, i_h, H, BT, cols, m_t, m_c)
    D2 = load_rows(d2, tok, i_h, H, BT, cols, m_t, m_c)
    P = load_rows(p_in, tok, i_h, H, M, cm, m_t, m_m)
    dsi = diag_of(A1, rows, cols)[:, None] * dZr + diag_of(D2, rows, cols)[:, None] * P
    for lvl in tl.static_range(LEVELS):
        e_row, e_col, pair = level(b_g, rows, cols, BT >> lvl)
        dsi += e_col * (tl.dot(tl.trans(tl.where(pair, A1, 0.)), dZr * e_row, input_precision=PREC)
                        + tl.dot(tl.trans(tl.where(pair, D2, 0.)), P * e_row, input_precision=PREC))
    store_rows(dsi_out, dsi, tok, i_h, H, M, cm, m_t, m_m)


@triton.jit
def _bwd_dkvsg(q, k, v, s, g, do, cu, chunk_index, hk, hv, dhk, dhv, hk_sc, hv_sc, dhk_sc, dhv_sc, dz_in, dq, dk,
               dv, ds, dg, dsi, a2, da1, TT, y, dy, inv_norm, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
               LEVELS: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr, SC: tl.constexpr, W: tl.constexpr):
    """A2 comes from _fwd_out, dA1 and ds's part within the chunk from _bwd_pairs: this kernel forms no pairwise
    decay. g slot-major (load_gates_by_chunk).
    W > 0: the features came from the stacked projection y [T, W] = (q | k | v | f) (projection.py):
    the gradient of y is stored in dy through the feature maps (silu on q, k, v; g = logsigmoid(f) * inv_norm,
    s = 1 - e^g), in place of dq, dk, dv, ds and dg (dg is still this kernel's scratch)."""
    if spare_chunk(cu, chunk_index, BT):   # a spare program of a packed batch (kernels.utils.chunk_tables): its
        return                             # chunk's states were never written
    i_c, i_h, eos, rows, tok, m_t, cm, m_m = chunk_program(cu, chunk_index, BT, BM, M)
    cols = tl.arange(0, BT)
    # the prologue's loads issued together, g last
    x_s = load_rows_raw(s, tok, i_h, H, M, cm, m_t, m_m)
    dZr = load_rows_raw(dz_in, tok, i_h, H, M, cm, m_t, m_m)
    A2 = load_rows_raw(a2, tok, i_h, H, BT, cols, m_t, cols < BT)
    # dA1[t, s] = sum_m dZr[t, m] e^{G_t - G_s} s[s, m]: the gradient of q_t . k_s
    dA1 = load_rows_raw(da1, tok, i_h, H, BT, cols, m_t, cols < BT)
    b_g = load_gates_by_chunk(g, i_c, i_h, M, cm, m_m, rows, TT, BT)
    b_s = x_s.to(tl.float32)
    # dZr through a select that changes nothing (as in _bwd_pairs: its layout conversion stays at its first use)
    m_tm = m_t[:, None] & m_m[None, :]
    dZr = tl.where(m_tm, dZr, 0.)
    GC = tl.sum(b_g, axis=0)
    e_end = exp(to_end(b_g, rows))    # e^{sum_{j>t} g_j}: decay to the chunk end
    eG = exp(from_start(b_g, rows))   # e^{G_t}: decay from the chunk start
    s_end = b_s * e_end
    dZe = dZr * eG
    hbase = (i_c * H + i_h).to(tl.int64) * M
    dS_end = tl.zeros([BT, BM], dtype=tl.float32)   # ds through the chunk-end states, before e^{G_C - G}
    dGC = tl.zeros([BM], dtype=tl.float32)           # through e^{G_C} on the chunk-start states
    for i_k in range(tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        b_q = load_rows(q, tok, i_h, H, K, ck, m_t, m_k)
        b_k = load_rows(k, tok, i_h, H, K, ck, m_t, m_k)
        if W > 0:   # loaded ahead of the products, which then hide the loads' latency; k's part first (the
            # compiler places q's part's layout conversion right after its load, which held a later load back)
            y_k = load_projection(y, tok, (H + i_h) * K, ck, m_t, m_k, W)
            y_q = load_projection(y, tok, i_h * K, ck, m_t, m_k, W)
        b_h = chunk_state(hk, hk_sc, hbase * K, cm, ck, i_k * BK, K, m_m, m_k, SC)
        b_dh = chunk_state(dhk, dhk_sc, hbase * K, cm, ck, i_k * BK, K, m_m, m_k, SC)
        dS_end += tl.dot(b_k, tl.trans(b_dh), input_precision=PREC)
        dGC += tl.sum(b_h * b_dh, axis=1)
        b_dq = tl.dot(dZe, b_h, input_precision=PREC) + mm(dA1, b_k, BF16, PREC)
        if W > 0:
            store_silu_grad(dy, y_q, b_dq, tok, i_h * K, ck, m_t, m_k, W)
        else:
            store_rows(dq, b_dq, tok, i_h, H, K, ck, m_t, m_k)
        b_dk = mm(tl.trans(dA1), b_q, BF16, PREC) + tl.dot(s_end, b_dh, input_precision=PREC)
        if W > 0:
            store_silu_grad(dy, y_k, b_dk, tok, (H + i_h) * K, ck, m_t, m_k, W)
        else:
            store_rows(dk, b_dk, tok, i_h, H, K, ck, m_t, m_k)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        b_do = load_rows(do, tok, i_h, H, V, cv, m_t, m_v)
        b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        if W > 0:
            y_v = load_projection(y, tok, 2 * H * K + i_h * V, cv, m_t, m_v, W)
        b_dh = chunk_state(dhv, dhv_sc, hbase * V, cm, cv, i_v * BV, V, m_m, m_v, SC)
        dS_end += tl.dot(b_v, tl.trans(b_dh), input_precision=PREC)
        dGC += tl.sum(chunk_state(hv, hv_sc, hbase * V, cm, cv, i_v * BV, V, m_m, m_v, SC) * b_dh, axis=1)
        b_dv = mm(tl.trans(A2), b_do, BF16, PREC) + tl.dot(s_end, b_dh, input_precision=PREC)
        if W > 0:
            store_silu_grad(dy, y_v, b_dv, tok, 2 * H * K + i_h * V, cv, m_t, m_v, W)
        else:
            store_rows(dv, b_dv, tok, i_h, H, V, cv, m_t, m_v)
    # the loads of the epilogue issued together (held through the loops, they spill under the register cap)
    if W > 0:
        x_f = load_projection(y, tok, 2 * H * K + H * V + i_h * M, cm, m_t, m_m, W)
    x_dg = load_rows_raw(dg, tok, i_h, H, M, cm, m_t, m_m)
    x_dsi = load_rows_raw(dsi, tok, i_h, H, M, cm, m_t, m_m)
    x_dg = tl.where(m_tm, x_dg, 0.)   # (a no-op select, as dZr's: else dsi's load waits behind dg's conversion)
    dS_end = dS_end * e_end
    b_ds = dS_end + x_dsi
    # log gate: rows' e^{+G_t} (stored by _bwd_dz), columns' e^{-G_s} (every use of s), e^{+G_C} on the last row
    dGC = dGC * exp(GC) + tl.sum(b_s * dS_end, axis=0)
    dG = x_dg - b_s * b_ds + tl.where(rows[:, None] == BT - 1, dGC[None, :], 0.)
    # dg_j = sum_{t>=j} dG_t: a scan (as a run sum, a product, this kernel spills 120 more bytes under its cap)
    b_dg = tl.cumsum(dG, axis=0, reverse=True)
    if W > 0:
        # s = 1 - e^g adds -e^g ds to g's gradient; d logsigmoid(f) / df = sigmoid(-f)
        f = x_f.to(tl.float32)
        b_df = (b_dg - b_ds * exp(b_g)) * inv_norm * tl.sigmoid(-f)
        store_projection(dy, b_df, tok, 2 * H * K + H * V + i_h * M, cm, m_t, m_m, W)
    else:
        store_rows(ds, b_ds, tok, i_h, H, M, cm, m_t, m_m)
        store_rows(dg, b_dg, tok, i_h, H, M, cm, m_t, m_m)


@triton.jit
def load_projection(y, tok, col0, cols, m_t, m_c, W: tl.constexpr):
    """y[tok, col0 + cols] of a [T, W] tensor, in its own dtype."""
    return tl.load(y + tok[:, None].to(tl.int64) * W + col0 + cols[None, :], mask=m_t[:, None] & m_c[None, :],
                   other=0.)


@triton.jit
def store_projection(dy, x, tok, col0, cols, m_t, m_c, W: tl.constexpr):
    tl.store(dy + tok[:, None].to(tl.int64) * W + col0 + cols[None, :], cast_for(dy, x),
             mask=m_t[:, None] & m_c[None, :])


@triton.jit
def store_silu_grad(dy, y_part, d, tok, col0, cols, m_t, m_c, W: tl.constexpr):
    """dy[tok, col0 + cols] = d * silu'(x), x = y_part (load_projection's tile of y at the same place)."""
    x = y_part.to(tl.float32)
    sig = tl.sigmoid(x)
    store_projection(dy, d * sig * (1 + x * (1 - sig)), tok, col0, cols, m_t, m_c, W)
