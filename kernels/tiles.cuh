// Device helpers our CUDA kernels share (kernels/cuda_rtc.py hands this header to NVRTC as "tiles.cuh"): bf16 and
// tf32 conversions, tf32 tensor-core products over accumulator tiles, sm_90's transposed tile stores, asynchronous
// copies.
#pragma once

typedef unsigned short bf16;
typedef long long i64;

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }
// RWKV-7's log decay from its logit z and bias (kernels/rwkv7/decay.py): one expression wherever a CUDA kernel forms
// it, so that each forms the same w bit for bit
// (the fast division: its quotient is 0 where 1 + e^{-(z + bias)} passes 2^126, where w is below 1e-38 anyway)
__device__ __forceinline__ float log_decay(float z, float bias, float decay_scale) {
    return __fdividef(-decay_scale, 1.f + __expf(-(z + bias)));
}
// fp32 to tf32, rounded to nearest (ties away from zero) as cvt.rna does, in two integer operations (cvt.rna's own
// sequence is four, with checks for values that do not occur here: NaN stays NaN, infinities stay)
__device__ __forceinline__ unsigned tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ float tf32f(float x) { return __uint_as_float(tf32(x)); }
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four 8x8 bf16 tiles, each held as accumulators are (row i / 4, columns 2 (i % 4) and + 1 in lane i's register),
// stored transposed to shared memory: row c of tile m goes where lane 8m + c points (sm_90's stmatrix)
__device__ __forceinline__ void store_transposed(const bf16* row_address, unsigned m0, unsigned m1, unsigned m2,
                                                 unsigned m3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"((unsigned)__cvta_generic_to_shared(row_address)), "r"(m0), "r"(m1), "r"(m2), "r"(m3)
                 : "memory");
}

// 16 bytes from global to shared memory, asynchronously; zeros where `valid` is false (src-size 0: nothing is read,
// whatever the address)
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void copies_wait_all_but_last() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// d += a b: A 16x8 (row-major fragment a0..a3), B 8x8 (b.x, b.y), fp32 accumulators d0..d3. fp32 operands given
// as such are read as tf32 (their low mantissa bits ignored), as Triton's tf32 products read them.
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], float2 b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b.x)), "r"(__float_as_uint(b.y)));
}

// An accumulator tile (rows g, g+8; columns 2q, 2q+1) as an A operand over the same columns, permuted within the
// group of 8 (logical column q is column 2q, q + 4 is 2q + 1)
__device__ __forceinline__ void as_a(unsigned (&a)[4], const float (&c)[4]) {
    a[0] = tf32(c[0]); a[1] = tf32(c[2]); a[2] = tf32(c[1]); a[3] = tf32(c[3]);
}

// The B operand for k-group j of that permuted order from a tile X[n][k] (row stride S): (X[n][2q], X[n][2q + 1])
__device__ __forceinline__ float2 b_pair(const float* x, int n, int k, int S) {
    return *reinterpret_cast<const float2*>(x + n * S + k);
}

// Shared-memory layouts in which a warp's accesses hit every bank once (8-byte reads: each half-warp; 16-byte
// accesses and stmatrix: each quarter-warp / 8 rows). A chunk holds 16 tokens, so the tiles below are for that.
//
// tile16: an fp32 tile of rows of 16 (a chunk's tokens, or keys of [16, 16] tiles), rows unpadded, the 16-byte
// quarters of a row XOR-ed by 3 on every other pair of rows: b_pair's reads (8 rows x 8 columns), 16-byte copies
// (2 rows) and the form steps' float4 stores (4 rows x 2 halves of a row) fall on 8 distinct 16-byte bank groups.
__device__ __forceinline__ int tile16(int row, int col) {
    return row * 16 + (((col >> 2) ^ (3 * ((row >> 1) & 1))) << 2) + (col & 3);
}
// token_major: an fp32 [16 tokens][S] tile (S = 8 mod 32: b_pair's reads hit every bank once) whose rows 8-15 have
// their key halves swapped: the form steps' stores of tokens t and t + 8 (one key a lane) land on different banks.
__device__ __forceinline__ int token_major(int t, int key, int S) { return t * S + (key ^ ((t & 8) << 1)); }
// token_chunk: bf16 [16 tokens][64 keys] input tiles copied 16 bytes at a time: rows 8-15 have their key halves
// swapped (chunk XOR 4), so that the form steps' reads of one key at tokens t and t + 8 land on different banks.
__device__ __forceinline__ int token_chunk(int t, int key) { return t * 64 + (key ^ ((t & 8) << 2)); }
// A scan producer's log decays of one key for tokens t0 .. t0 + tok - 1 of a chunk, from its logits tile (token_chunk):
// every row formed, then rows from rows_left on (past the sequence's end) set to 0 so the sums stay flat; a conditional
// read would make every element a branch of its own
template <int tok>
__device__ __forceinline__ void decays_from_logits(float (&w)[tok], const bf16* z, int t0, int key, float bias,
                                                   float decay_scale, int rows_left) {
#pragma unroll
    for (int i = 0; i < tok; i++) w[i] = log_decay(bf2f(z[token_chunk(t0 + i, key)]), bias, decay_scale);
#pragma unroll
    for (int i = 0; i < tok; i++) w[i] = t0 + i < rows_left ? w[i] : 0.f;
}
// stage_at: bf16 staging tiles of 16 columns (32-byte rows), the 16-byte halves swapped every 4 rows: stmatrix's 8
// rows and a quarter-warp's 16-byte reads (4 rows) each hit every bank once.
__device__ __forceinline__ int stage_at(int row, int half) { return row * 16 + 8 * (half ^ ((row >> 2) & 1)); }
// the B-operand pair at element i of a tile laid out as above
__device__ __forceinline__ float2 pair_at(const float* x, int i) { return *reinterpret_cast<const float2*>(x + i); }

// ---- pieces of the scans' two roles (scan.cu, bwd_scan.cu), for blocks of `producers` + 128 consumer threads

// The producers' pipeline over `count` iterations: iteration i's inputs copied two ahead (copy(i) into a ring of 3),
// its operands formed one ahead (form(i)), a block-wide barrier each iteration as the consumers' loop has one. A
// copy lands in the stage the consumers finished with at the last barrier; form(i + 1) waits for this thread's copies
// of it (wait_group 1) and every producer's (the producers' barrier).
template <int producers, class Copy, class Form>
__device__ __forceinline__ void produce(int count, Copy copy, Form form) {
    if (count > 0) copy(0);
    copies_commit();
    if (count > 1) copy(1);
    copies_commit();
    copies_wait_all_but_last();
    asm volatile("bar.sync 1, %0;" :: "n"(producers) : "memory");
    if (count > 0) form(0);
    __syncthreads();
    for (int i = 0; i < count; i++) {
        if (i + 2 < count) copy(i + 2);
        copies_commit();
        copies_wait_all_but_last();
        asm volatile("bar.sync 1, %0;" :: "n"(producers) : "memory");
        if (i + 1 < count) form(i + 1);
        __syncthreads();
    }
}

// A form step's cumulative log decays over a key's chunk, tok tokens a thread and tpk adjacent lanes a key (lane
// part holds tokens tok * part ..): g the sums within the thread's tokens, before the sum of the parts before its
// own, total the chunk's.
template <int tok, int tpk>
__device__ __forceinline__ void chunk_sums(const float (&w)[tok], float (&g)[tok], float& before, float& total,
                                           int lane, int part) {
    float run = 0.f;
#pragma unroll
    for (int i = 0; i < tok; i++) g[i] = run += w[i];
    before = 0.f, total = 0.f;
#pragma unroll
    for (int j = 0; j < tpk; j++) {
        const float part_sum = __shfl_sync(0xffffffffu, run, (lane & ~(tpk - 1)) + j);
        total += part_sum;
        if (j < part) before += part_sum;
    }
}

// ---- bf16 tensor-core products from tiles in shared memory (prep.cu)

// ldmatrix: four 8x8 bf16 tiles, row c of tile m at the address lane 8m + c gives; the _t form transposed
__device__ __forceinline__ void load_tiles(unsigned (&m)[4], const bf16* row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row_address)));
}
__device__ __forceinline__ void load_tiles_t(unsigned (&m)[4], const bf16* row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row_address)));
}
// d += a b: A 16x16 (a[0..3], rows g and g + 8, columns 2q, 2q + 1 and + 8), B 16x8 (b0, b1), bf16; fp32 accumulators
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The A operand of rows r0 .. r0 + 15, columns c0 .. c0 + 15 of a bf16 tile of row stride S
__device__ __forceinline__ void a_tile(unsigned (&a)[4], const bf16* X, int S, int r0, int c0, int lane) {
    load_tiles(a, X + (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * S + c0 + 8 * (lane >> 4));
}
// The B operands of n-tiles (rows n0 .. n0 + 7 and n0 + 8 ..) over the summed columns c0 .. c0 + 15 of a tile
// stored [n][k] (b[0], b[1] for the first n-tile, b[2], b[3] for the second)
__device__ __forceinline__ void b_tiles(unsigned (&b)[4], const bf16* Y, int S, int n0, int c0, int lane) {
    load_tiles(b, Y + (n0 + (lane & 7) + 8 * (lane >> 4)) * S + c0 + 8 * ((lane >> 3) & 1));
}
// The same from a tile stored [k][n]: rows k0 .. k0 + 15 summed, columns n0 .. n0 + 15 the two n-tiles
__device__ __forceinline__ void b_tiles_t(unsigned (&b)[4], const bf16* Y, int S, int k0, int n0, int lane) {
    load_tiles_t(b, Y + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * S + n0 + 8 * (lane >> 4));
}

// A chunk's 16 token rows of 64 bf16 columns (row i at src + i stride) into a bf16 tile of row stride S, 16 bytes a
// copy over `threads` threads (thread index tid); rows from `rows` on read as zeros
template <int threads, int S>
__device__ __forceinline__ void copy_rows(bf16* dst, const bf16* src, i64 stride, int rows, int tid) {
#pragma unroll
    for (int j = 0; j < 16 * 8 / threads; j++) {
        const int e = tid + threads * j, t = e / 8, part = e % 8;
        copy16(dst + t * S + 8 * part, src + t * stride + 8 * part, t < rows);
    }
}
