"""Triton helpers shared by the chunked kernels (rwkv7, rwkv6, gsa): row loads and stores of packed [T, H, D]
tensors, the chunk and scan prologues, the halving levels of the pairwise decays, sums of log decays over spans of
a chunk as products (`run_sums`), and the masked exp of a decay (`decay_on`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.utils import is_interpreting

# Under Triton's interpreter bf16 casts truncate and bf16 tl.dot comes out wrong: the stores below and mm emulate what
# the GPU computes (round to nearest even), and the run sums take exact fp32 products there.
INTERPRETED: tl.constexpr = tl.constexpr(is_interpreting())


@triton.jit
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32: what the GPU's conversion gives."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_for(ptr, x):
    """x in ptr's element type, rounded to nearest as on the GPU (under the interpreter too)."""
    if INTERPRETED:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = round_bf16(x.to(tl.float32))
    return x.to(ptr.dtype.element_ty)


@triton.jit
def load_rows_raw(ptr, tok, i_h, H: tl.constexpr, D: tl.constexpr, cols, m_t, m_c):
    """[BT, BD] rows `tok` of head i_h from a [T, H, D] tensor, in its own dtype (zeros outside the masks)."""
    p = ptr + (tok[:, None].to(tl.int64) * H + i_h) * D + cols[None, :]
    return tl.load(p, mask=m_t[:, None] & m_c[None, :], other=0.)


@triton.jit
def load_rows(ptr, tok, i_h, H: tl.constexpr, D: tl.constexpr, cols, m_t, m_c):
    """load_rows_raw as fp32."""
    return load_rows_raw(ptr, tok, i_h, H, D, cols, m_t, m_c).to(tl.float32)


@triton.jit
def store_rows(ptr, x, tok, i_h, H: tl.constexpr, D: tl.constexpr, cols, m_t, m_c):
    p = ptr + (tok[:, None].to(tl.int64) * H + i_h) * D + cols[None, :]
    tl.store(p, cast_for(ptr, x), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def load_cols(ptr, tok, i_h, H: tl.constexpr, D: tl.constexpr, feats, m_t, m_f):
    """[BD, BT]: the same rows as load_rows, transposed (feature-major). A product whose output has 16 token rows
    leaves most of 4 warps idle and copies its left operand into every warp; the same product transposed has 64
    feature rows (M = 64), which the tensor cores take whole."""
    p = ptr + (tok[None, :].to(tl.int64) * H + i_h) * D + feats[:, None]
    return tl.load(p, mask=m_f[:, None] & m_t[None, :], other=0.).to(tl.float32)


@triton.jit
def store_cols(ptr, x, tok, i_h, H: tl.constexpr, D: tl.constexpr, feats, m_t, m_f):
    p = ptr + (tok[None, :].to(tl.int64) * H + i_h) * D + feats[:, None]
    tl.store(p, cast_for(ptr, x), mask=m_f[:, None] & m_t[None, :])


@triton.jit
def by_chunk(i_c, i_h, D: tl.constexpr, feats, rows, TT, BT: tl.constexpr):
    """[BD, BT] offsets of chunk i_c in a feature-major copy by chunk, [H, D, TT] with TT = chunks x BT: the chunk's
    tokens at columns i_c BT + rows (padded rows hold 0), so every chunk starts 16-byte aligned and its tokens load
    and store as vectors, along a warp's lanes (RWKV-7's w, GSA's g: kernels whose sums run over a chunk's tokens)."""
    return (i_h * D + feats[:, None]).to(tl.int64) * TT + (i_c * BT + rows)[None, :]


@triton.jit
def chunk_bounds(cu, chunk_index, i_c, BT: tl.constexpr):
    """First token of global chunk i_c and the end of its sequence (chunks never straddle two sequences)."""
    i_n = tl.load(chunk_index + 2 * i_c)
    i_t = tl.load(chunk_index + 2 * i_c + 1)
    return tl.load(cu + i_n) + i_t * BT, tl.load(cu + i_n + 1)


@triton.jit
def spare_chunk(cu, chunk_index, BT: tl.constexpr):
    """True for a spare program of a packed batch (kernels.utils.chunk_tables launches an upper bound of chunks):
    its chunk starts at or past its sequence's end. Per-chunk kernels return at once there, reading nothing."""
    t0, eos = chunk_bounds(cu, chunk_index, tl.program_id(0), BT)
    return t0 >= eos


@triton.jit
def chunk_program(cu, chunk_index, BT: tl.constexpr, BD: tl.constexpr, D: tl.constexpr):
    """The prologue of a per-chunk program (grid: chunks x heads) on [BT, BD] tiles: its chunk and head, the end of
    its sequence, row offsets, token indices with their validity mask (rows past the sequence's end are padding),
    feature (or slot) offsets and their mask."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu, chunk_index, i_c, BT)
    rows = tl.arange(0, BT)
    tok = t0 + rows
    cd = tl.arange(0, BD)
    return i_c, i_h, eos, rows, tok, tok < eos, cd, cd < D


@triton.jit
def sequence_span(cu, chunk_offsets, i_n, BT: tl.constexpr):
    """The prologue of a scan program over sequence i_n: its first token, its end, its number of chunks and its
    first global chunk."""
    bos = tl.load(cu + i_n)
    eos = tl.load(cu + i_n + 1)
    return bos, eos, tl.cdiv(eos - bos, BT), tl.load(chunk_offsets + i_n)


@triton.jit
def load_state(ptr, base, rows, cols, D: tl.constexpr, m_r, m_c):
    """[BR, BD] tile of an fp32 [R, D] state at element offset `base` (R rows always, whatever D and BD are)."""
    return tl.load(ptr + base + rows[:, None] * D + cols[None, :], mask=m_r[:, None] & m_c[None, :], other=0.)


@triton.jit
def load_scaled_state(ptr, scales, base, rows, c0, D: tl.constexpr, BD: tl.constexpr, SC: tl.constexpr, m_r):
    """The fp32 [BR, BD] tile at columns c0 + arange(BD) (c0 a multiple of BD) of a state stored by
    store_scaled_state (fp16 and a power of two per row and group of SC >= BD columns): one scale per row."""
    tl.static_assert(SC >= BD)
    cols = c0 + tl.arange(0, BD)
    x = tl.load(ptr + base + rows[:, None] * D + cols[None, :], mask=m_r[:, None] & (cols < D)[None, :], other=0.)
    NS: tl.constexpr = (D + SC - 1) // SC
    return x.to(tl.float32) * tl.load(scales + (base // D + rows) * NS + c0 // SC, mask=m_r, other=0.)[:, None]


@triton.jit
def store_scaled_state(ptr, scales, base, rows, cols, x, D: tl.constexpr, SC: tl.constexpr, i_g, m_r, m_c):
    """An fp32 [BR, SC] tile x (columns cols = group i_g of SC) of an [R, D] state as fp16 x / 2^e per row, with
    2^e (fp32) in `scales` ([R, cdiv(D, SC)] after base // D rows): e = floor(log2(row max |x|)) - 14 puts each row's
    largest value in [2^14, 2^15), so none overflows and every value down to 2^-28 of its row's largest keeps fp16's
    11 significant bits (as many as a tf32 product reads); smaller ones keep an absolute error below 2^-39 of it."""
    top = tl.max(tl.abs(x), axis=1)
    # 2^floor(log2(top)) from the exponent bits (exact; 0 for 0 and subnormals, kept >= 2^-100 so that 1/2^e stays
    # finite)
    p2 = tl.maximum((top.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True), 7.888609052210118e-31)
    NS: tl.constexpr = (D + SC - 1) // SC
    tl.store(ptr + base + rows[:, None] * D + cols[None, :], (x * (16384. / p2)[:, None]).to(tl.float16),
             mask=m_r[:, None] & m_c[None, :])
    tl.store(scales + (base // D + rows) * NS + i_g, p2 * (1. / 16384.), mask=m_r)


# The halving levels of a chunk's pairwise decays. Level by level, blocks of BS = BT, BT/2, ..., 2 rows: the pairs
# (t in a block's second half, s in its first half) factor through the block's middle, e^{G_t - G_s} =
# e^{G_t - G_m} e^{G_m - G_s}, each factor a sum of log decays over at most BS/2 steps, never a difference of two
# cumulative sums. These give the masks and the within-half sums; each op forms its factors from them.

@triton.jit
def pair_mask(rows, cols, BS: tl.constexpr):
    """[BT, BT] (t, s): t in the second half and s in the first half of the same block of BS rows."""
    return ((rows[:, None] // BS) == (cols[None, :] // BS)) & ((rows[:, None] % BS) >= BS // 2) \
        & ((cols[None, :] % BS) < BS // 2)


@triton.jit
def second_half(rows, BS: tl.constexpr):
    return (rows % BS) >= BS // 2


@triton.jit
def first_half(rows, BS: tl.constexpr):
    return (rows % BS) < BS // 2


@triton.jit
def half_cumsum(x, BT: tl.constexpr, BD: tl.constexpr, HALF: tl.constexpr, REVERSE: tl.constexpr = False):
    """Cumulative sums of a token-major [BT, BD] tile down its rows, restarting every HALF rows."""
    return tl.reshape(tl.cumsum(tl.reshape(x, [BT // HALF, HALF, BD]), axis=1, reverse=REVERSE), [BT, BD])


@triton.jit
def mm(a, b, BF16: tl.constexpr, PREC: tl.constexpr):
    """a @ b of fp32 tiles, fp32 result: with BF16 the operands rounded to bf16 (full-rate tensor cores, half the
    registers and shared memory), else fp32 operands at PREC."""
    if BF16:
        if INTERPRETED:   # the GPU's products, emulated: operands rounded to bf16 (to nearest even), exact products
            return tl.dot(round_bf16(a), round_bf16(b), input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def run_pick(rows, RUN: tl.constexpr, BEFORE: tl.constexpr):
    """[BT, BT] 0/1: [t, s] = 1 where s is in t's own run of RUN rows (runs start at multiples of RUN) and comes
    before t (BEFORE) or after it."""
    same = (rows[:, None] // RUN) == (rows[None, :] // RUN)
    if BEFORE:
        return tl.where(same & (rows[None, :] < rows[:, None]), 1., 0.)
    return tl.where(same & (rows[None, :] > rows[:, None]), 1., 0.)


@triton.jit
def run_sums(x, rows, RUN: tl.constexpr, BEFORE: tl.constexpr):
    """[BT, BD]: for each row t of a token-major fp32 tile, the sum of x over the other rows of t's own run of RUN
    rows (runs start at multiples of RUN) that come before t (BEFORE) or after it. A product with a 0/1 matrix
    instead of a scan: a scan along the rows of a tile spread over warps is shuffles and shared-memory round trips,
    the product two tensor-core ops, x split into bf16 high and low parts (16 significant bits; every partial product
    exact, fp32 accumulation); a sum of log decays (<= 0) stays a sum of non-positive terms."""
    pick = run_pick(rows, RUN, BEFORE)
    if INTERPRETED:   # the exact fp32 sums (the split is checked on the GPU)
        return tl.dot(pick, x, input_precision="ieee")
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(pick.to(tl.bfloat16), lo) + tl.dot(pick.to(tl.bfloat16), hi)


@triton.jit
def run_sums_t(xT, rows, RUN: tl.constexpr, BEFORE: tl.constexpr):
    """run_sums of a feature-major [BD, BT] tile, along its columns (the tokens)."""
    pickT = tl.trans(run_pick(rows, RUN, BEFORE))
    if INTERPRETED:
        return tl.dot(xT, pickT, input_precision="ieee")
    hi = xT.to(tl.bfloat16)
    lo = (xT - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(lo, pickT.to(tl.bfloat16)) + tl.dot(hi, pickT.to(tl.bfloat16))


@triton.jit
def diag_of(x, rows, cols):
    """Diagonal of a square register tile as a vector."""
    return tl.sum(tl.where(rows[:, None] == cols[None, :], x, 0.), axis=1)


@triton.jit
def fast_div(x, y):
    """x / y in fp32 by PTX div.approx.ftz (CUDA's __fdividef): within 2 ulp, 0 where |y| passes 2^126; Triton's
    division tests every element for that range. The interpreter divides exactly."""
    x = x.to(tl.float32)
    y = y.to(tl.float32)
    if INTERPRETED:
        return x / y
    return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def exp(x):
    """e^x in fp32, results below 2^-126 flushed to zero (PTX ex2.approx.ftz): tl.exp's ex2 keeps denormal results at
    the price of a test and two multiplies an element, a tenth of _bwd_chunk's instructions. Decay factors that small
    are zero to every sum they enter. The interpreter takes tl.exp."""
    x = x.to(tl.float32)
    if INTERPRETED:
        return tl.exp(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def decay_on(mask, diff):
    """exp(diff) where mask holds, 0 elsewhere. The argument is clamped to <= 0 (it is <= 0 mathematically wherever
    the mask holds; the clamp makes it so in floating point too), and masked entries never reach the exp: a decay
    factor can never overflow, so no inf is ever multiplied by 0."""
    return tl.where(mask, exp(tl.minimum(tl.where(mask, diff, 0.), 0.)), 0.)


@triton.jit
def head_tile(i_t, i_h, M, C: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    """Offsets [BT, BN] of tokens i_t BT.. and head i_h's channels in a [M, C] tensor ([M, H, N] alike), their mask,
    the channels and the channel mask."""
    rows = i_t * BT + tl.arange(0, BT)
    feats = tl.arange(0, BN)
    m_c = feats < N
    ch = i_h * N + feats
    offs = rows[:, None].to(tl.int64) * C + ch[None, :]
    return offs, (rows < M)[:, None] & m_c[None, :], ch, m_c
