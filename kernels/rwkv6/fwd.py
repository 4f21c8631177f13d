"""Triton forward of chunked RWKV-6 (math and notation in README.md).

Launches:
  _fwd_scan  (one program per sequence, head and V tile, chunks in order): the state entering every chunk, stored
             as h (the output and the backward read it), and the final state; for few long sequences blocked
             instead: per block of chunks its map (all blocks at once), _block_scan over the blocks in order
             (elementwise: the transition is diagonal), then per block the fill of h from its entering state;
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

from kernels.tl_utils import (chunk_program, load_cols, load_rows, load_state, mm, pair_mask, run_sums, sequence_span,
                               spare_chunk, store_rows)


@triton.jit
def level_factors(w, rows, BS: tl.constexpr):
    """One halving level of a token-major [BT, BK] chunk of log decays (tl_utils' halving levels, blocks of BS rows):
    for a row t of a second half e^{ge_t - g_m} (the steps strictly between the block's middle row m and t), for a
    row s of a first half e^{g_m - g_s} (the steps after s up to m), and the pair mask [BT, BT]. Each exponent is a
    run sum of log decays, clamped to <= 0 against rounding; at BS = 2 both spans are empty."""
    if BS == 2:
        ones = tl.full(w.shape, 1., tl.float32)
        return ones, ones, pair_mask(rows, rows, BS)
    e_row = tl.exp(tl.minimum(run_sums(w, rows, BS // 2, True), 0.))
    e_col = tl.exp(tl.minimum(run_sums(w, rows, BS // 2, False), 0.))
    return e_row, e_col, pair_mask(rows, rows, BS)


@triton.jit
def chunk_decays(w, rows, BT: tl.constexpr):
    """Of a token-major [BT, BK] chunk of log decays: exp(ge_t) (the steps before t) and exp(g_C - g_t) (the steps
    after t), each a sum of log decays over the span itself, clamped to <= 0 against rounding."""
    before = run_sums(w, rows, BT, True)
    after = run_sums(w, rows, BT, False)
    return tl.exp(tl.minimum(before, 0.)), tl.exp(tl.minimum(after, 0.))


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
def scan_span(cu, chunk_offsets, block_index, BT: tl.constexpr, L: tl.constexpr, BLOCKED: tl.constexpr):
    """What one scan program walks: (its first token, the sequence's end, number of chunks, first global chunk). A
    whole sequence (program axis 0 = sequence), or with BLOCKED one block of L chunks of it (axis 0 = global block;
    a spare block of a packed batch gets no chunks)."""
    if BLOCKED:
        i_n = tl.load(block_index + 2 * tl.program_id(0))
        first = tl.load(block_index + 2 * tl.program_id(0) + 1) * L
        bos, eos, chunks, c0 = sequence_span(cu, chunk_offsets, i_n, BT)
        return bos + first * BT, eos, tl.minimum(chunks - first, L), c0 + first
    return sequence_span(cu, chunk_offsets, tl.program_id(0), BT)


@triton.jit
def _fwd_scan(k, v, w, cu, chunk_offsets, block_index, h0, h, ht, gb, H: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L: tl.constexpr,
              BLOCKED: tl.constexpr, STORE_H: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
              PREC: tl.constexpr):
    """S <- diag(e^{g_C}) S + (k e^{g_C - g})^T v over chunks in order, in one of three roles:
      sequence   (not BLOCKED): from h0 through a sequence's chunks, storing the state entering each chunk (h) and
                 the final state (ht);
      block map  (BLOCKED, not STORE_H): from zero through one block of L chunks: the block's end state to ht[block]
                 and its log decay (the sum of its w) to gb[block] (the transition is diagonal, so that pair is the
                 whole block map);
      block fill (BLOCKED, STORE_H): the sequence role over one block, from its entering state h0[block]."""
    bos, eos, count, c0 = scan_span(cu, chunk_offsets, block_index, BT, L, BLOCKED)
    if BLOCKED:
        if count <= 0:   # a spare block of a packed batch
            return
    i_p, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    s_off = ck[:, None] * V + cv[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    G = tl.zeros([BK], dtype=tl.float32)
    if HAS_H0:
        S = load_state(h0, (i_p * H + i_h).to(tl.int64) * K * V, ck, cv, V, m_k, m_v)
    for i in range(count):
        tok = bos + i * BT + rows
        m_t = tok < eos
        if STORE_H:
            tl.store(h + ((c0 + i) * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
        # feature-major [BK, BT]: the decay sums run along the tokens; padded tokens load w = 0, k = v = 0
        wT = load_cols(w, tok, i_h, H, K, ck, m_t, m_k)
        after = tl.cumsum(wT, axis=1, reverse=True) - wT
        k_endT = load_cols(k, tok, i_h, H, K, ck, m_t, m_k) * tl.exp(tl.minimum(after, 0.))
        b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        w_sum = tl.sum(wT, axis=1)
        G += w_sum
        S = tl.exp(w_sum)[:, None] * S + tl.dot(k_endT, b_v, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (i_p * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
    if BLOCKED:
        if not STORE_H:
            if i_v == 0:
                tl.store(gb + (i_p * H + i_h).to(tl.int64) * K + ck, G, mask=m_k)


@triton.jit
def _block_scan(block_offsets, gb, sb, s0, s_in, s_end, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr, HAS_S0: tl.constexpr,
                STORE_END: tl.constexpr):
    """The sequential part of a blocked scan, per sequence, head and V tile: S <- diag(e^{gb_j}) S + sb_j over the
    sequence's blocks (last to first with REVERSE), storing the state entering each block in s_in; no product, the
    block maps being diagonal."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b0 = tl.load(block_offsets + i_n)
    count = tl.load(block_offsets + i_n + 1) - b0
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    s_off = ck[:, None] * V + cv[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        S = load_state(s0, (i_n * H + i_h).to(tl.int64) * K * V, ck, cv, V, m_k, m_v)
    for j in range(count):
        if REVERSE:
            b = b0 + count - 1 - j
        else:
            b = b0 + j
        base = (b * H + i_h).to(tl.int64)
        tl.store(s_in + base * K * V + s_off, S, mask=m_kv)
        g = tl.load(gb + base * K + ck, mask=m_k, other=0.)
        S = tl.exp(tl.minimum(g, 0.))[:, None] * S + load_state(sb, base * K * V, ck, cv, V, m_k, m_v)
    if STORE_END:
        tl.store(s_end + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _fwd_out(r, k, v, w, u, h, o, a, cu, chunk_index, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr, BF16: tl.constexpr,
             PREC: tl.constexpr):
    if spare_chunk(cu, chunk_index, BT):
        return
    i_c, i_h, _, rows, tok, m_t, ck, m_k = chunk_program(cu, chunk_index, BT, BK, K)
    b_r = load_rows(r, tok, i_h, H, K, ck, m_t, m_k)
    b_k = load_rows(k, tok, i_h, H, K, ck, m_t, m_k)
    b_w = load_rows(w, tok, i_h, H, K, ck, m_t, m_k)
    b_u = tl.load(u + i_h * K + ck, mask=m_k, other=0.).to(tl.float32)
    A = pairwise(b_r, b_k, b_w, b_u, rows, LEVELS, BF16, PREC)
    # kept for the backward's dv = A^T do (one fp32 [BT, BT] per chunk and head: cheaper than forming it again)
    tl.store(a + (i_c * H + i_h).to(tl.int64) * BT * BT + rows[:, None] * BT + rows[None, :], A)
    e_before, _ = chunk_decays(b_w, rows, BT)
    r_dec = b_r * e_before
    h_base = (i_c * H + i_h).to(tl.int64) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        S0 = load_state(h, h_base, ck, cv, V, m_k, m_v)
        b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
        b_o = mm(r_dec, S0, BF16, PREC) + mm(A, b_v, BF16, PREC)
        store_rows(o, b_o * scale, tok, i_h, H, V, cv, m_t, m_v)
