"""Triton forward of chunked RWKV-7 (math and notation in README.md).

Launches:
  _fwd_prep  (one program per chunk and head, all chunks at once): cumulative log decays, the pairwise chunk
             matrices (by halving, one product per level) A_rb, A_rk, A_ak, T = (I - A_ab)^{-1}, and the
             state-independent W = T a~, Uv = T A_ak v;
  _fwd_scan  (one program per sequence, head and V tile, chunks in order): U = W S + Uv, the output, the next state.
or, for few long sequences (blocked scan: the sequential part one product per block of L chunks):
  _fwd_scan  as the block maps (per block, all at once): S_end = M S_start + N over the block's chunks, M and N
             carried together as one [K, K + V] state;
  _block_scan (per sequence, head, V tile): the state entering every block, S <- M S + N;
  _fwd_scan  as the fill (per block): the sequence scan over the block's chunks from its entering state.
_chunk_u (per chunk, in the backward where the forward kept only the chunk states): U = W h + Uv again.
Every exp() argument is <= 0 by construction: masked entries are replaced by 0 before the exp and the result by 0
after.
Inputs are packed sequences [1, T_total, H, *]; states and everything the backward reuses are fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import (by_chunk, cast_for, chunk_bounds, decay_on, exp, fast_div, first_half, load_cols,
                               load_rows, load_rows_raw, mm, pair_mask, run_sums, second_half, sequence_span,
                               store_cols, store_rows)


@triton.jit
def load_w(wf, i_c, i_h, K: tl.constexpr, ck, m_k, rows, TT, BT: tl.constexpr):
    """The chunk's log decays [BK, BT] from w's feature-major copy by chunks (tl_utils.by_chunk, stored by
    _fwd_prep). Its tokens are contiguous, so the tile loads with the tokens along a warp's lanes and the cumulative
    sums over the chunk stay within a warp; loaded from w [T, H, K] they would span the warps and go through shared
    memory."""
    return tl.load(wf + by_chunk(i_c, i_h, K, ck, rows, TT, BT), mask=m_k[:, None], other=0.)


@triton.jit
def log_decay(z, bias, decay_scale):
    """decay.log_decay in fp32 by the operations of tiles.cuh's log_decay (prep.cu's and the CUDA scans'), so that
    every kernel forms the same w from the same logits, bit for bit."""
    return fast_div(-decay_scale + 0. * z, 1. + exp(-(z + bias)))


@triton.jit
def decay_from_logits_t(z, bias, tok, i_h, H: tl.constexpr, K: tl.constexpr, ck, m_t, m_k, decay_scale):
    """The chunk's log decays [BK, BT] formed from the logits z [T, H, K] and the bias [H * K], as the forward formed
    them (zero past the sequence's end): what the backward reads instead of a kept w by chunk."""
    zT = load_cols(z, tok, i_h, H, K, ck, m_t, m_k)
    bias_k = tl.load(bias + i_h * K + ck, mask=m_k, other=0.).to(tl.float32)
    return tl.where(m_k[:, None] & m_t[None, :], log_decay(zT, bias_k[:, None], decay_scale), 0.)


@triton.jit
def level_sums(w, rows, cols, BS: tl.constexpr):
    """One halving level of a token-major [BT, BK] chunk (blocks of BS rows; tl_utils' halving levels): the log
    decays summed within half blocks, g_t - g_m and ge_t - g_m (for rows t of a second half) and g_m - g_s (for rows
    s of a first half), m the last row of the first half, each a run sum (tl_utils.run_sums: a sum of non-positive
    terms); the half masks [BT, 1] and the pair mask [BT, BT]."""
    to_row_ex = run_sums(w, rows, BS // 2, True)
    from_col = run_sums(w, rows, BS // 2, False)
    return to_row_ex + w, to_row_ex, from_col, second_half(rows, BS)[:, None], first_half(rows, BS)[:, None], \
        pair_mask(rows, cols, BS)


@triton.jit
def _fwd_prep(r, w, w_bias, k, v, a, b, cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv, wf, TT, decay_scale,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, LEVELS: tl.constexpr, LOGITS: tl.constexpr, BF16: tl.constexpr,
              PREC: tl.constexpr):
    """LOGITS: w holds the decay's logits, the log decay is -decay_scale * sigmoid(w + w_bias) (decay.py; log_decay).
    The kernel waits on its loads (few blocks fit an SM at its register count): every load is issued at once, in
    the inputs' dtype, v's first tile too, and no branch precedes them (a spare chunk of a packed batch runs with
    all-false masks instead of returning early)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BT)
    cb = rows   # token offsets along the columns of [BT, BT] tiles
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv0 = tl.arange(0, BV)
    bias = tl.zeros([BK], dtype=tl.float32)
    if LOGITS:
        bias = tl.load(w_bias + i_h * K + ck, mask=m_k, other=0.).to(tl.float32)
    eye = rows[:, None] == cb[None, :]
    t0, eos = chunk_bounds(cu, chunk_index, i_c, BT)
    tok = t0 + rows
    m_t = tok < eos
    # Padded rows load as zeros: w = 0 keeps g flat, zero r/k/a/b add nothing.
    x_r = load_rows_raw(r, tok, i_h, H, K, ck, m_t, m_k)
    x_w = load_rows_raw(w, tok, i_h, H, K, ck, m_t, m_k)
    x_k = load_rows_raw(k, tok, i_h, H, K, ck, m_t, m_k)
    x_a = load_rows_raw(a, tok, i_h, H, K, ck, m_t, m_k)
    x_b = load_rows_raw(b, tok, i_h, H, K, ck, m_t, m_k)
    x_v = load_rows_raw(v, tok, i_h, H, V, cv0, m_t, cv0 < V)
    b_r, b_w, b_k, b_a, b_b = x_r.to(tl.float32), x_w.to(tl.float32), x_k.to(tl.float32), x_a.to(tl.float32), \
        x_b.to(tl.float32)
    if LOGITS:   # (padded rows and features set to w = 0 again)
        b_w = tl.where(m_t[:, None] & m_k[None, :], log_decay(b_w, bias[None, :], decay_scale), 0.)
    ge = run_sums(b_w, rows, BT, True)   # exclusive cumulative log decays, for W = T (a e^{ge})
    # w feature-major by chunk, for the kernels that read it (load_w)
    tl.store(wf + tl.trans(by_chunk(i_c, i_h, K, ck, rows, TT, BT)), b_w, mask=m_k[None, :])

    # Pairwise matrices A_xy[t, s] = sum_k x_tk y_sk exp(gx_tk - g_sk) by halving: at each level, a pair (t, s)
    # straddling the middle of its block factors through that middle row m as exp(gx_t - g_m) * exp(g_m - g_s),
    # both <= 0, so each level is one matrix product; the diagonal (t = s, decay 1) is added apart.
    A_rb = tl.where(eye, tl.sum(b_r * b_b, axis=1)[:, None], 0.)
    A_rk = tl.where(eye, tl.sum(b_r * b_k, axis=1)[:, None], 0.)
    A_ab = tl.zeros([BT, BT], dtype=tl.float32)
    A_ak = tl.zeros([BT, BT], dtype=tl.float32)
    for lvl in tl.static_range(LEVELS):
        to_row, to_row_ex, from_col, second, first, pair = level_sums(b_w, rows, cb, BT >> lvl)
        r_hat = b_r * decay_on(second, to_row)
        a_hat = b_a * decay_on(second, to_row_ex)
        e_col = decay_on(first, from_col)
        b_hat = tl.trans(b_b * e_col)
        k_hat = tl.trans(b_k * e_col)
        A_rb += tl.where(pair, mm(r_hat, b_hat, BF16, PREC), 0.)
        A_rk += tl.where(pair, mm(r_hat, k_hat, BF16, PREC), 0.)
        A_ab += tl.where(pair, mm(a_hat, b_hat, BF16, PREC), 0.)
        A_ak += tl.where(pair, mm(a_hat, k_hat, BF16, PREC), 0.)

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
    b_W = tl.dot(T, b_a * exp(tl.minimum(ge, 0.)), input_precision=PREC)
    store_rows(W, b_W, tok, i_h, H, K, ck, m_t, m_k)
    for i_v in tl.static_range((V + BV - 1) // BV):
        cv = i_v * BV + cv0
        m_v = cv < V
        if i_v == 0:
            b_v = x_v.to(tl.float32)
        else:
            b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        b_Uv = tl.dot(T, mm(A_ak, b_v, BF16, PREC), input_precision=PREC)
        store_rows(Uv, b_Uv, tok, i_h, H, V, cv, m_t, m_v)


@triton.jit
def scan_span(cu, chunk_offsets, block_index, BT: tl.constexpr, L: tl.constexpr, BLOCKED: tl.constexpr):
    """What one scan program walks: (sequence, its first token, its end, first chunk, number of chunks, the
    sequence's first global chunk). A whole sequence (program axis 0 = sequence), or with BLOCKED one block of L
    chunks of it (axis 0 = global block; a spare block of a packed batch gets no chunks)."""
    if BLOCKED:
        i_n = tl.load(block_index + 2 * tl.program_id(0))
        first = tl.load(block_index + 2 * tl.program_id(0) + 1) * L
        bos, eos, chunks, c0 = sequence_span(cu, chunk_offsets, i_n, BT)
        count = tl.minimum(chunks - first, L)
    else:
        i_n = tl.program_id(0)
        first = 0
        bos, eos, count, c0 = sequence_span(cu, chunk_offsets, i_n, BT)
    return i_n, bos, eos, first, count, c0


@triton.jit
def _fwd_scan(r, wf, k, v, b, cu, chunk_offsets, block_index, W, Uv, Arb, Ark, h0, o, h, U, ht, Sb, Mb,
              scale, TT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, L: tl.constexpr, BLOCKED: tl.constexpr, OUT: tl.constexpr,
              HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """The state recursion over chunks in order, in one of three roles:
      sequence   (BLOCKED=False, OUT): from h0 through all chunks of a sequence, storing each chunk's entering
                 state h, U and the output; the final state to ht.
      block fill (BLOCKED, OUT): the same over one block of L chunks, from its entering state Sb[block].
      block map  (BLOCKED, not OUT): the block's affine map S_end = M S_start + N, M to Mb[block] and N to
                 Sb[block], both carried at once as one [K, K + V] "state" [M | N] (the program axis 2 tiles its
                 columns): M starts from the identity and takes no value terms, N starts from zero. One program
                 walks the block's chunks for both, which costs little more than for one: the steps are bound by
                 their latency, not by the width of their products."""
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
    cs = i_v * BV + tl.arange(0, BV)   # state columns
    if BLOCKED and not OUT:   # [M | N]: columns below K are M's, the others N's value columns
        cv = cs - K
        m_v = (cs >= K) & (cv < V)
    else:
        cv = cs
        m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    # state tile S [BK, BV], fp32 throughout
    s_off = ck[:, None] * V + cv[None, :]
    block_base = (tl.program_id(0) * H + i_h).to(tl.int64) * K * V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if BLOCKED:
        if OUT:
            S = tl.load(Sb + block_base + s_off, mask=m_kv, other=0.)
        else:
            S = tl.where((ck[:, None] == cs[None, :]) & (cs < K)[None, :], 1., 0.)
    elif HAS_H0:
        S = tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.).to(tl.float32)
    # Uv is only added to a product's result, so the compiler does not prefetch it as it does the products'
    # operands: loaded a chunk ahead by hand, it leaves the step's critical path
    tok = bos + first * BT + rows
    Uv_next = load_cols(Uv, tok, i_h, H, V, cv, tok < eos, m_v)
    for i in range(count):
        i_t = first + i
        tok = bos + i_t * BT + rows
        m_t = tok < eos
        UvT = Uv_next
        Uv_next = load_cols(Uv, tok + BT, i_h, H, V, cv, tok + BT < eos, m_v)
        wT = load_w(wf, c0 + i_t, i_h, K, ck, m_k, rows, TT, BT)
        gT = tl.cumsum(wT, axis=1)
        gC = tl.sum(wT, axis=1)
        to_endT = exp(tl.minimum(gC[:, None] - gT, 0.))
        b_endT = load_cols(b, tok, i_h, H, K, ck, m_t, m_k) * to_endT
        WT = load_cols(W, tok, i_h, H, K, ck, m_t, m_k)
        St = tl.trans(S)
        UT = tl.dot(St, WT, input_precision=PREC)
        S_next = exp(gC)[:, None] * S
        UT += UvT   # Uv and v load as zeros in M's columns (block maps): M takes no value terms
        vT = load_cols(v, tok, i_h, H, V, cv, m_t, m_v)
        k_endT = load_cols(k, tok, i_h, H, K, ck, m_t, m_k) * to_endT
        S_next += tl.dot(k_endT, tl.trans(vT), input_precision=PREC)
        if OUT:
            r_decT = load_cols(r, tok, i_h, H, K, ck, m_t, m_k) * exp(gT)
            A_rb = load_rows(Arb, tok, i_h, H, BT, cb, m_t, cb < BT)
            A_rk = load_rows(Ark, tok, i_h, H, BT, cb, m_t, cb < BT)
            tl.store(h + ((c0 + i_t) * H + i_h).to(tl.int64) * K * V + s_off, cast_for(h, S), mask=m_kv)
            store_cols(U, UT, tok, i_h, H, V, cv, m_t, m_v)
            oT = tl.dot(St, r_decT, input_precision=PREC) + tl.dot(UT, tl.trans(A_rb), input_precision=PREC) \
                + tl.dot(vT, tl.trans(A_rk), input_precision=PREC)
            store_cols(o, oT * scale, tok, i_h, H, V, cv, m_t, m_v)
        S = S_next + tl.dot(b_endT, tl.trans(UT), input_precision=PREC)
    if BLOCKED:
        if not OUT:
            tl.store(Sb + block_base + s_off, S, mask=m_kv)
            tl.store(Mb + (tl.program_id(0) * H + i_h).to(tl.int64) * K * K + ck[:, None] * K + cs[None, :], S,
                     mask=m_k[:, None] & (cs < K)[None, :])
    elif STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _block_scan(cu, block_offsets, Mb, Nb, s0, Sb, s_end, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                HAS_S0: tl.constexpr, STORE_END: tl.constexpr, PREC: tl.constexpr):
    """The sequential part of a blocked scan: per sequence, head and V tile, S <- M_j S + N_j over the blocks of
    BL tokens (one product per block), storing the state entering each block in Sb. REVERSE runs the backward's
    recursion dS <- M_j^T dS + R_j from the last block to the first (Sb: the gradient at each block's end)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu + i_n)
    eos = tl.load(cu + i_n + 1)
    b0 = tl.load(block_offsets + i_n)
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_kv = m_k[:, None] & (cv < V)[None, :]
    s_off = ck[:, None] * V + cv[None, :]
    m_kk = m_k[:, None] & m_k[None, :]
    if REVERSE:   # M^T: element [i, j] is M[j, i]
        m_off = ck[:, None] + ck[None, :] * K
    else:
        m_off = ck[:, None] * K + ck[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.).to(tl.float32)
    nb = tl.cdiv(eos - bos, BL)
    # N is only added, so the compiler does not prefetch it as it does M (a product's operand): loaded one block
    # ahead by hand, it leaves the step's critical path
    N_next = tl.load(Nb + ((b0 + (nb - 1 if REVERSE else 0)) * H + i_h).to(tl.int64) * K * V + s_off,
                     mask=m_kv & (ck[:, None] * 0 < nb), other=0.)   # (a tensor condition: the interpreter's masks)
    for j in range(nb):
        i_b = nb - 1 - j if REVERSE else j
        base = ((b0 + i_b) * H + i_h).to(tl.int64)
        i_next = i_b - 1 if REVERSE else i_b + 1
        N = N_next
        N_next = tl.load(Nb + ((b0 + i_next) * H + i_h).to(tl.int64) * K * V + s_off,
                         mask=m_kv & (ck[:, None] * 0 + j + 1 < nb), other=0.)
        tl.store(Sb + base * K * V + s_off, S, mask=m_kv)
        M = tl.load(Mb + base * K * K + m_off, mask=m_kk, other=0.)
        S = tl.dot(M, S, input_precision=PREC) + N
    if STORE_END:
        tl.store(s_end + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _chunk_u(cu, chunk_index, W, Uv, h, U, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """U = W S_0 + Uv of one chunk (and V tile) from the state entering it, as the scan stored it in h: the
    backward's U where the forward kept only the chunk states (Settings.keep_chunk_tensors). Chunks in parallel."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, eos = chunk_bounds(cu, chunk_index, i_c, BT)
    tok = t0 + tl.arange(0, BT)
    m_t = tok < eos   # all false for a spare chunk of a packed batch: nothing stored
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    # (a spare chunk's state was never written: not read, so no garbage enters the product)
    S = tl.load(h + (i_c * H + i_h).to(tl.int64) * K * V + ck[:, None] * V + cv[None, :],
                mask=m_k[:, None] & m_v[None, :] & (ck[:, None] * 0 + t0 < eos), other=0.).to(tl.float32)
    b_U = tl.dot(load_rows(W, tok, i_h, H, K, ck, m_t, m_k), S, input_precision=PREC) \
        + load_rows(Uv, tok, i_h, H, V, cv, m_t, m_v)
    store_rows(U, b_U, tok, i_h, H, V, cv, m_t, m_v)
