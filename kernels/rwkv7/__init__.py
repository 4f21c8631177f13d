"""RWKV-7 (generalized delta rule, diagonal-plus-rank-one transition), chunked.

    o, final_state = chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                                 cu_seqlens=None, backend=None)

r, w, k, a, b: [B, T, H, K]; v: [B, T, H, V]; w is the log decay (<= 0; computed and used in fp32). Initial and final
states [N, H, K, V] fp32. cu_seqlens [N+1] packs N sequences into B = 1. CUDA tensors go to the Triton kernel, CPU
tensors to the PyTorch chunked path; backend='triton' | 'torch' forces one (tests run the Triton kernel on CPU
tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch

from kernels.rwkv7.naive import naive_rwkv7
from kernels.rwkv7.torch_chunk import chunk_rwkv7_torch
from kernels.utils import as_varlen, chunk_tables, next_pow2, scan_tile

__all__ = ["chunk_rwkv7", "naive_rwkv7", "chunk_rwkv7_torch"]

CHUNK = 16
# fp32 dots on tensor cores run as tf32 (10-bit mantissa), enough for bf16 models; the interpreter computes exactly.
PREC = "tf32"
# Operand precision of the per-chunk kernels' products (_fwd_prep, _bwd_chunk): "tf32", or "bf16" (FLA's choice;
# sums stay fp32). The scans, whose state products compound over the sequence, always take PREC.
CHUNK_PREC = "tf32"
# V tile of the per-chunk kernels
CHUNK_BV = 64
# V tile of the two sequential scans (None: by heuristic) and their warps. Fixed configs instead of autotuning:
# a first call compiles each kernel once. scripts/bench_kernels.py --sweep times the alternatives.
SCAN_BV: int | None = None
SCAN_WARPS = 4
# warps of the two per-chunk kernels (forward prep, backward intra-chunk)
PREP_WARPS = 4
BWD_WARPS = 4
# A register cap (ptxas .maxnreg) for _fwd_prep (None: ptxas decides, 192 per thread with LEVEL_SUMS: 2 blocks per
# SM). 168 allows 3 blocks at 32 spilled bytes (scripts/kernel_resources.py). H100, B=8 T=4096: 5.49 ms fwd+bwd
# against 5.70 uncapped; 128 (4 blocks, 160 bytes spilled) 5.48, 144 5.51.
PREP_MAXNREG: int | None = 168


def _scan_bv(V: int, sequences_x_heads: int) -> int:
    """V tile of the scans. On an H100 (H=16, V=64; scripts/bench_kernels.py --sweep): B=8 x T=4096 is fastest
    with 64 (6.43 ms fwd+bwd; 32: 7.10), B=2 x T=16384 with 16 (9.75 ms; 32: 10.03, 64: 10.52): the same rule as
    GSA's scans."""
    return SCAN_BV or scan_tile(V, sequences_x_heads)


# Blocked scans (fwd.py): for few long sequences the sequential scans leave most of the GPU idle, one program per
# sequence, head and narrow V tile, each waiting on one chunk step after another (ncu: one instruction per 4.8
# cycles per warp, one warp per scheduler). The blocked scan does the chunk steps in parallel per block of
# BLOCK_CHUNKS chunks (three times the work: the block maps M and N, then the fill) and keeps one product per block
# sequential. None: blocked when the sequence scan would take narrow V tiles (too few programs to fill the GPU).
# H100, B=2 T=16384 fwd+bwd: 9.33 ms unblocked; blocks of 4, 8, 16, 32, 64 chunks: 7.03, 6.66, 6.48, 6.37, 6.37
# (one run); 6.18, 5.99, 5.88, 5.87 for 8 to 64 in a later run. B=8 T=4096 (sequence scans by default): blocked 6.56
# against 5.72.
BLOCK_SCAN: bool | None = None
BLOCK_CHUNKS = 32
# V tile of the blocked scan's per-block programs (fills, and the backward's map)
BLOCK_BV = 64
# Column tile of the forward's block maps [M | N] ([K, K + V]; 128: one program per block and head at K = V = 64;
# 64 takes M and N apart, as two programs) and their warps
BLOCK_MAP_BV = 128
BLOCK_MAP_WARPS = 4


def _blocked(sequences: int, H: int, V: int) -> bool:
    if BLOCK_SCAN is not None:
        return BLOCK_SCAN
    return _scan_bv(V, sequences * H) < min(64, max(16, next_pow2(V)))


# _fwd_prep's level decays summed over half blocks (True) or differenced against a row gathered by a one-hot product
# (False); see levels.py. H100, B=8 T=4096: the same 5.70 ms alone, 5.49 against 5.58 with the register cap (the sums
# hold fewer registers). _bwd_chunk always sums (the gathered form measured the same there: 3.06 against 3.04 ms).
LEVEL_SUMS = True

# _fwd_prep also stores w feature-major by chunk ([H, K, chunks x BT], each chunk's tokens contiguous and aligned:
# tl_utils.by_chunk), and the scans and _bwd_chunk read that copy: their [BK, BT] log-decay tiles then hold a chunk's
# tokens along a warp's lanes, so the cumulative sums over the chunk stay within a warp instead of crossing the 4
# warps through shared memory. H100 fwd+bwd: B=8 T=4096 4.81 -> 4.30 ms, B=2 T=16384 5.48 -> 4.91 (one run).
W_FEATURE_MAJOR = True


def _chunk_prec() -> str:
    # the interpreter computes bf16 dots wrongly: there every product is exact fp32
    return "ieee" if os.environ.get("TRITON_INTERPRET") == "1" else CHUNK_PREC


def _fwd(r, w, k, v, a, b, scale, h0, want_ht, cu, tables, blocks):
    from kernels.rwkv7.fwd import _block_scan, _fwd_prep, _fwd_scan

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = CHUNK, max(16, next_pow2(K))
    chunk_offsets, chunk_index, NT = tables
    N = cu.numel() - 1
    f32 = dict(device=r.device, dtype=torch.float32)
    W = torch.empty(1, T, H, K, **f32)
    Uv = torch.empty(1, T, H, V, **f32)
    Arb, Ark, Aak, Tinv = (torch.empty(1, T, H, BT, **f32) for _ in range(4))
    TT = NT * BT   # the row length of w's feature-major copy (tl_utils.by_chunk)
    wf = torch.empty(H, K, TT, **f32) if W_FEATURE_MAJOR else None
    _fwd_prep[(NT, H)](r, w, k, v, a, b, cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv, wf, TT,
                       H=H, K=K, V=V, BT=BT, BK=BK, BV=min(CHUNK_BV, max(16, next_pow2(V))),
                       LEVELS=BT.bit_length() - 1, PREC=_chunk_prec(), SUMS=LEVEL_SUMS, STORE_WF=wf is not None,
                       num_warps=PREP_WARPS,
                       **({} if PREP_MAXNREG is None else {"maxnreg": PREP_MAXNREG}))
    h = torch.empty(NT, H, K, V, **f32)
    U = torch.empty(1, T, H, V, **f32)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if want_ht else None
    BV = _scan_bv(V, N * H)
    # the scans read w's feature-major copy too
    scan = dict(H=H, K=K, BT=BT, BK=BK, L=BLOCK_CHUNKS, PREC=PREC, W_FM=wf is not None, TT=TT,
                num_warps=SCAN_WARPS)
    tensors = (r, w if wf is None else wf, k, v, b, cu, chunk_offsets)
    per_chunk = (W, Uv, Arb, Ark, h0, o, h, U, ht)
    if blocks is None:
        _fwd_scan[(N, H, triton.cdiv(V, BV))](*tensors, None, *per_chunk, None, None, scale, V=V, BV=BV,
                                              BLOCKED=False, OUT=True, HAS_H0=h0 is not None, STORE_HT=want_ht,
                                              **scan)
        return o, ht, (h, U, Arb, Ark, Aak, Tinv, wf, None), (chunk_offsets, chunk_index, NT), None
    block_offsets, block_index, NB = blocks
    # per block, all at once: the block's map S_end = M S_start + N (M: the identity's columns carried through),
    # both as one [K, K + V] state
    Mb = torch.empty(NB, H, K, K, **f32)
    Nb = torch.empty(NB, H, K, V, **f32)
    BVb, BVm = min(BLOCK_BV, max(16, next_pow2(V))), min(BLOCK_MAP_BV, next_pow2(K + V))
    _fwd_scan[(NB, H, triton.cdiv(K + V, BVm))](*tensors, block_index, *per_chunk, Nb, Mb, scale, V=V, BV=BVm,
                                                BLOCKED=True, OUT=False, HAS_H0=False, STORE_HT=False,
                                                **dict(scan, num_warps=BLOCK_MAP_WARPS))
    # in order, one product per block: the state entering every block (and the final state)
    hb = torch.empty(NB, H, K, V, **f32)
    _block_scan[(N, H, triton.cdiv(V, BV))](cu, block_offsets, Mb, Nb, h0, hb, ht, H=H, K=K, V=V,
                                            BL=BT * BLOCK_CHUNKS, BK=BK, BV=BV, REVERSE=False,
                                            HAS_S0=h0 is not None, STORE_END=want_ht, PREC=PREC,
                                            num_warps=SCAN_WARPS)
    # per block again: the chunk states, U and the output from the block's entering state
    _fwd_scan[(NB, H, triton.cdiv(V, BVb))](*tensors, block_index, *per_chunk, hb, None, scale, V=V, BV=BVb,
                                            BLOCKED=True, OUT=True, HAS_H0=False, STORE_HT=False, **scan)
    return o, ht, (h, U, Arb, Ark, Aak, Tinv, wf, Mb), (chunk_offsets, chunk_index, NT), blocks


def _bwd(r, w, k, v, a, b, scale, h0, cu, saved, tables, blocks, do, dht):
    from kernels.rwkv7.bwd import _bwd_chunk, _bwd_scan
    from kernels.rwkv7.fwd import _block_scan

    h, U, Arb, Ark, Aak, Tinv, wf, Mb = saved
    chunk_offsets, chunk_index, NT = tables
    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = CHUNK, max(16, next_pow2(K))
    N = cu.numel() - 1
    f32 = dict(device=r.device, dtype=torch.float32)
    dh = torch.empty(NT, H, K, V, **f32)
    dZ = torch.empty(1, T, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    BV = _scan_bv(V, N * H)
    TT = NT * BT   # the row length of w's feature-major copy
    scan = dict(H=H, K=K, V=V, BT=BT, BK=BK, L=BLOCK_CHUNKS, PREC=PREC, W_FM=wf is not None, TT=TT,
                num_warps=SCAN_WARPS)
    tensors = (r, w if wf is None else wf, a, b, do, cu, chunk_offsets)
    if blocks is None:
        _bwd_scan[(N, H, triton.cdiv(V, BV))](*tensors, None, Arb, Tinv, dht, dh, dZ, dh0, None, scale, BV=BV,
                                              BLOCKED=False, OUT=True, HAS_DHT=dht is not None,
                                              STORE_DH0=h0 is not None, **scan)
    else:
        block_offsets, block_index, NB = blocks
        BVb = min(BLOCK_BV, max(16, next_pow2(V)))
        grid = (NB, H, triton.cdiv(V, BVb))
        # per block: R in dS_start = M^T dS_end + R; in reverse order: dS at every block's end; per block: the rest
        Rb = torch.empty(NB, H, K, V, **f32)
        _bwd_scan[grid](*tensors, block_index, Arb, Tinv, None, dh, dZ, None, Rb, scale, BV=BVb, BLOCKED=True,
                        OUT=False, HAS_DHT=False, STORE_DH0=False, **scan)
        dhb = torch.empty(NB, H, K, V, **f32)
        _block_scan[(N, H, triton.cdiv(V, BV))](cu, block_offsets, Mb, Rb, dht, dhb, dh0, H=H, K=K, V=V,
                                                BL=BT * BLOCK_CHUNKS, BK=BK, BV=BV, REVERSE=True,
                                                HAS_S0=dht is not None, STORE_END=h0 is not None, PREC=PREC,
                                                num_warps=SCAN_WARPS)
        _bwd_scan[grid](*tensors, block_index, Arb, Tinv, None, dh, dZ, None, dhb, scale, BV=BVb, BLOCKED=True,
                        OUT=True, HAS_DHT=False, STORE_DH0=False, **scan)
    dr, dk, da, db = (torch.empty_like(x) for x in (r, k, a, b))
    dw = torch.empty_like(w)
    dv = torch.empty_like(v)
    BV = min(CHUNK_BV, max(16, next_pow2(V)))
    _bwd_chunk[(NT, H)](r, w if wf is None else wf, k, v, a, b, do, cu, chunk_index, Ark, Aak, h, dh, U, dZ,
                        dr, dw, dk, dv, da, db, scale, TT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                        LEVELS=BT.bit_length() - 1, PREC=_chunk_prec(), W_FM=wf is not None,
                        num_warps=BWD_WARPS)
    return dr, dw, dk, dv, da, db, dh0


class _ChunkRWKV7(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, scale, h0, want_ht, cu, tables, blocks):
        o, ht, saved, ctx.tables, ctx.blocks = _fwd(r, w, k, v, a, b, scale, h0, want_ht, cu, tables, blocks)
        ctx.save_for_backward(r, w, k, v, a, b, h0, cu, *saved)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, w, k, v, a, b, h0, cu, *saved = ctx.saved_tensors
        dr, dw, dk, dv, da, db, dh0 = _bwd(r, w, k, v, a, b, ctx.scale, h0, cu, saved, ctx.tables, ctx.blocks,
                                           do.contiguous(), None if dht is None else dht.contiguous())
        return dr, dw, dk, dv, da, db, None, dh0, None, None, None, None


# Opaque to torch.compile: the model's blocks compile around this call (a graph break here, as the GPU timings in
# the README were measured), instead of Dynamo tracing into the kernel launches.
@torch.compiler.disable
def _chunk_rwkv7_triton(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens):
    B, T, H, K = r.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        assert B == 1, "cu_seqlens needs B == 1 (sequences packed along T)"
    cu = as_varlen(B, T, cu_seqlens, r.device)
    flat = lambda x: x.reshape(1, B * T, H, x.shape[-1]).contiguous()  # noqa: E731
    # The decay stays fp32 whatever the model's dtype (bf16 log decays near 0 lose the slow channels).
    r_, k_, v_, a_, b_ = (flat(x) for x in (r, k, v, a, b))
    w_ = flat(w.float())
    h0 = None if initial_state is None else initial_state.float().contiguous()
    seq_len = T if cu_seqlens is None else None
    tables = chunk_tables(cu, CHUNK, B * T, seq_len)
    blocks = chunk_tables(cu, CHUNK * BLOCK_CHUNKS, B * T, seq_len) if _blocked(cu.numel() - 1, H, V) else None
    o, ht = _ChunkRWKV7.apply(r_, w_, k_, v_, a_, b_, float(scale), h0, bool(output_final_state), cu, tables,
                              blocks)
    return o.reshape(B, T, H, V), ht


def chunk_rwkv7(r, w, k, v, a, b, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, backend: str | None = None):
    """RWKV-7 over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, final state or None)."""
    if backend is None:
        backend = "triton" if r.is_cuda and _triton_ok() else "torch"
    if backend == "torch":
        return chunk_rwkv7_torch(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_rwkv7_triton(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None
