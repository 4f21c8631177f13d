// RWKV-7's forward sequence scan in CUDA (kernels/rwkv7/scan_cuda.py compiles it with NVRTC): the work of the Triton
// _fwd_scan in its sequence role, from what _fwd_prep formed (W, Uv, A_rb, A_rk, w by chunk). Per chunk of 16 tokens,
// in order, from the state S entering it (README.md's notation):
//     U = W S + Uv,    O = scale ((r e^g) S + A_rb U + A_rk V),    S <- e^{gC} S + (k e^{gC-g})^T V + (b e^{gC-g})^T U
// One block per sequence, head and 64 value columns, two roles:
// - 4 consumer warps carry the state, 16 value columns each, transposed (ST [16 values x 64 keys] fp32) in the
//   registers of tf32 tensor-core products (mma m16n8k8) for the whole sequence. The accumulator layout of ST (and
//   of U^T) is the A-operand layout of the next product up to an order of the summed index within each group of 8
//   (row g holds columns 2q, 2q+1 where the operand wants q, q+4), so no product waits on a layout change: the B
//   operands are read from shared memory in the same permuted order.
// - 4 producer warps copy each chunk's inputs to shared memory two chunks ahead (cp.async, a ring of 3) and form
//   from them, one chunk ahead, what the consumers read besides (r e^g, k and b e^{gC-g}, e^{gC}; double buffered).
// One block-wide barrier a chunk. Every exp() argument is <= 0 (g <= 0, gC - g clamped to <= 0). Shared memory bounds
// the step (all operands pass through it, two blocks share an SM), so every tile is laid out for conflict-free
// accesses (tiles.cuh: tile16, token_major, token_chunk, stage_at).
// LOGITS (a build define): the producers form w from the decay's logits z (bf16 [T, H, K], read as r is) and its bias
// as prep.cu does (tiles.cuh's log_decay), so no w by chunk is stored; else they read w by chunk (fp32, from
// _fwd_prep, where the op was given log decays).

#define KD 64                   // the key head size (scan_cuda.KD): the copies' and tiles' counts are for it alone
#define BT 16
#define VC 64                   // value columns per block
#define CONSUMERS 128           // threads of the warps that carry the state
#define PRODUCERS 128           // threads of the warps that copy and prepare the operands
#define THREADS (CONSUMERS + PRODUCERS)
#define TPK (PRODUCERS / KD)    // producer threads per key feature
#define TOK (BT / TPK)          // tokens each of them prepares
#define SW (KD + 8)             // row stride (floats) of token-major [BT, KD] tiles: conflict-free float2 reads
#define SU (VC + 4)             // row stride (floats) of the Uv tile
#define SV (VC + 8)             // row stride (bf16) of the value tile
#define STAGES 3                // chunks of inputs in shared memory: one consumed, one prepared, one arriving
#if LOGITS
#define W_PIECES (BT * KD / 8)  // 16-byte pieces of a chunk's w: the logits [t][key]
#else
#define W_PIECES (KD * BT / 4)  // w by chunk [key][t]
#endif
#define SLOTS ((W_PIECES + 3 * BT * KD / 8 + BT * KD / 4 + 2 * BT * BT / 4 + BT * VC / 4 + BT * VC / 8) / PRODUCERS)

#include "tiles.cuh"

#if LOGITS
typedef bf16 w_t;
#else
typedef float w_t;
#endif

struct Inputs {                 // one chunk's inputs as they arrive (rows past the sequence's end: zeros)
#if LOGITS
    bf16 z[BT * KD];            // [t][key] (token_chunk): the decay's logits
#else
    float w[KD * BT];           // [key][t]: the log decays (w by chunk: a chunk's tokens contiguous)
#endif
    bf16 r[BT * KD], k[BT * KD], b[BT * KD];   // [t][key] (token_chunk)
    float W[BT * SW];           // [t][key]
    float Arb[BT * BT], Ark[BT * BT];          // [t][s] (tile16)
    float Uv[BT * SU];          // [t][v] of the block's columns
    bf16 V[BT * SV];            // [t][v] of the block's columns
};

struct Formed {                 // what the producers form of a chunk, rounded to tf32
    float R[BT * SW];           // [t][key] (token_major): r e^{g}
    float K[KD * BT];           // [key][t] (tile16): k e^{gC - g}
    float B[KD * BT];           // [key][t] (tile16): b e^{gC - g}
    float eC[KD];               // e^{gC}
};

struct Shared {
    Inputs in[STAGES];
    Formed formed[2];
    bf16 stage[CONSUMERS / 32][KD * 16];   // a consumer warp's staging tile for its coalesced stores (stage_at)
};
static_assert(sizeof(Shared) == SHARED_BYTES, "scan_cuda's shared_bytes is not the size of Shared");

extern "C" __global__ void __launch_bounds__(THREADS, 2)
flame_rwkv7_fwd_scan(const bf16* __restrict__ r, const w_t* __restrict__ wf, const float* __restrict__ w_bias,
               float decay_scale, const bf16* __restrict__ k,
               const bf16* __restrict__ v, const bf16* __restrict__ b, const int* __restrict__ cu,
               const int* __restrict__ chunk_offsets, const float* __restrict__ W, const float* __restrict__ Uv,
               const float* __restrict__ Arb, const float* __restrict__ Ark, const float* __restrict__ h0,
               bf16* __restrict__ o, bf16* __restrict__ h, bf16* __restrict__ U, float* __restrict__ ht,
               float scale, int H, int V, int TT, int has_h0, int store_ht) {
    extern __shared__ __align__(16) unsigned char smem[];
    Shared& sh = *reinterpret_cast<Shared*>(smem);

    const int n = blockIdx.x, hh = blockIdx.y, tid = threadIdx.x, lane = tid & 31;
    const int v_blk = blockIdx.z * VC;
    const int bos = cu[n], eos = cu[n + 1];
    const int count = (eos - bos + BT - 1) / BT, c0 = chunk_offsets[n];

    if (tid >= CONSUMERS) {
        const int p = tid - CONSUMERS;
        // chunk c's inputs into in[c % STAGES] as 16-byte pieces, each thread the same SLOTS pieces of every chunk:
        // where a piece comes from in chunk 0 (src), how far it moves a chunk (step, bytes), where it goes in an
        // Inputs (dst, bytes) and its token row in the chunk (-1: w, whose padded rows are zeros already)
        const char* src[SLOTS];
        i64 step[SLOTS];
        unsigned dst[SLOTS];
        int row[SLOTS];
        {
            int slot = 0;
            const Inputs* in0 = nullptr;
            auto add = [&](const void* from, i64 per_chunk, const void* to, int t) {
                src[slot] = reinterpret_cast<const char*>(from);
                step[slot] = per_chunk;
                dst[slot] = (unsigned)(reinterpret_cast<const char*>(to) - reinterpret_cast<const char*>(in0));
                row[slot++] = t;
            };
            const i64 tok_k = (i64)H * KD * sizeof(bf16), tok_v = (i64)H * V;
#pragma unroll
            for (int i = 0; i < W_PIECES / PRODUCERS; i++) {
#if LOGITS                                                               // the logits: [t][key]
                const int e = p + i * PRODUCERS, t = e / (KD / 8), part = e % (KD / 8);
                add(wf + ((i64)(bos + t) * H + hh) * KD + 8 * part, BT * tok_k, in0->z + token_chunk(t, 8 * part), t);
#else                                                                    // w by chunk: [key][t]
                const int e = p + i * PRODUCERS, key = e / (BT / 4), part = e % (BT / 4);
                add(wf + (i64)(hh * KD + key) * TT + (i64)c0 * BT + 4 * part, BT * sizeof(float),
                    in0->w + key * BT + 4 * part, -1);
#endif
            }
#pragma unroll
            for (int i = 0; i < 3 * BT * KD / 8 / PRODUCERS; i++) {      // r, k, b: [t][key]
                const int e = p + i * PRODUCERS, which = e / (BT * KD / 8), t = e / (KD / 8) % BT, part = e % (KD / 8);
                const bf16* from = which == 0 ? r : which == 1 ? k : b;
                const bf16* to = which == 0 ? in0->r : which == 1 ? in0->k : in0->b;
                add(from + ((i64)(bos + t) * H + hh) * KD + 8 * part, BT * tok_k, to + token_chunk(t, 8 * part), t);
            }
#pragma unroll
            for (int i = 0; i < BT * KD / 4 / PRODUCERS; i++) {          // W
                const int e = p + i * PRODUCERS, t = e / (KD / 4), part = e % (KD / 4);
                add(W + ((i64)(bos + t) * H + hh) * KD + 4 * part, BT * 2 * tok_k, in0->W + t * SW + 4 * part, t);
            }
#pragma unroll
            for (int i = 0; i < 2 * BT * BT / 4 / PRODUCERS; i++) {      // A_rb, A_rk
                const int e = p + i * PRODUCERS, which = e / (BT * BT / 4), t = e / (BT / 4) % BT, part = e % (BT / 4);
                add((which ? Ark : Arb) + ((i64)(bos + t) * H + hh) * BT + 4 * part, (i64)BT * H * BT * sizeof(float),
                    (which ? in0->Ark : in0->Arb) + tile16(t, 4 * part), t);
            }
#pragma unroll
            for (int i = 0; i < BT * VC / 4 / PRODUCERS; i++) {          // Uv
                const int e = p + i * PRODUCERS, t = e / (VC / 4), part = e % (VC / 4);
                add(Uv + ((i64)(bos + t) * H + hh) * V + v_blk + 4 * part, BT * tok_v * sizeof(float),
                    in0->Uv + t * SU + 4 * part, t);
            }
#pragma unroll
            for (int i = 0; i < BT * VC / 8 / PRODUCERS; i++) {          // v
                const int e = p + i * PRODUCERS, t = e / (VC / 8), part = e % (VC / 8);
                add(v + ((i64)(bos + t) * H + hh) * V + v_blk + 8 * part, BT * tok_v * sizeof(bf16),
                    in0->V + t * SV + 8 * part, t);
            }
        }
        auto copy = [&](int c) {   // chunks in order: src moves a chunk on after each
            char* base = reinterpret_cast<char*>(&sh.in[c % STAGES]);
            const int rows_left = eos - bos - c * BT;
#pragma unroll
            for (int i = 0; i < SLOTS; i++) {
                copy16(base + dst[i], src[i], row[i] < rows_left);
                src[i] += step[i];
            }
        };
        // chunk c's decay factors and decayed operands, from in[c % STAGES] into formed[c % 2]: thread p takes key
        // p / TPK and TOK of its tokens; g (the inclusive cumulative log decays) over the parts before its own by
        // shuffles
        const int key = p / TPK, part = p % TPK, t0 = part * TOK;
#if LOGITS
        const float bias = w_bias[hh * KD + key];
#endif
        auto form = [&](int c) {
            const Inputs& in = sh.in[c % STAGES];
            Formed& f = sh.formed[c & 1];
            float w[TOK];
            bf16 rr[TOK], kk[TOK], bb[TOK];   // every read issued before the first use
#if LOGITS
            decays_from_logits<TOK>(w, in.z, t0, key, bias, decay_scale, eos - bos - c * BT);
#else
#pragma unroll
            for (int i = 0; i < TOK; i += 4) {
                const float4 w4 = *reinterpret_cast<const float4*>(in.w + key * BT + t0 + i);
                w[i] = w4.x; w[i + 1] = w4.y; w[i + 2] = w4.z; w[i + 3] = w4.w;
            }
#endif
#pragma unroll
            for (int i = 0; i < TOK; i++) {
                rr[i] = in.r[token_chunk(t0 + i, key)];
                kk[i] = in.k[token_chunk(t0 + i, key)];
                bb[i] = in.b[token_chunk(t0 + i, key)];
            }
            float g[TOK], before, total;
            chunk_sums<TOK, TPK>(w, g, before, total, lane, part);
            float ke[TOK], be[TOK];
#pragma unroll
            for (int i = 0; i < TOK; i++) {
                const float gi = g[i] + before, to_end = __expf(fminf(total - gi, 0.f));
                f.R[token_major(t0 + i, key, SW)] = tf32f(bf2f(rr[i]) * __expf(gi));
                ke[i] = tf32f(bf2f(kk[i]) * to_end);
                be[i] = tf32f(bf2f(bb[i]) * to_end);
            }
#pragma unroll
            for (int i = 0; i < TOK; i += 4) {
                *reinterpret_cast<float4*>(f.K + tile16(key, t0 + i)) = make_float4(ke[i], ke[i + 1], ke[i + 2],
                                                                                        ke[i + 3]);
                *reinterpret_cast<float4*>(f.B + tile16(key, t0 + i)) = make_float4(be[i], be[i + 1], be[i + 2],
                                                                                        be[i + 3]);
            }
            if (part == 0) f.eC[key] = __expf(total);
        };

        produce<PRODUCERS>(count, copy, form);
        return;
    }

    // ---- consumers: st[j] holds ST rows (values) g, g + 8 of the warp's 16 and columns (keys) 8j + 2q, 8j + 2q + 1
    const int warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int v_w = v_blk + 16 * warp, col = 16 * warp + g;   // the warp's first column; this thread's in the block
    bf16* stage = sh.stage[warp];
    float st[KD / 8][4];
#pragma unroll
    for (int j = 0; j < KD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = 8 * j + 2 * q + (e & 1);
            st[j][e] = has_h0 ? h0[((i64)n * H + hh) * KD * V + (i64)key * V + v_w + g + 8 * (e >> 1)] : 0.f;
        }
    __syncthreads();

    for (int c = 0; c < count; c++) {
        const Inputs& in = sh.in[c % STAGES];
        const Formed& f = sh.formed[c & 1];
        const int tok0 = bos + c * BT;

        // the state entering the chunk, kept for the backward (h, bf16 [K, V]), through the staging tile [key][v]:
        // tile (j, half) of ST (values g + 8 half, keys 8j ..) lands transposed at rows 8j .., columns 8 half ..
        {
            const int m = lane >> 3, c = lane & 7;
#pragma unroll
            for (int i = 0; i < KD / 16; i++)
                store_transposed(stage + stage_at(8 * (2 * i + (m >> 1)) + c, m & 1),
                                 bf16x2(st[2 * i][0], st[2 * i][1]), bf16x2(st[2 * i][2], st[2 * i][3]),
                                 bf16x2(st[2 * i + 1][0], st[2 * i + 1][1]),
                                 bf16x2(st[2 * i + 1][2], st[2 * i + 1][3]));
        }
        __syncwarp();
        {
            bf16* dst = h + ((i64)(c0 + c) * H + hh) * KD * V + v_w;
#pragma unroll
            for (int i = 0; i < KD * 2 / 32; i++) {
                const int row = (i * 32 + lane) >> 1, half = lane & 1;
                *reinterpret_cast<uint4*>(dst + (i64)row * V + 8 * half) =
                    *reinterpret_cast<const uint4*>(stage + stage_at(row, half));
            }
        }

        unsigned sa[KD / 8][4];
#pragma unroll
        for (int j = 0; j < KD / 8; j++) as_a(sa[j], st[j]);

        // U^T = ST W^T + Uv^T, O^T = ST (r e^g)^T
        float u[2][4], ot[2][4] = {};
#pragma unroll
        for (int p = 0; p < 2; p++)
#pragma unroll
            for (int e = 0; e < 4; e++) u[p][e] = in.Uv[(8 * p + 2 * q + (e & 1)) * SU + col + 8 * (e >> 1)];
#pragma unroll
        for (int p = 0; p < 2; p++)
#pragma unroll
            for (int j = 0; j < KD / 8; j++) {
                mma(u[p], sa[j], b_pair(in.W, 8 * p + g, 8 * j + 2 * q, SW));
                mma(ot[p], sa[j], pair_at(f.R, token_major(8 * p + g, 8 * j + 2 * q, SW)));
            }
        unsigned ua[2][4], va[2][4];
#pragma unroll
        for (int p = 0; p < 2; p++) {
            as_a(ua[p], u[p]);
            const int s = 8 * p + 2 * q;   // bf16 widens to tf32 exactly
            va[p][0] = ((unsigned)in.V[s * SV + col]) << 16;
            va[p][1] = ((unsigned)in.V[s * SV + col + 8]) << 16;
            va[p][2] = ((unsigned)in.V[(s + 1) * SV + col]) << 16;
            va[p][3] = ((unsigned)in.V[(s + 1) * SV + col + 8]) << 16;
        }
        // O^T += U^T A_rb^T + V^T A_rk^T
#pragma unroll
        for (int pt = 0; pt < 2; pt++)
#pragma unroll
            for (int ps = 0; ps < 2; ps++) {
                mma(ot[pt], ua[ps], pair_at(in.Arb, tile16(8 * pt + g, 8 * ps + 2 * q)));
                mma(ot[pt], va[ps], pair_at(in.Ark, tile16(8 * pt + g, 8 * ps + 2 * q)));
            }
        // ST <- e^{gC} ST + V^T (k e^{gC-g}) + U^T (b e^{gC-g})
#pragma unroll
        for (int j = 0; j < KD / 8; j++) {
            const float2 e = *reinterpret_cast<const float2*>(f.eC + 8 * j + 2 * q);
            st[j][0] *= e.x; st[j][1] *= e.y; st[j][2] *= e.x; st[j][3] *= e.y;
#pragma unroll
            for (int ps = 0; ps < 2; ps++) {
                mma(st[j], va[ps], pair_at(f.K, tile16(8 * j + g, 8 * ps + 2 * q)));
                mma(st[j], ua[ps], pair_at(f.B, tile16(8 * j + g, 8 * ps + 2 * q)));
            }
        }

        // U and O (bf16 [T, V]) through the staging tile, U in rows 0-15, O in 16-31: tile (p, half) of U^T
        // (values g + 8 half, tokens 8p ..) lands transposed at rows 8p .., columns 8 half ..
        __syncwarp();
        {
            const int m = lane >> 3, c = lane & 7, row = 8 * (m >> 1) + c;
            store_transposed(stage + stage_at(row, m & 1), bf16x2(u[0][0], u[0][1]), bf16x2(u[0][2], u[0][3]),
                             bf16x2(u[1][0], u[1][1]), bf16x2(u[1][2], u[1][3]));
            store_transposed(stage + stage_at(BT + row, m & 1), bf16x2(ot[0][0] * scale, ot[0][1] * scale),
                             bf16x2(ot[0][2] * scale, ot[0][3] * scale), bf16x2(ot[1][0] * scale, ot[1][1] * scale),
                             bf16x2(ot[1][2] * scale, ot[1][3] * scale));
        }
        __syncwarp();
        {
            const int row = lane >> 1, half = lane & 1, t = tok0 + row;
            if (t < eos) {
                const i64 off = ((i64)t * H + hh) * V + v_w + 8 * half;
                *reinterpret_cast<uint4*>(U + off) = *reinterpret_cast<const uint4*>(stage + stage_at(row, half));
                *reinterpret_cast<uint4*>(o + off) = *reinterpret_cast<const uint4*>(stage + stage_at(BT + row, half));
            }
        }
        __syncthreads();
    }

    if (store_ht) {
#pragma unroll
        for (int j = 0; j < KD / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = 8 * j + 2 * q + (e & 1);
                ht[((i64)n * H + hh) * KD * V + (i64)key * V + v_w + g + 8 * (e >> 1)] = st[j][e];
            }
    }
}
