// RWKV-7's backward sequence scan in CUDA (kernels/rwkv7/scan_cuda.py compiles it with NVRTC): the work of the Triton
// _bwd_scan in its sequence role. Per chunk of 16 tokens, last to first, from the state gradient dS at the chunk's end
// (README.md's notation; scale folded into A_rb and r e^g):
//     dh <- dS,    dU = scale A_rb^T dO + (b e^{gC-g}) dS,    dZ = T^T dU,
//     dS <- e^{gC} dS + scale (r e^g)^T dO + (a e^{ge})^T dZ
// The layout of scan.cu (whose header comment says why): per sequence, head and 64 value columns one block; 4 consumer
// warps hold dS transposed (dST [16 values x 64 keys]) in tf32 accumulators, 4 producer warps copy each chunk's inputs
// two chunks ahead and form its operands one chunk ahead. dh (fp32) leaves through a staging tile, dZ (bf16) through
// stmatrix. Every exp() argument is <= 0.
// LOGITS (a build define): the producers form w from the decay's logits z (bf16 [T, H, K], read as r is) and its bias
// as prep.cu did (tiles.cuh's log_decay), so the forward need not keep w by chunk for the backward; else they read w
// by chunk (fp32, from _fwd_prep, where the op was given log decays).

#define KD 64                   // the key head size (scan_cuda.KD)
#define BT 16
#define VC 64                   // value columns per block
#define CONSUMERS 128
#define PRODUCERS 128
#define THREADS (CONSUMERS + PRODUCERS)
#define TPK (PRODUCERS / KD)    // producer threads per key feature
#define TOK (BT / TPK)          // tokens each of them forms
#define SW (KD + 8)             // row stride (floats) of token-major [BT, KD] tiles
#define SA (BT + 8)             // row stride (floats) of [BT, BT] tiles
#define SV (VC + 8)             // row stride (bf16) of the dO tile
#define SH (16 + 4)             // row stride (floats) of a warp's dh staging tile [KD, 16]
#define STAGES 3
#if LOGITS
#define W_PIECES (BT * KD / 8)  // 16-byte pieces of a chunk's w: the logits [t][key]
#else
#define W_PIECES (KD * BT / 4)  // w by chunk [key][t]
#endif
#define SLOTS ((W_PIECES + 3 * BT * KD / 8 + BT * VC / 8 + 2 * BT * BT / 4) / PRODUCERS)

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
    float w[KD * BT];           // [key][t]: the log decays by chunk
#endif
    bf16 r[BT * KD], a[BT * KD], b[BT * KD];   // [t][key] (token_chunk)
    bf16 dO[BT * SV];           // [t][v] of the block's columns
    float Arb[BT * BT], T[BT * BT];            // [t][s] as _fwd_prep stored them (tile16)
};

struct Formed {                 // rounded to tf32
    float ArbT[BT * SA];        // [s][t]: scale A_rb[t][s]
    float TT[BT * SA];          // [t][s]: T[s][t]
    float Bend[BT * SW];        // [t][key] (token_major): b e^{gC - g}
    float Rd[KD * BT];          // [key][t] (tile16): scale r e^{g}
    float Ad[KD * BT];          // [key][t] (tile16): a e^{g - w}
    float eC[KD];               // e^{gC}
};

struct Shared {
    Inputs in[STAGES];
    Formed formed[2];
    float stage[CONSUMERS / 32][KD * SH];   // a consumer warp's staging tile: dh [key][v], then dZ (bf16 [t][v])
};
static_assert(sizeof(Shared) == SHARED_BYTES, "scan_cuda's shared_bytes is not the size of Shared");

extern "C" __global__ void __launch_bounds__(THREADS, 2)
flame_rwkv7_bwd_scan(const bf16* __restrict__ r, const w_t* __restrict__ wf, const float* __restrict__ w_bias,
                     float decay_scale, const bf16* __restrict__ a,
                     const bf16* __restrict__ b, const bf16* __restrict__ dO, const int* __restrict__ cu,
                     const int* __restrict__ chunk_offsets, const float* __restrict__ Arb,
                     const float* __restrict__ Tinv, const float* __restrict__ dht, float* __restrict__ dh,
                     bf16* __restrict__ dZ, float* __restrict__ dh0, float scale, int H, int V, int TT,
                     int seg_first, int seg_count, int segment, int has_dht, int store_dh0) {
    extern __shared__ __align__(16) unsigned char smem[];
    Shared& sh = *reinterpret_cast<Shared*>(smem);

    const int n = blockIdx.x, hh = blockIdx.y, tid = threadIdx.x, lane = tid & 31;
    const int v_blk = blockIdx.z * VC;
    const int bos = cu[n], eos = cu[n + 1], c0 = chunk_offsets[n];
    const int first = segment ? seg_first : 0, count = segment ? seg_count : (eos - bos + BT - 1) / BT;
    const int last = first + count - 1;   // iteration i runs chunk last - i

    if (tid >= CONSUMERS) {
        const int p = tid - CONSUMERS;
        // as scan.cu's producers, over the chunks in reverse: src starts at the last chunk and steps back
        const char* src[SLOTS];
        i64 step[SLOTS];
        unsigned dst[SLOTS];
        int row[SLOTS];
        {
            int slot = 0;
            const Inputs* in0 = nullptr;
            auto add = [&](const void* from, i64 per_chunk, const void* to, int t) {
                src[slot] = reinterpret_cast<const char*>(from);
                step[slot] = -per_chunk;
                dst[slot] = (unsigned)(reinterpret_cast<const char*>(to) - reinterpret_cast<const char*>(in0));
                row[slot++] = t;
            };
            const i64 tok_k = (i64)H * KD * sizeof(bf16);
            const int t_last = bos + last * BT;   // the last chunk's first token
#pragma unroll
            for (int i = 0; i < W_PIECES / PRODUCERS; i++) {
#if LOGITS                                                               // the logits: [t][key]
                const int e = p + i * PRODUCERS, t = e / (KD / 8), part = e % (KD / 8);
                add(wf + ((i64)(t_last + t) * H + hh) * KD + 8 * part, BT * tok_k, in0->z + token_chunk(t, 8 * part),
                    t);
#else                                                                    // w by chunk: [key][t]
                const int e = p + i * PRODUCERS, key = e / (BT / 4), part = e % (BT / 4);
                add(wf + (i64)(hh * KD + key) * TT + (i64)(c0 + last) * BT + 4 * part, BT * sizeof(float),
                    in0->w + key * BT + 4 * part, -1);
#endif
            }
#pragma unroll
            for (int i = 0; i < 3 * BT * KD / 8 / PRODUCERS; i++) {      // r, a, b: [t][key]
                const int e = p + i * PRODUCERS, which = e / (BT * KD / 8), t = e / (KD / 8) % BT, part = e % (KD / 8);
                const bf16* from = which == 0 ? r : which == 1 ? a : b;
                const bf16* to = which == 0 ? in0->r : which == 1 ? in0->a : in0->b;
                add(from + ((i64)(t_last + t) * H + hh) * KD + 8 * part, BT * tok_k, to + token_chunk(t, 8 * part),
                    t);
            }
#pragma unroll
            for (int i = 0; i < BT * VC / 8 / PRODUCERS; i++) {          // dO
                const int e = p + i * PRODUCERS, t = e / (VC / 8), part = e % (VC / 8);
                add(dO + ((i64)(t_last + t) * H + hh) * V + v_blk + 8 * part, (i64)BT * H * V * sizeof(bf16),
                    in0->dO + t * SV + 8 * part, t);
            }
#pragma unroll
            for (int i = 0; i < 2 * BT * BT / 4 / PRODUCERS; i++) {      // A_rb, T
                const int e = p + i * PRODUCERS, which = e / (BT * BT / 4), t = e / (BT / 4) % BT, part = e % (BT / 4);
                add((which ? Tinv : Arb) + ((i64)(t_last + t) * H + hh) * BT + 4 * part,
                    (i64)BT * H * BT * sizeof(float), (which ? in0->T : in0->Arb) + tile16(t, 4 * part), t);
            }
        }
        auto copy = [&](int i) {   // iteration i's chunk: iterations in order, src steps back after each
            char* base = reinterpret_cast<char*>(&sh.in[i % STAGES]);
            const int rows_left = eos - bos - (last - i) * BT;
#pragma unroll
            for (int s = 0; s < SLOTS; s++) {
                copy16(base + dst[s], src[s], row[s] < rows_left);
                src[s] += step[s];
            }
        };
        const int key = p / TPK, part = p % TPK, t0 = part * TOK;
#if LOGITS
        const float bias = w_bias[hh * KD + key];
#endif
        auto form = [&](int i) {
            const Inputs& in = sh.in[i % STAGES];
            Formed& f = sh.formed[i & 1];
            float w[TOK];
            bf16 rr[TOK], aa[TOK], bb[TOK];
#if LOGITS
            decays_from_logits<TOK>(w, in.z, t0, key, bias, decay_scale, eos - bos - (last - i) * BT);
#else
#pragma unroll
            for (int j = 0; j < TOK; j += 4) {
                const float4 w4 = *reinterpret_cast<const float4*>(in.w + key * BT + t0 + j);
                w[j] = w4.x; w[j + 1] = w4.y; w[j + 2] = w4.z; w[j + 3] = w4.w;
            }
#endif
#pragma unroll
            for (int j = 0; j < TOK; j++) {
                rr[j] = in.r[token_chunk(t0 + j, key)];
                aa[j] = in.a[token_chunk(t0 + j, key)];
                bb[j] = in.b[token_chunk(t0 + j, key)];
            }
            // the transposes of A_rb (times scale; threads 0-63) and T (64-127): 4 elements of a row per thread
            const int which = p / (BT * BT / 4), e = 4 * (p % (BT * BT / 4)), tr = e / BT, sc = e % BT;
            const float4 x = *reinterpret_cast<const float4*>((which ? in.T : in.Arb) + tile16(tr, sc));
            float g[TOK], before, total;
            chunk_sums<TOK, TPK>(w, g, before, total, lane, part);
            float rd[TOK], ad[TOK];
#pragma unroll
            for (int j = 0; j < TOK; j++) {
                const float gj = g[j] + before;
                rd[j] = tf32f(scale * bf2f(rr[j]) * __expf(gj));
                ad[j] = tf32f(bf2f(aa[j]) * __expf(fminf(gj - w[j], 0.f)));
                f.Bend[token_major(t0 + j, key, SW)] = tf32f(bf2f(bb[j]) * __expf(fminf(total - gj, 0.f)));
            }
#pragma unroll
            for (int j = 0; j < TOK; j += 4) {
                *reinterpret_cast<float4*>(f.Rd + tile16(key, t0 + j)) = make_float4(rd[j], rd[j + 1], rd[j + 2],
                                                                                         rd[j + 3]);
                *reinterpret_cast<float4*>(f.Ad + tile16(key, t0 + j)) = make_float4(ad[j], ad[j + 1], ad[j + 2],
                                                                                         ad[j + 3]);
            }
            if (part == 0) f.eC[key] = __expf(total);
            float* to = which ? f.TT : f.ArbT;
            const float by = which ? 1.f : scale;
            to[(sc + 0) * SA + tr] = tf32f(by * x.x); to[(sc + 1) * SA + tr] = tf32f(by * x.y);
            to[(sc + 2) * SA + tr] = tf32f(by * x.z); to[(sc + 3) * SA + tr] = tf32f(by * x.w);
        };

        produce<PRODUCERS>(count, copy, form);
        return;
    }

    // ---- consumers: st[j] holds dST rows (values) g, g + 8 of the warp's 16 and keys 8j + 2q, 8j + 2q + 1
    const int warp = tid >> 5, g = lane >> 2, q = lane & 3;
    const int v_w = v_blk + 16 * warp, col = 16 * warp + g;
    float* stage = sh.stage[warp];
    float st[KD / 8][4];
#pragma unroll
    for (int j = 0; j < KD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = 8 * j + 2 * q + (e & 1);
            st[j][e] = has_dht ? dht[((i64)n * H + hh) * KD * V + (i64)key * V + v_w + g + 8 * (e >> 1)] : 0.f;
        }
    __syncthreads();

    for (int i = 0; i < count; i++) {
        const Inputs& in = sh.in[i % STAGES];
        const Formed& f = sh.formed[i & 1];
        const int chunk = last - i, tok0 = bos + chunk * BT;

        // dS at the chunk's end to dh (fp32 [K, V]) through the staging tile [key][v]
#pragma unroll
        for (int j = 0; j < KD / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) stage[(8 * j + 2 * q + (e & 1)) * SH + g + 8 * (e >> 1)] = st[j][e];
        __syncwarp();
        {
            const i64 dh_row = segment ? (i64)n * seg_count + chunk - seg_first : (i64)c0 + chunk - seg_first;
            float* to = dh + (dh_row * H + hh) * KD * V + v_w;
#pragma unroll
            for (int k = 0; k < KD * 4 / 32; k++) {
                const int key = (k * 32 + lane) >> 2, part = lane & 3;
                *reinterpret_cast<float4*>(to + (i64)key * V + 4 * part) =
                    *reinterpret_cast<const float4*>(stage + key * SH + 4 * part);
            }
        }

        unsigned sa[KD / 8][4], da[2][4];
#pragma unroll
        for (int j = 0; j < KD / 8; j++) as_a(sa[j], st[j]);
#pragma unroll
        for (int p = 0; p < 2; p++) {   // dO^T over tokens 8p .. (bf16 widens to tf32 exactly)
            const int t = 8 * p + 2 * q;
            da[p][0] = ((unsigned)in.dO[t * SV + col]) << 16;
            da[p][1] = ((unsigned)in.dO[t * SV + col + 8]) << 16;
            da[p][2] = ((unsigned)in.dO[(t + 1) * SV + col]) << 16;
            da[p][3] = ((unsigned)in.dO[(t + 1) * SV + col + 8]) << 16;
        }
        // dU^T = dO^T (scale A_rb) + dST (b e^{gC-g})^T, over the chunk's tokens s
        float u[2][4] = {};
#pragma unroll
        for (int ps = 0; ps < 2; ps++) {
#pragma unroll
            for (int pt = 0; pt < 2; pt++) mma(u[ps], da[pt], b_pair(f.ArbT, 8 * ps + g, 8 * pt + 2 * q, SA));
#pragma unroll
            for (int j = 0; j < KD / 8; j++)
                mma(u[ps], sa[j], pair_at(f.Bend, token_major(8 * ps + g, 8 * j + 2 * q, SW)));
        }
        // dZ^T = dU^T T
        unsigned ua[2][4], za[2][4];
        float z[2][4] = {};
#pragma unroll
        for (int p = 0; p < 2; p++) as_a(ua[p], u[p]);
#pragma unroll
        for (int pt = 0; pt < 2; pt++)
#pragma unroll
            for (int ps = 0; ps < 2; ps++) mma(z[pt], ua[ps], b_pair(f.TT, 8 * pt + g, 8 * ps + 2 * q, SA));
        // dST <- e^{gC} dST + dO^T (scale r e^g) + dZ^T (a e^{g-w})
#pragma unroll
        for (int p = 0; p < 2; p++) as_a(za[p], z[p]);
#pragma unroll
        for (int j = 0; j < KD / 8; j++) {
            const float2 e = *reinterpret_cast<const float2*>(f.eC + 8 * j + 2 * q);
            st[j][0] *= e.x; st[j][1] *= e.y; st[j][2] *= e.x; st[j][3] *= e.y;
#pragma unroll
            for (int p = 0; p < 2; p++) {
                mma(st[j], da[p], pair_at(f.Rd, tile16(8 * j + g, 8 * p + 2 * q)));
                mma(st[j], za[p], pair_at(f.Ad, tile16(8 * j + g, 8 * p + 2 * q)));
            }
        }

        // dZ (bf16 [T, V]) through the staging tile: tile (p, half) of dZ^T lands transposed at rows 8p ..
        __syncwarp();
        bf16* zt = reinterpret_cast<bf16*>(stage);
        {
            const int m = lane >> 3, c = lane & 7;
            store_transposed(zt + stage_at(8 * (m >> 1) + c, m & 1), bf16x2(z[0][0], z[0][1]),
                             bf16x2(z[0][2], z[0][3]), bf16x2(z[1][0], z[1][1]), bf16x2(z[1][2], z[1][3]));
        }
        __syncwarp();
        {
            const int row = lane >> 1, half = lane & 1, t = tok0 + row;
            if (t < eos)
                *reinterpret_cast<uint4*>(dZ + ((i64)t * H + hh) * V + v_w + 8 * half) =
                    *reinterpret_cast<const uint4*>(zt + stage_at(row, half));
        }
        __syncthreads();
    }

    if (store_dh0) {
#pragma unroll
        for (int j = 0; j < KD / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = 8 * j + 2 * q + (e & 1);
                dh0[((i64)n * H + hh) * KD * V + (i64)key * V + v_w + g + 8 * (e >> 1)] = st[j][e];
            }
    }
}
