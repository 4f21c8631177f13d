// RWKV-7's per-chunk forward preparation in CUDA (kernels/rwkv7/scan_cuda.py compiles it with NVRTC): the Triton
// _fwd_prep's work for bf16 inputs, K = 64, the decay from its logits (README.md's notation). Per chunk of 16 tokens
// and head, all chunks at once:
//     w = -decay_scale sigmoid(z + bias) (stored feature-major by chunk to wf, where given: the scans that read it),
//     A_rb, A_rk, A_ab, A_ak: A_xy[t, s] = sum_k x_tk y_sk e^{g_t - g_s} for s < t (A_ab, A_ak: g_t exclusive),
//         the diagonal of A_rb, A_rk (decay 1) apart; by halving: at each level a pair (t, s) straddling the middle
//         m of its block of S rows factors as e^{g_t - g_m} e^{g_m - g_s}, both <= 1, one product a level,
//     T = (I - A_ab)^{-1} by forward substitution in fp32 (T = I + A_ab T, rows in order),
//     W = T (a e^{ge}), Uv = T (A_ak v).
// One warp a chunk, 4 chunks of a head a block, three blocks an SM: the warps wait on their own chain of shared-memory
// steps, so more of them hide more (at 168 registers ptxas keeps fifteen values on the stack, stored and loaded once a
// chunk). A level's factors share two tiles (r^ and a^ on a block's second half of rows, b^ and k^ on its first; the
// pair mask keeps the products' pairs that belong). For the elementwise work lane l owns keys 2l and 2l + 1 (a bf16
// pair of each token's row) and sums the log decays over a chunk's tokens in order, in fp32. The products are
// tensor-core ops as the Triton kernel's: the pairwise ones and A_ak v with bf16 operands (the level factors rounded to
// bf16), T in fp32 FMAs, W's and Uv's with tf32 operands (fp32 bits, their low bits ignored); fp32 accumulation.
// Every exp() argument is <= 0 (sums of log decays, clamped).

#define KD 64                   // the key head size (scan_cuda.KD)
#define BT 16
#define VC 64                   // value columns a pass
#define WARPS 4                 // chunks a block
#define SX (KD + 8)             // row stride (bf16) of [BT, KD] tiles: ldmatrix's 8 rows of 16 bytes on distinct banks
#define SV (VC + 8)             // row stride (bf16) of the v tile
#define SF (BT + 4)             // row stride (floats) of fp32 [BT, BT] tiles
#define SY (KD + 8)             // row stride (floats) of the fp32 [BT, KD] B operands (tf32 reads on distinct banks)
#define BOUNDS __launch_bounds__(32 * WARPS, 3)   // three blocks an SM (scan_cuda.PREP.blocks): 168 registers

#include "tiles.cuh"

struct Warp {
    bf16 x[4][BT * SX];         // r, k, a, b as loaded, [t][key]
    bf16 v[BT * SV];            // one pass's v columns, [t][v]
    union {
        bf16 hat[2][BT * SX];   // a level's factors [t][key]: r^ | b^ and a^ | k^ (second | first halves)
        struct {
            float T[BT * SF], P[BT * SF];   // T and A_ab
            float y[BT * SY];               // a e^{ge} [t][key], then A_ak v [t][v]
        } f;
    };
};
struct Shared {
    Warp warp[WARPS];
};
static_assert(sizeof(Shared) == SHARED_BYTES, "scan_cuda's shared_bytes is not the size of Shared");

// acc[n] += X Y^T over 64 keys for X, Y [16][SX] bf16 tiles: acc[n] holds columns (tokens of Y) 8n ..
__device__ __forceinline__ void product_xyT(float (&acc)[2][4], const bf16* X, const bf16* Y, int lane) {
#pragma unroll
    for (int s = 0; s < KD / 16; s++) {
        unsigned a[4], b[4];
        a_tile(a, X, SX, 0, 16 * s, lane);
        b_tiles(b, Y, SX, 0, 16 * s, lane);
        mma_bf16(acc[0], a, b[0], b[1]);
        mma_bf16(acc[1], a, b[2], b[3]);
    }
}

// acc[n] = T Y for T fp32 [16, 16] (row stride SF) and Y fp32 [16, 64] (row stride SY), tf32 operands: acc[n]
// holds columns 8n ..
__device__ __forceinline__ void product_T(float (&acc)[8][4], const float* T, const float* Y, int g, int q) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BT / 8; kk++) {
        const unsigned a[4] = {__float_as_uint(T[g * SF + 8 * kk + q]), __float_as_uint(T[(g + 8) * SF + 8 * kk + q]),
                               __float_as_uint(T[g * SF + 8 * kk + q + 4]),
                               __float_as_uint(T[(g + 8) * SF + 8 * kk + q + 4])};
#pragma unroll
        for (int n = 0; n < 8; n++)
            mma(acc[n], a, make_float2(Y[(8 * kk + q) * SY + 8 * n + g], Y[(8 * kk + q + 4) * SY + 8 * n + g]));
    }
}

// A [16, 64] accumulator tile (rows g, g + 8; columns 8n + 2q, + 1) to global rows of stride `row` floats from
// `at` (the chunk's first token, the head's first column), rows below `rows` only
__device__ __forceinline__ void store_tile(float* at, i64 row, const float (&acc)[8][4], int rows, int g, int q) {
#pragma unroll
    for (int n = 0; n < 8; n++) {
        if (g < rows) *reinterpret_cast<float2*>(at + g * row + 8 * n + 2 * q) = make_float2(acc[n][0], acc[n][1]);
        if (g + 8 < rows)
            *reinterpret_cast<float2*>(at + (g + 8) * row + 8 * n + 2 * q) = make_float2(acc[n][2], acc[n][3]);
    }
}

extern "C" __global__ void BOUNDS
flame_rwkv7_fwd_prep(const bf16* __restrict__ r, const bf16* __restrict__ z, const float* __restrict__ w_bias,
                     const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ a,
                     const bf16* __restrict__ b, const int* __restrict__ cu, const int* __restrict__ chunk_index,
                     float* __restrict__ W, float* __restrict__ Uv, float* __restrict__ Arb, float* __restrict__ Ark,
                     bf16* __restrict__ Aak, float* __restrict__ Tinv, float* __restrict__ wf, float decay_scale,
                     int H, int V, int TT, int NT) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, hh = blockIdx.y;
    const int i_c = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (i_c >= NT) return;
    Warp& sh = reinterpret_cast<Shared*>(smem)->warp[threadIdx.x >> 5];
    const int i_n = chunk_index[2 * i_c], t0 = cu[i_n] + chunk_index[2 * i_c + 1] * BT;
    const int rows = min(BT, cu[i_n + 1] - t0);   // tokens of the chunk in its sequence (<= 0: a spare chunk)
    const int g = lane >> 2, q = lane & 3;

    // every load first: r, k, a, b copied to shared memory 16 bytes at a time (zeros past the sequence's end), the
    // lane's key pair of the logits and the bias of its keys to registers
    {
        const bf16* from[4] = {r, k, a, b};
#pragma unroll
        for (int i = 0; i < 4; i++)
            copy_rows<32, SX>(sh.x[i], from[i] + ((i64)t0 * H + hh) * KD, (i64)H * KD, rows, lane);
        copies_commit();
    }
    const float2 bias = *reinterpret_cast<const float2*>(w_bias + hh * KD + 2 * lane);
    unsigned zz[BT];
#pragma unroll
    for (int t = 0; t < BT; t++)
        zz[t] = t < rows ? reinterpret_cast<const unsigned*>(z)[((i64)(t0 + t) * H + hh) * KD / 2 + lane] : 0u;

    // the log decays of the lane's two keys (rows past the end: 0, so sums stay flat), and w by chunk
    float w[2][BT];
#pragma unroll
    for (int t = 0; t < BT; t++) {
        const float lo = __uint_as_float(zz[t] << 16), hi = __uint_as_float(zz[t] & 0xffff0000u);
        w[0][t] = t < rows ? log_decay(lo, bias.x, decay_scale) : 0.f;
        w[1][t] = t < rows ? log_decay(hi, bias.y, decay_scale) : 0.f;
    }
#pragma unroll
    for (int c = 0; c < 2 && wf != nullptr; c++) {   // (the scans that form w from the logits need none)
        float* to = wf + (i64)(hh * KD + 2 * lane + c) * TT + (i64)i_c * BT;
#pragma unroll
        for (int t = 0; t < BT; t += 4)
            *reinterpret_cast<float4*>(to + t) = make_float4(w[c][t], w[c][t + 1], w[c][t + 2], w[c][t + 3]);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncwarp();

    // the diagonals of A_rb and A_rk (decay 1): the whole products r b^T and r k^T, their diagonals kept
    float acc[4][2][4] = {};   // A_rb, A_rk, A_ab, A_ak: rows g, g + 8; columns 8n + 2q, + 1
#pragma unroll
    for (int m = 0; m < 2; m++) {
        float d[2][4] = {};
        product_xyT(d, sh.x[0], sh.x[m ? 1 : 3], lane);
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (g + 8 * (e >> 1) == 8 * n + 2 * q + (e & 1)) acc[m][n][e] = d[n][e];
    }

    // the halving levels: blocks of S rows, pairs (t in the second half, s in the first) of the same block
#pragma unroll
    for (int lvl = 0; lvl < 4; lvl++) {
        const int S = BT >> lvl, R = S / 2;
#pragma unroll
        for (int t = 0; t < BT; t++) {
            const int pos = t % S;
            float f0[2], f1[2];   // second half: e^{g_t - g_m}, e^{ge_t - g_m}; first half: e^{g_m - g_s}
#pragma unroll
            for (int c = 0; c < 2; c++) {
                float sum = 0.f;
                if (pos >= R) {   // the decays after the middle row up to t (exclusive, then inclusive)
#pragma unroll
                    for (int u = t - pos + R; u < t; u++) sum += w[c][u];
                    f1[c] = __expf(fminf(sum, 0.f));
                    f0[c] = __expf(fminf(sum + w[c][t], 0.f));
                } else {          // the decays after s up to the middle row
#pragma unroll
                    for (int u = t + 1; u < t - pos + R; u++) sum += w[c][u];
                    f0[c] = f1[c] = __expf(fminf(sum, 0.f));
                }
            }
            auto hat = [&](int i, float e0, float e1) {   // the lane's pair of tensor i scaled, as bf16
                const unsigned p = reinterpret_cast<const unsigned*>(sh.x[i])[t * SX / 2 + lane];
                return bf16x2(__uint_as_float(p << 16) * e0, __uint_as_float(p & 0xffff0000u) * e1);
            };
            unsigned* h0 = reinterpret_cast<unsigned*>(sh.hat[0]) + t * SX / 2 + lane;
            unsigned* h1 = reinterpret_cast<unsigned*>(sh.hat[1]) + t * SX / 2 + lane;
            *h0 = pos >= R ? hat(0, f0[0], f0[1]) : hat(3, f0[0], f0[1]);   // r^ | b^
            *h1 = pos >= R ? hat(2, f1[0], f1[1]) : hat(1, f0[0], f0[1]);   // a^ | k^
        }
        __syncwarp();
#pragma unroll
        for (int m = 0; m < 4; m++) {   // r^ b^T, r^ k^T, a^ b^T, a^ k^T: rows t of the second half of a block,
            float d[2][4] = {};         // columns s of the first half of the same block
            product_xyT(d, sh.hat[m >> 1], sh.hat[m & 1], lane);
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int t = g + 8 * (e >> 1), s = 8 * n + 2 * q + (e & 1);
                    if (t / S == s / S && t % S >= R && s % S < R) acc[m][n][e] += d[n][e];
                }
        }
        __syncwarp();
    }

    // A_rb, A_rk, A_ak to memory ([T, H, 16] rows), A_ab to shared memory
    {
        const i64 row0 = ((i64)t0 * H + hh) * BT;
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int t = g + 8 * h;
                if (t < rows) {
                    const i64 at = row0 + (i64)t * H * BT + 8 * n + 2 * q;
                    *reinterpret_cast<float2*>(Arb + at) = make_float2(acc[0][n][2 * h], acc[0][n][2 * h + 1]);
                    *reinterpret_cast<float2*>(Ark + at) = make_float2(acc[1][n][2 * h], acc[1][n][2 * h + 1]);
                    *reinterpret_cast<unsigned*>(Aak + at) = bf16x2(acc[3][n][2 * h], acc[3][n][2 * h + 1]);
                }
                *reinterpret_cast<float2*>(sh.f.P + t * SF + 8 * n + 2 * q) =
                    make_float2(acc[2][n][2 * h], acc[2][n][2 * h + 1]);
            }
    }

    // a e^{ge} (ge the exclusive cumulative log decays of the chunk), W's B operand: formed before T, so that the
    // log decays are not held through T's chain
    {
        float ge[2] = {0.f, 0.f};
#pragma unroll
        for (int t = 0; t < BT; t++) {
            const unsigned p = reinterpret_cast<const unsigned*>(sh.x[2])[t * SX / 2 + lane];
            *reinterpret_cast<float2*>(sh.f.y + t * SY + 2 * lane) =
                make_float2(__uint_as_float(p << 16) * __expf(fminf(ge[0], 0.f)),
                            __uint_as_float(p & 0xffff0000u) * __expf(fminf(ge[1], 0.f)));
            ge[0] += w[0][t];
            ge[1] += w[1][t];
        }
    }
    __syncwarp();

    // T = (I - A_ab)^{-1} by forward substitution in fp32, T_i = e_i + sum_{j<i} [A_ab]_ij T_j (rows i; T = I + A T):
    // lane l forms column l % 16 (both halves of the warp alike, so the chain of rows needs no shuffle), reading
    // row i of A_ab as a broadcast, then writes rows l / 16 * 8 .. + 7 of it (to T's tile and to Tinv)
    {
        const int c = lane & 15, half = lane >> 4;
        float tc[BT];
#pragma unroll
        for (int i = 0; i < BT; i++) {
            float s = i == c ? 1.f : 0.f;
#pragma unroll
            for (int j4 = 0; j4 < i; j4 += 4) {
                const float4 p = *reinterpret_cast<const float4*>(sh.f.P + i * SF + j4);
                const float ps[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                for (int j = j4; j < j4 + 4 && j < i; j++) s = fmaf(ps[j - j4], tc[j], s);
            }
            tc[i] = s;
        }
#pragma unroll
        for (int i = 0; i < BT / 2; i++) {
            const int t = i + 8 * half;
            const float x = half ? tc[i + 8] : tc[i];
            sh.f.T[t * SF + c] = x;
            if (t < rows) Tinv[((i64)(t0 + t) * H + hh) * BT + c] = x;
        }
    }
    __syncwarp();

    // W = T (a e^{ge})
    {
        float out[8][4];
        product_T(out, sh.f.T, sh.f.y, g, q);
        store_tile(W + ((i64)t0 * H + hh) * KD, (i64)H * KD, out, rows, g, q);
        __syncwarp();
    }

    // Uv = T (A_ak v), a pass per 64 columns of v: A_ak v with bf16 operands (A_ak's accumulators are the A
    // operand as they stand), then through shared memory as the B operand of T's product
    unsigned ak[4] = {bf16x2(acc[3][0][0], acc[3][0][1]), bf16x2(acc[3][0][2], acc[3][0][3]),
                      bf16x2(acc[3][1][0], acc[3][1][1]), bf16x2(acc[3][1][2], acc[3][1][3])};
    for (int vc = 0; vc < V; vc += VC) {
#pragma unroll
        for (int t = 0; t < BT; t++)
            reinterpret_cast<unsigned*>(sh.v)[t * SV / 2 + lane] =
                t < rows ? reinterpret_cast<const unsigned*>(v + ((i64)(t0 + t) * H + hh) * V + vc)[lane] : 0u;
        __syncwarp();
        float x[8][4] = {};
#pragma unroll
        for (int np = 0; np < VC / 16; np++) {   // columns 16 np ..: two n-tiles
            unsigned m[4];
            b_tiles_t(m, sh.v, SV, 0, 16 * np, lane);
            mma_bf16(x[2 * np], ak, m[0], m[1]);
            mma_bf16(x[2 * np + 1], ak, m[2], m[3]);
        }
#pragma unroll
        for (int n = 0; n < 8; n++) {
            *reinterpret_cast<float2*>(sh.f.y + g * SY + 8 * n + 2 * q) = make_float2(x[n][0], x[n][1]);
            *reinterpret_cast<float2*>(sh.f.y + (g + 8) * SY + 8 * n + 2 * q) = make_float2(x[n][2], x[n][3]);
        }
        __syncwarp();
        float out[8][4];
        product_T(out, sh.f.T, sh.f.y, g, q);
        store_tile(Uv + ((i64)t0 * H + hh) * V + vc, (i64)H * V, out, rows, g, q);
        __syncwarp();
    }
}
