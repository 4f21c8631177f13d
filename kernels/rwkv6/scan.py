"""The sequential part of chunked RWKV-6, forward and backward (math in README.md).

Launches (each per sequence, head and V tile; with blocked scans _scan per block of chunks):
  _scan        S <- diag(e^{g_C}) S + scale (x e^{span})^T y over the chunks. Forward (chunks in order): x = k, y = v,
               the span the steps after each token (g_C - g), scale 1: the state entering every chunk (h) and the
               final state. Backward (REVERSE, chunks last to first): x = r, y = do, the span the steps before each
               token (ge), the output's scale: the state gradient at every chunk's end (dh) and at the start (dh0).
               For few long sequences blocked instead: per block of chunks its map (all blocks at once),
               _block_scan over the blocks, then per block the fill of h or dh from the state entering it;
  _block_scan  the blocks in walk order, elementwise (the transition is diagonal).
Every exp() argument is a sum of log decays over a span of steps, clamped to <= 0 against rounding. The states are
fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tl_utils import exp, load_cols, load_rows, load_state, sequence_span


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
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A scan program's [BK, BV] tile of a [K, V] state, V tile i_v: its K and V indices and their masks, and its
    element offsets and mask within the state."""
    ck = tl.arange(0, BK)
    m_k = ck < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    return ck, m_k, cv, m_v, ck[:, None] * V + cv[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def _scan(x, y, w, cu, chunk_offsets, block_index, s_first, s_chunk, s_last, gb, scale, H: tl.constexpr,
          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L: tl.constexpr,
          REVERSE: tl.constexpr, BLOCKED: tl.constexpr, STORE_CHUNK: tl.constexpr, HAS_FIRST: tl.constexpr,
          STORE_LAST: tl.constexpr, PREC: tl.constexpr):
    """S <- diag(e^{g_C}) S + (x e^{span})^T y over chunks in order, the span of token t the steps after it in its
    chunk (g_C - g_t); with REVERSE over chunks last to first, the span the steps before t (ge_t), and the product
    times scale. In one of three roles:
      sequence   (not BLOCKED): from s_first (or zero) through a sequence's chunks, storing the state on entering
                 each chunk at its index in s_chunk (h; with REVERSE dh, the gradient at the chunk's end) and the
                 state after the last one in s_last (ht; with REVERSE dh0);
      block map  (BLOCKED, not STORE_CHUNK): from zero through one block of L chunks: its last state to s_last[block]
                 and its log decay (the sum of its w) to gb[block] (the transition is diagonal, so that pair is the
                 whole block map);
      block fill (BLOCKED, STORE_CHUNK): the sequence role over one block, from its entering state s_first[block]."""
    bos, eos, count, c0 = scan_span(cu, chunk_offsets, block_index, BT, L, BLOCKED)
    if BLOCKED:
        if count <= 0:   # a spare block of a packed batch
            return
    i_p, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BT)
    ck, m_k, cv, m_v, s_off, m_kv = state_tile(i_v, K, V, BK, BV)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    G = tl.zeros([BK], dtype=tl.float32)
    if HAS_FIRST:
        S = load_state(s_first, (i_p * H + i_h).to(tl.int64) * K * V, ck, cv, V, m_k, m_v)
    for j in range(count):
        if REVERSE:
            i = count - 1 - j
        else:
            i = j
        tok = bos + i * BT + rows
        m_t = tok < eos
        if STORE_CHUNK:
            tl.store(s_chunk + ((c0 + i) * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
        # feature-major [BK, BT]: the decay sums run along the tokens; padded tokens load w = 0, x = y = 0
        wT = load_cols(w, tok, i_h, H, K, ck, m_t, m_k)
        if REVERSE:
            span = tl.cumsum(wT, axis=1) - wT
        else:
            span = tl.cumsum(wT, axis=1, reverse=True) - wT
        x_decT = load_cols(x, tok, i_h, H, K, ck, m_t, m_k) * exp(tl.minimum(span, 0.))
        b_y = load_rows(y, tok, i_h, H, V, cv, m_t, m_v)
        w_sum = tl.sum(wT, axis=1)
        G += w_sum
        # the decay before the product: in the other order the reverse builds take 5 more registers on sm_90
        S = exp(w_sum)[:, None] * S
        xy = tl.dot(x_decT, b_y, input_precision=PREC)
        if REVERSE:   # the forward's scale is 1: no multiply
            xy = scale * xy
        S += xy
    if STORE_LAST:
        tl.store(s_last + (i_p * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
    if BLOCKED:
        if not STORE_CHUNK:
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
    ck, m_k, cv, m_v, s_off, m_kv = state_tile(i_v, K, V, BK, BV)
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
        S = exp(tl.minimum(g, 0.))[:, None] * S + load_state(sb, base * K * V, ck, cv, V, m_k, m_v)
    if STORE_END:
        tl.store(s_end + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)
