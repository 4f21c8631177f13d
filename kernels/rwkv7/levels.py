"""One level of the pairwise decomposition of a chunk, shared by the forward and backward kernels.

At the level with blocks of BS rows, the pairs are (t in a block's second half, s in its first half); both factor
through the block's reference row m (the last row of the first half): exp(g_t - g_m) * exp(g_m - g_s), both <= 0.
The token-major helpers (_fwd_prep) return the half masks and the pair mask [BT, BT] (t, s) (`pair_mask`; the
feature-major one, for _bwd_chunk, the half masks only: that kernel masks its pairs at the paired width), and either

  level_split:  g_m, gathered with an exact one-hot fp32 product; the caller differences it against the chunk-long
                cumulative sums g, ge (LEVEL_SUMS = False, forward only), or
  level_sums*:  the log decays themselves, summed over the half block between the two rows (a reshape and a
                cumulative sum; only the steps between the rows enter the sum): g_t - g_m and ge_t - g_m (second-half
                rows), g_m - g_s (first-half rows). The default (LEVEL_SUMS in __init__.py): ptxas lowers the
                one-hot product to FMA loops that hold many registers, and with the register cap on _fwd_prep the
                sums were faster on an H100 (5.49 against 5.58 ms fwd+bwd at B=8 T=4096).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pair_mask(rows, cols, BS: tl.constexpr):
    return ((rows[:, None] // BS) == (cols[None, :] // BS)) & ((rows[:, None] % BS) >= BS // 2) \
        & ((cols[None, :] % BS) < BS // 2)


@triton.jit
def level_split(g, rows, cols, BS: tl.constexpr):
    """Token-major tiles ([BT, BK]): g at each row's reference row, half masks [BT, 1], pair mask."""
    ref = (rows // BS) * BS + BS // 2 - 1
    onehot = tl.where(ref[:, None] == cols[None, :], 1., 0.)
    g_ref = tl.dot(onehot, g, input_precision="ieee")
    second = ((rows % BS) >= BS // 2)[:, None]
    first = ((rows % BS) < BS // 2)[:, None]
    return g_ref, second, first, pair_mask(rows, cols, BS)


@triton.jit
def level_sums(w, rows, cols, BT: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """Token-major tiles ([BT, BK]): (g_t - g_m, ge_t - g_m, g_m - g_s) summed from w, half masks, pair mask."""
    HALF: tl.constexpr = BS // 2
    w3 = tl.reshape(w, [BT // HALF, HALF, BK])
    to_row = tl.reshape(tl.cumsum(w3, axis=1), [BT, BK])
    from_col = tl.reshape(tl.cumsum(w3, axis=1, reverse=True), [BT, BK]) - w
    second = ((rows % BS) >= BS // 2)[:, None]
    first = ((rows % BS) < BS // 2)[:, None]
    return to_row, to_row - w, from_col, second, first, pair_mask(rows, cols, BS)


@triton.jit
def level_sums_t(wT, rows, BT: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    """Feature-major tiles ([BK, BT]): likewise, without the pair mask."""
    HALF: tl.constexpr = BS // 2
    w3 = tl.reshape(wT, [BK, BT // HALF, HALF])
    to_row = tl.reshape(tl.cumsum(w3, axis=2), [BK, BT])
    from_col = tl.reshape(tl.cumsum(w3, axis=2, reverse=True), [BK, BT]) - wT
    second = ((rows % BS) >= BS // 2)[None, :]
    first = ((rows % BS) < BS // 2)[None, :]
    return to_row, to_row - wT, from_col, second, first
