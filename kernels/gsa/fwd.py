"""Triton forward of chunked GSA (math and notation in README.md), and the pieces the backward shares.

Launches (kernels/gsa/chunk.py), after _gate_factors (per chunk: the scans' decayed slot writes, e^{G_C}, g
slot-major):
  stored states (few sequence-heads)
    _state_scan  (per sequence, head and D tile of either state, chunks in order): H <- diag(e^{G_C}) H +
                 (s e^{G_C - G})^T X for X = k (the key state, kept as Hk^T, M x K) and X = v (the value state,
                 M x V), both in one launch; it stores the state at the start of every chunk. With REVERSE it runs
                 the backward's state-gradient recursion instead.
    _fwd_out     (per chunk and head, all chunks at once) PASS "softmax": slot logits and the softmax (both kept for
                 the backward); PASS "output": the output from the stored p and states.
  stateless (many sequence-heads: the forward stores no chunk state)
    _state_scan  the key state alone (D2 = 0), each D tile storing its part of q Hk^T instead of the state;
    _fwd_out     PASS "softmax" (logits from those parts), PASS "decayed" (A2 and p e^{G});
    _out_scan    the value state, forming each chunk's output from the state it holds instead of storing it.
Every exp() argument is a sum of log gates (<= 0) over its own span, never a difference of two cumulative sums:
e^{G_t}, e^{G_C - G_t} = e^{sum_{j>t} g_j}, and the pairwise e^{G_t - G_s} split at a middle row into two such sums.
The per-chunk kernels form these sums as products with a 0/1 matrix (span_sums, as tl_utils.run_sums), clamped to
<= 0 against rounding. Masked entries are replaced by 0 before the exp and the result by 0 after. Inputs are packed
sequences [1, T_total, H, *]; states (as the scans carry them, and as every reader upcasts them; stored for other
kernels as fp16 with scales for bf16 data, Settings.fp16_states), gates and softmax are fp32. For bf16 inputs
(Settings.bf16_products) the per-chunk kernels' products of features, pair matrices and the output's A2 take bf16
operands with fp32 accumulation (tl_utils.mm, BF16); the slot logits' gated sum, the products with a state and the
scans' keep fp32 operands (README, Numerics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import (INTERPRETED, by_chunk, chunk_program, decay_on, diag_of, exp, first_half, load_rows,
                              load_rows_raw, load_scaled_state, load_state, mm, pair_mask, second_half,
                              sequence_span, spare_chunk, store_rows, store_scaled_state)


@triton.jit
def store_split(ptr, x, tok, i_h, H: tl.constexpr, M: tl.constexpr, cm, m_t, m_m):
    """An fp32 [BT, BM] tile as two bf16 halves, hi = bf16(x) and lo = bf16(x - hi), in rows of 2M ([.., hi | lo]):
    hi + lo keeps 16 bits of x's mantissa (tf32 keeps 10), and a product of each half with bf16 data reads both
    operands from shared memory as they were loaded (tf32 products need them transposed through registers)."""
    hi = x.to(tl.bfloat16)
    store_rows(ptr, hi, tok, i_h, H, 2 * M, cm, m_t, m_m)
    store_rows(ptr + M, (x - hi.to(tl.float32)).to(tl.bfloat16), tok, i_h, H, 2 * M, cm, m_t, m_m)


@triton.jit
def split_dot(ptr, x, tok, i_h, H: tl.constexpr, M: tl.constexpr, cm, m_t, m_m, acc, EXACT: tl.constexpr):
    """acc + w^T x for w stored split (store_split) and x bf16 [BT, BD]: two bf16 products, fp32 accumulation.
    EXACT (the interpreter, which mis-computes bf16 products): the same in fp32."""
    hi = load_rows_raw(ptr, tok, i_h, H, 2 * M, cm, m_t, m_m)
    lo = load_rows_raw(ptr + M, tok, i_h, H, 2 * M, cm, m_t, m_m)
    if EXACT:
        x = x.to(tl.float32)
        return acc + tl.dot(tl.trans(hi.to(tl.float32)), x, input_precision="ieee") \
            + tl.dot(tl.trans(lo.to(tl.float32)), x, input_precision="ieee")
    return tl.dot(tl.trans(lo), x, tl.dot(tl.trans(hi), x, acc))


@triton.jit
def load_gates_by_chunk(gf, i_c, i_h, M: tl.constexpr, cm, m_m, rows, TT, BT: tl.constexpr):
    """The chunk's log gates g [BT, BM] from the slot-major copy (_gate_factors stores it): with the tokens
    contiguous they load as vectors along a warp's lanes; loaded from [T, H, M] (slots contiguous) a chunk's
    tokens span the warps. Padded rows and slots read 0."""
    return tl.trans(tl.load(gf + by_chunk(i_c, i_h, M, cm, rows, TT, BT), mask=m_m[:, None], other=0.))


@triton.jit
def chunk_state(ptr, scales, base, rows, cols, c0, D: tl.constexpr, m_r, m_c, SC: tl.constexpr):
    """The fp32 [BM, BD] tile (columns cols = c0 + arange(BD)) of a chunk state (_state_scan): fp32, or fp16 with
    scales (Settings.fp16_states)."""
    if scales is None:
        x = load_state(ptr, base, rows, cols, D, m_r, m_c)
    else:
        x = load_scaled_state(ptr, scales, base, rows, c0, D, cols.shape[0], SC, m_r)
    return x


@triton.jit
def span_sums(b_g, pick):
    """pick @ g, clamped to <= 0: for each row t of a token-major [BT, BM] tile of log gates, the sum of the gates
    over its span (pick [BT, BT], 0/1: row t's span of the chunk's rows). A product as in tl_utils.run_sums, g split
    into bf16 high and low halves (16 significant bits, exact partial products, fp32 accumulation; exact fp32 under
    the interpreter): every exponent is a sum of gates <= 0 over its own span, never a difference of two cumulative
    sums, and clamped to <= 0 against rounding."""
    if INTERPRETED:
        return tl.minimum(tl.dot(pick, b_g, input_precision="ieee"), 0.)
    hi = b_g.to(tl.bfloat16)
    lo = (b_g - hi.to(tl.float32)).to(tl.bfloat16)
    pick = pick.to(tl.bfloat16)
    return tl.minimum(tl.dot(pick, hi, tl.dot(pick, lo)), 0.)


@triton.jit
def from_start(b_g, rows):
    """G_t = sum_{j<=t} g_j (span_sums: the decay from the chunk's start through row t)."""
    return span_sums(b_g, tl.where(rows[None, :] <= rows[:, None], 1., 0.))


@triton.jit
def to_end(b_g, rows):
    """E_t = sum_{j>t} g_j (span_sums: the decay after row t to the chunk's end)."""
    return span_sums(b_g, tl.where(rows[None, :] > rows[:, None], 1., 0.))


@triton.jit
def level(b_g, rows, cols, BS: tl.constexpr):
    """One level of the pairwise decomposition (tl_utils): blocks of BS rows, pairs (t in a block's second half, s
    in its first half) factor through the block's middle as e^{sum_{r<j<=t} g_j} e^{sum_{s<j<=r} g_j} (r: the first
    half's last row). A row reads the first factor if it lies in a second half, the second if in a first half, so
    both come from one span_sums (rows j of t's own half, j <= t or j > t). Returns the row factor, the column
    factor and the pair mask."""
    HALF: tl.constexpr = BS // 2
    second = second_half(rows, BS)[:, None]
    first = first_half(rows, BS)[:, None]
    pair = pair_mask(rows, cols, BS)
    if HALF == 1:   # pairs of neighbours: the row factor is e^{g_t}, the column factor 1
        return decay_on(second, b_g), tl.where(first, 1., 0.) + tl.zeros_like(b_g), pair
    same = (rows[:, None] // HALF) == (cols[None, :] // HALF)
    upto = cols[None, :] <= rows[:, None]
    e = exp(span_sums(b_g, tl.where(same & (upto == second), 1., 0.)))
    return tl.where(second, e, 0.), tl.where(first, e, 0.), pair


@triton.jit
def gated_sum(Y, A, X, b_g, rows, cols, LEVELS: tl.constexpr, PREC: tl.constexpr):
    """Y[t, m] + sum_{s<=t} A[t, s] e^{G[t,m] - G[s,m]} X[s, m]. A's upper triangle is never read. Products with
    fp32 operands whatever the inputs: this forms the slot logits Zr and, in the backward, dP, and the softmax turns
    an absolute error of a logit into a relative error of p (bf16 operands here took dq, ds and dg past 5e-3)."""
    BT: tl.constexpr = A.shape[0]
    Y += diag_of(A, rows, cols)[:, None] * X
    for lvl in tl.static_range(LEVELS):
        e_row, e_col, pair = level(b_g, rows, cols, BT >> lvl)
        Y += e_row * tl.dot(tl.where(pair, A, 0.), X * e_col, input_precision=PREC)
    return Y


@triton.jit
def pair_matrix(X, Y, b_g, rows, cols, LEVELS: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr):
    """A[t, s] = sum_m X[t, m] Y[s, m] e^{G[t,m] - G[s,m]} on s <= t, 0 above the diagonal."""
    BT: tl.constexpr = X.shape[0]
    A = tl.where(rows[:, None] == cols[None, :], tl.sum(X * Y, axis=1)[:, None], 0.)
    for lvl in tl.static_range(LEVELS):
        e_row, e_col, pair = level(b_g, rows, cols, BT >> lvl)
        A += tl.where(pair, mm(X * e_row, tl.trans(Y * e_col), BF16, PREC), 0.)
    return A


@triton.jit
def slot_logits(q, k, hk, hk_sc, hbase, b_s, b_g, tok, i_h, m_t, rows, cols, cm, m_m,
                H: tl.constexpr, K: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BM: tl.constexpr, LEVELS: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr, SC: tl.constexpr,
                zp=None, NZP: tl.constexpr = 0):
    """Unscaled slot logits Zr = q Hk_t of a chunk ([BT, BM]) and A1 = q k^T: the chunk-start state Hk^T (M x K)
    decayed to each row plus the chunk's own writes. NZP > 0 (stateless forward): q Hk^T comes as the key scan's
    NZP parts in zp (scan_tile's LOGITS) instead of from the state."""
    A1 = tl.zeros([BT, BT], dtype=tl.float32)
    QH = tl.zeros([BT, BM], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        ck = i_k * BK + tl.arange(0, BK)
        m_k = ck < K
        b_q = load_rows(q, tok, i_h, H, K, ck, m_t, m_k)
        b_k = load_rows(k, tok, i_h, H, K, ck, m_t, m_k)
        A1 += mm(b_q, tl.trans(b_k), BF16, PREC)
        if NZP == 0:
            b_h = chunk_state(hk, hk_sc, hbase, cm, ck, i_k * BK, K, m_m, m_k, SC)
            QH += tl.dot(b_q, tl.trans(b_h), input_precision=PREC)
    if NZP == 0:
        return gated_sum(exp(from_start(b_g, rows)) * QH, A1, b_s, b_g, rows, cols, LEVELS, PREC), A1
    # the parts loaded after the chunk's own writes are summed (fewer registers live through the levels)
    Zr = gated_sum(QH, A1, b_s, b_g, rows, cols, LEVELS, PREC)
    m_tm = m_t[:, None] & m_m[None, :]
    for i in tl.static_range(NZP):   # (in order: the same sum every run; each part through a no-op select, as
        # _fwd_out's p, so that all parts' loads are issued before their layout conversions)
        QH += tl.where(m_tm, load_rows(zp + i * M, tok, i_h, H, NZP * M, cm, m_t, m_m), 0.)
    return Zr + exp(from_start(b_g, rows)) * QH, A1


@triton.jit
def slot_softmax(Z, m_t, m_m):
    """Softmax over the M valid slots in fp32; padded slots and rows give 0 (they never meet an inf)."""
    Z = tl.where(m_m[None, :], Z, float("-inf"))
    E = exp(Z - tl.max(Z, axis=1)[:, None])
    P = E / tl.sum(E, axis=1)[:, None]
    return tl.where(m_t[:, None] & m_m[None, :], P, 0.)


@triton.jit
def chunk_decay(egc, c, i_h, H: tl.constexpr, M: tl.constexpr, cm, mask):
    """e^{G_C} of global chunk c and head i_h ([BM]; 1 outside the mask: a chunk past the sequence's end leaves the
    state as it is)."""
    return tl.load(egc + (c * H + i_h).to(tl.int64) * M + cm, mask=mask, other=1.)


@triton.jit
def scan_tile(w, egc, x, cu, chunk_offsets, h0, hs, hsc, ht, i_n, i_h, i_d,
              H: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
              BD: tl.constexpr, REVERSE: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
              PREC: tl.constexpr, SPLIT: tl.constexpr, EXACT: tl.constexpr, pe=None, a2=None, o=None,
              OUT: tl.constexpr = False, q=None, zp=None, LOGITS: tl.constexpr = False):
    """One [BM, BD] tile of one state, all of a sequence's chunks in order. The weights w come with their decays
    applied (fp32, from _gate_factors or _bwd_dz) and e^{G_C} per chunk from `egc`, so that the sequential loop
    forms no cumulative sum and no exp.
    Forward:  stores H at each chunk start, then H <- diag(e^{G_C}) H + w^T x           (w = s e^{G_C - G}).
    REVERSE:  stores dH at each chunk end,  then dH <- diag(e^{G_C}) dH + w^T x         (chunks last to first;
              w = scale dZ e^{G} with x = q, or w = p e^{G} with x = do).
    SPLIT:    (x bf16) w comes split in bf16 halves (store_split): the step's product is two bf16 products of
              operands straight from shared memory; fp32 x takes one tf32 product.
    OUT:      (forward, the value state) instead of storing H, forms the chunk's output tile from it,
              o = (p e^{G}) H + A2 x, and stores that: `pe` and `a2` come from _fwd_out's PASS "decayed".
    LOGITS:   (forward, the key state Hk^T alone) instead of storing H, forms this tile's part of the slot logits'
              inter-chunk term, q_tile H^T ([BT, BM]), and stores it at slots [i_d M, (i_d + 1) M) of the rows of
              zp ([T, H, tiles x M]); _fwd_out sums the tiles' parts."""
    bos, eos, nt, c0 = sequence_span(cu, chunk_offsets, i_n, BT)
    rows = tl.arange(0, BT)
    cm = tl.arange(0, BM)
    m_m = cm < M
    cd = i_d * BD + tl.arange(0, BD)
    m_d = cd < D
    m_md = m_m[:, None] & m_d[None, :]
    s_off = cm[:, None] * D + cd[None, :]
    S = tl.zeros([BM, BD], dtype=tl.float32)
    if HAS_H0:
        S = load_state(h0, (i_n * H + i_h).to(tl.int64) * M * D, cm, cd, D, m_m, m_d)
    # e^{G_C} only scales the state, so the compiler does not prefetch it: loaded a chunk ahead by hand, into its
    # register only after the value there was used (a load into a register still in use made ptxas copy it at the
    # end of each step, waiting for the load), and before the step's state store, which the compiler does not move
    # a load across (the pointers might alias)
    e_GC = chunk_decay(egc, c0 + (nt - 1 if REVERSE else 0), i_h, H, M, cm, m_m & (cm * 0 < nt))
    for j in range(nt):
        if REVERSE:
            i_t = nt - 1 - j
            i_next = i_t - 1
        else:
            i_t = j
            i_next = i_t + 1
        tok = bos + i_t * BT + rows
        m_t = tok < eos
        if not SPLIT:
            b_w = load_rows(w, tok, i_h, H, M, cm, m_t, m_m)
        acc = e_GC[:, None] * S
        e_GC = chunk_decay(egc, c0 + i_next, i_h, H, M, cm, m_m & (cm * 0 + j + 1 < nt))
        if LOGITS:
            b_q = load_rows(q, tok, i_h, H, D, cd, m_t, m_d)
            store_rows(zp + i_d * M, tl.dot(b_q, tl.trans(S), input_precision=PREC), tok, i_h, H,
                       ((D + BD - 1) // BD) * M, cm, m_t, m_m)
        elif not OUT:
            if hsc is not None:   # fp16 with a scale per row of the tile (tl_utils.store_scaled_state)
                store_scaled_state(hs, hsc, ((c0 + i_t) * H + i_h).to(tl.int64) * M * D, cm, cd, S, D, BD, i_d, m_m,
                                   m_d)
            else:
                tl.store(hs + ((c0 + i_t) * H + i_h).to(tl.int64) * M * D + s_off, S, mask=m_md)
        b_x = load_rows_raw(x, tok, i_h, H, D, cd, m_t, m_d)
        if OUT:
            b_o = tl.dot(load_rows(pe, tok, i_h, H, M, cm, m_t, m_m), S, input_precision=PREC)
            b_o = tl.dot(load_rows(a2, tok, i_h, H, BT, rows, m_t, rows < BT), b_x.to(tl.float32), b_o,
                         input_precision=PREC)
            store_rows(o, b_o, tok, i_h, H, D, cd, m_t, m_d)
        if SPLIT:
            S = split_dot(w, b_x, tok, i_h, H, M, cm, m_t, m_m, acc, EXACT)
        else:
            S = acc + tl.dot(tl.trans(b_w), b_x.to(tl.float32), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * M * D + s_off, S, mask=m_md)


@triton.jit
def _state_scan(w1, x1, h01, hs1, sc1, ht1, w2, x2, h02, hs2, sc2, ht2, egc, cu, chunk_offsets, q, zp,
                H: tl.constexpr, M: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, BT: tl.constexpr,
                BM: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr, HAS_H0: tl.constexpr,
                STORE_HT: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, EXACT: tl.constexpr,
                LOGITS: tl.constexpr):
    """Both states of GSA in one launch (they share the gates): the third grid axis runs over the D tiles of the
    first state, then of the second. Each scan is a chain of dependent steps, too few programs to fill the GPU
    alone; launched together the two run side by side instead of one after the other. D2 = 0: the first only
    (LOGITS: the key state, forming the slot logits' parts in zp from q instead of storing it; scan_tile)."""
    i_n, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n1 = tl.cdiv(D1, BD)
    if i_d < n1:
        scan_tile(w1, egc, x1, cu, chunk_offsets, h01, hs1, sc1, ht1, i_n, i_h, i_d,
                  H, M, D1, BT, BM, BD, REVERSE, HAS_H0, STORE_HT, PREC, SPLIT, EXACT, q=q, zp=zp, LOGITS=LOGITS)
    elif D2 > 0:
        scan_tile(w2, egc, x2, cu, chunk_offsets, h02, hs2, sc2, ht2, i_n, i_h, i_d - n1,
                  H, M, D2, BT, BM, BD, REVERSE, HAS_H0, STORE_HT, PREC, SPLIT, EXACT)


@triton.jit
def _out_scan(w, x, h0, ht, egc, cu, chunk_offsets, pe, a2, o,
              H: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
              BD: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
              SPLIT: tl.constexpr, EXACT: tl.constexpr):
    """(stateless forward) The value-state scan, which forms the output from each chunk-start state instead of
    storing the state (scan_tile's OUT): it runs after the key-state scan and _fwd_out's PASS "decayed" (p e^{G},
    A2)."""
    i_n, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    scan_tile(w, egc, x, cu, chunk_offsets, h0, None, None, ht, i_n, i_h, i_d, H, M, D, BT, BM, BD, False, HAS_H0,
              STORE_HT, PREC, SPLIT, EXACT, pe, a2, o, True)


@triton.jit
def _gate_factors(s, g, cu, chunk_index, sE, egc, gf, TT,
                  H: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr):
    """Per chunk: the forward scans' slot writes decayed to the chunk's end, s e^{sum_{j>t} g_j} (split in bf16
    halves with SPLIT), and e^{G_C}, so that the scans' sequential loops only load them; and g slot-major
    (tl_utils.by_chunk) for the per-chunk kernels. Both loads are issued before either is used, s first (the
    compiler places g's shared-memory conversion right after g's load, and a load after that waited behind it); a
    spare chunk of a packed batch runs with all-false token masks instead of returning early: it stores zeros into
    its own columns of gf and ones into its own e^{G_C}, which no other program reads."""
    i_c, i_h, eos, rows, tok, m_t, cm, m_m = chunk_program(cu, chunk_index, BT, BM, M)
    x_s = load_rows_raw(s, tok, i_h, H, M, cm, m_t, m_m)
    b_g = load_rows_raw(g, tok, i_h, H, M, cm, m_t, m_m)   # (fp32) padded rows read 0
    b_sE = x_s.to(tl.float32) * exp(to_end(b_g, rows))
    tl.store(gf + tl.trans(by_chunk(i_c, i_h, M, cm, rows, TT, BT)), b_g, mask=m_m[None, :])
    if SPLIT:
        store_split(sE, b_sE, tok, i_h, H, M, cm, m_t, m_m)
    else:
        store_rows(sE, b_sE, tok, i_h, H, M, cm, m_t, m_m)
    tl.store(egc + (i_c * H + i_h).to(tl.int64) * M + cm, exp(tl.sum(b_g, axis=0)), mask=m_m)


@triton.jit
def _fwd_out(q, k, v, s, g, cu, chunk_index, hk, hv, hk_sc, hv_sc, o, p_out, z_out, a1_out, a2_out, pe_out, zp,
             scale, TT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, M: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, LEVELS: tl.constexpr, BF16: tl.constexpr,
             PREC: tl.constexpr, PASS: tl.constexpr, NZP: tl.constexpr, SC: tl.constexpr):
    """Per chunk, g slot-major (load_gates_by_chunk). Two launches, so that fewer registers are live in each:
    PASS "softmax": the slot logits Zr, the softmax p and A1 = q k^T, kept for the backward;
    PASS "output":  (stored states) A2 (p against s, kept for the backward) and the output, from p;
    PASS "decayed": (stateless forward) A2 and p e^{G} (pe_out, fp32 [T, H, M]) from p, for _out_scan, which forms
                    the output.
    NZP > 0: q Hk^T comes in NZP parts from the key scan (zp; scan_tile's LOGITS), hk is not read.
    A1 and A2 are [T, H, BT]: row t of the chunk's tile. Every store is masked by the token mask: PASS "decayed",
    which reads no chunk state, runs a spare chunk of a packed batch with all-false masks instead of returning."""
    if PASS != "decayed":   # a spare program of a packed batch (kernels.utils.chunk_tables): its chunk's states
        if spare_chunk(cu, chunk_index, BT):   # were never written
            return
    i_c, i_h, eos, rows, tok, m_t, cm, m_m = chunk_program(cu, chunk_index, BT, BM, M)
    cols = tl.arange(0, BT)
    hbase = (i_c * H + i_h).to(tl.int64) * M
    if PASS == "softmax":
        b_s = load_rows(s, tok, i_h, H, M, cm, m_t, m_m)
        b_g = load_gates_by_chunk(g, i_c, i_h, M, cm, m_m, rows, TT, BT)
        Zr, A1 = slot_logits(q, k, hk, hk_sc, hbase * K, b_s, b_g, tok, i_h, m_t, rows, cols, cm, m_m,
                             H, K, M, BT, BK, BM, LEVELS, BF16, PREC, SC, zp, NZP)
        P = slot_softmax(scale * Zr, m_t, m_m)
        # kept for the backward (fp32 [T, H, M]), which then needs neither Hk nor q, k before the state gradients
        store_rows(p_out, P, tok, i_h, H, M, cm, m_t, m_m)
        store_rows(z_out, Zr, tok, i_h, H, M, cm, m_t, m_m)
        store_rows(a1_out, A1, tok, i_h, H, BT, cols, m_t, cols < BT)
    else:
        # a gated linear attention read by P: o_t = (p_t e^{G_t}) Hv_0 + sum_{s<=t} A2[t, s] v_s
        # s, p and g issued together; p through a select that changes nothing (masked loads give 0), which keeps
        # its layout conversion (a shared-memory round trip with a barrier, which no later load passes) at its
        # first use instead of right after its load
        x_s = load_rows_raw(s, tok, i_h, H, M, cm, m_t, m_m)
        P = load_rows_raw(p_out, tok, i_h, H, M, cm, m_t, m_m)
        b_g = load_gates_by_chunk(g, i_c, i_h, M, cm, m_m, rows, TT, BT)
        b_s = x_s.to(tl.float32)
        P = tl.where(m_t[:, None] & m_m[None, :], P, 0.)
        A2 = pair_matrix(P, b_s, b_g, rows, cols, LEVELS, BF16, PREC)
        store_rows(a2_out, A2, tok, i_h, H, BT, cols, m_t, cols < BT)
        Pe = P * exp(from_start(b_g, rows))
        if PASS == "decayed":
            store_rows(pe_out, Pe, tok, i_h, H, M, cm, m_t, m_m)
        else:
            for i_v in range(tl.cdiv(V, BV)):
                cv = i_v * BV + tl.arange(0, BV)
                m_v = cv < V
                b_v = load_rows(v, tok, i_h, H, V, cv, m_t, m_v)
                b_h = chunk_state(hv, hv_sc, hbase * V, cm, cv, i_v * BV, V, m_m, m_v, SC)
                b_o = tl.dot(Pe, b_h, input_precision=PREC) \
                    + mm(A2, b_v, BF16, PREC)
                store_rows(o, b_o, tok, i_h, H, V, cv, m_t, m_v)
