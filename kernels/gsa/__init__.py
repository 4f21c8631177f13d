"""GSA (Gated Slot Attention): two gated linear-attention passes joined by a softmax over M memory slots, chunked.

    o, final_state = chunk_gsa(q, k, v, s, g, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, backend=None)

q, k: [B, T, H, K]; v: [B, T, H, V]; s (slot writes), g (log forget gate, <= 0; computed and used in fp32):
[B, T, H, M]. scale None means K^-0.5. States are a pair (Hk [N, H, K, M], Hv [N, H, M, V]), fp32. cu_seqlens [N+1]
packs N sequences into B = 1. CUDA tensors go to the Triton kernel, CPU tensors to the PyTorch chunked path;
backend='triton' | 'torch' forces one (tests run the Triton kernel on CPU tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.gsa.naive import naive_gsa
from kernels.gsa.torch_chunk import chunk_gsa_torch
from kernels.utils import as_varlen, chunk_tables, is_interpreting, next_pow2, scan_tile

__all__ = ["chunk_gsa", "naive_gsa", "chunk_gsa_torch"]

# Chunk length (16 or 32; the pairwise decays take log2(CHUNK) levels); None: 32 where it fits, else 16. Fixed
# configs instead of autotuning: a first call compiles each kernel once. scripts/bench_gsa.py --sweep times the
# alternatives: on an H100 (B=8, T=4096, H=4, K=V=256, M=64) fwd+bwd took 6.9 ms at 16 and 5.9 ms at 32 (8 chunk
# warps, 4 scan warps, the defaults). Compiled for sm_90 (no GPU needed, tests/kernels/test_gsa.py), the backward's
# per-chunk kernel needs 105 KiB of shared memory at CHUNK = 16 and 164 KiB at 32 with M = 64, 205 KiB at 16 with
# M = 128 (an H100 block has 227 KiB): 32 fits only M <= 64, 64 none.
CHUNK: int | None = None
# fp32 dots on tensor cores run as tf32 (10-bit mantissa), enough for bf16 models; the interpreter computes exactly.
PREC = "tf32"
SCAN_BD: int | None = None   # D tile of the state scans (None: kernels.utils.scan_tile's choice)
SCAN_WARPS = 4
# The fed scans load the next chunk's e^{G_C} before the step's state store instead of after it (fwd.scan_tile)
EGC_EARLY = True
# The backward's pairwise-decay work apart from the states (the pair matrix dA1 and ds's part within a chunk, from
# A1 = q k^T kept by _fwd_out and D2 = do v^T kept by _bwd_dz, each fp32 [T, H, chunk]) in a kernel of its own,
# _bwd_pairs, and A2 kept by _fwd_out: _bwd_dkvsg then only streams the states and the features. In one kernel, the
# levels' decays were held across its K and V loops (255 registers, 224 spilled bytes per thread).
PAIRS_KERNEL = True
# On CUDA, _bwd_pairs runs on a second stream beside the backward's reverse state scan (independent of it; the scan
# has about two programs per SM and leaves registers and shared memory for one of _bwd_pairs' blocks).
PAIRS_STREAM = True
# OUT_SCAN (with FEED_SCAN): the forward stores neither chunk state. The key-state scan runs alone and, with
# LOGITS_SCAN, forms from each D tile its part of the slot logits' inter-chunk term q Hk^T ([T, H, M] fp32 per
# tile, summed by _fwd_out in a fixed order) instead of storing Hk; _fwd_out forms p (PASS 1), then A2 and p e^{G}
# (PASS 4); the value-state scan (_out_scan) forms each chunk's output o = (p e^{G}) Hv + A2 v from the state it
# holds instead of storing Hv. Each chunk state is fp32 M x K or M x V per chunk and head: the forward's largest
# traffic. The two scans then run one after the other, each with half the programs, so None (the default) turns it
# on only where one state's scan alone still has a program per SM (_out_scan_on). H100 fwd+bwd, B=8 T=4096:
# 2.59 ms (2.64 without LOGITS_SCAN) against 2.75 off; B=2 T=16384 (32 sequence-heads): 3.28 against 2.93 off.
OUT_SCAN: bool | None = None
LOGITS_SCAN = True
OUT_SCAN_PASSES = 2   # _fwd_out's launches before _out_scan: 2 (PASS 1, PASS 4) or 1 (PASS 3: spills 768 bytes)
OUT_SCAN_BD: int | None = None   # D tile of _out_scan (None: kernels.utils.scan_tile's choice for one state)
KEY_SCAN_BD: int | None = None   # D tile of the key-state scan before it
# Register caps (ptxas maxnreg; None: none) of the per-chunk kernels: at 128 registers two blocks of 8 warps fit on
# an SM instead of one. sm_90: _bwd_dkvsg 176 -> 128 registers with 16 spilled bytes. H100, B=8 T=4096 fwd+bwd:
# 3.07 -> 2.89 ms with _bwd_dkvsg's cap (0.91 -> 0.73 ms).
DKVSG_MAXNREG: int | None = 128
# _bwd_pairs: 4 warps uncapped (255 registers, 56 spilled bytes, two blocks per SM) against 8 warps capped at 128
# (160 spilled bytes, two blocks): H100 B=8 T=4096 0.30 -> 0.28 ms.
PAIRS_WARPS = 4
PAIRS_MAXNREG: int | None = None
DZ_MAXNREG: int | None = None    # _bwd_dz: 128 spills 584 bytes
OUT_MAXNREG: int | None = None   # _fwd_out (4 warps, two blocks per SM uncapped): 168 spills 184-512 bytes
# Warps of the backward's per-chunk kernels (fewer register spills than 4 in ptxas' report; H100, B=8 T=4096:
# 3.91 ms fwd+bwd against 5.91 with 4) and of the forward's _fwd_out (forward 1.16 ms against 1.41 with 8).
CHUNK_WARPS = 8
OUT_WARPS = 4
# _fwd_out as one launch (1) or two (2: the slot logits and softmax, then the output from the stored p; fewer
# registers live in each, no spills)
OUT_PASSES = 2
# The scans' inputs with their decays applied (s e^{sum_{j>t} g_j} from a small per-chunk kernel, kept for the
# backward's rescan; p e^G and dZr e^G from _bwd_dz) and e^{G_C} per chunk, all fp32, so that the scans' sequential
# loops form no cumulative sum and no exp (245 instead of 994 sm_90 instructions per step). The same values either
# way. H100 fwd+bwd: B=8 T=4096 4.29 ms against 4.51; B=2 T=16384 4.86 against 6.37 (both with 32-wide tiles).
FEED_SCAN = True
# With FEED_SCAN and bf16 x (k, v; q, do): the fed weights are stored as bf16 halves hi + lo (16 mantissa bits, tf32
# keeps 10) and each scan step is two bf16 products whose operands the tensor cores read from shared memory as they
# were loaded; a tf32 product needs both transposed through registers first (fp32 inputs keep the tf32 step).
SPLIT_SCAN = True
# With FEED_SCAN: _gate_factors also stores g slot-major by chunk ([H, M, chunks x BT], each chunk's tokens contiguous),
# and _fwd_out and _bwd_dz read that copy: their cumulative sums over a chunk's tokens then stay within a warp instead
# of crossing the warps through shared memory (fwd.load_gates_by_chunk). H100 B=8 T=4096 fwd+bwd 3.36 -> 3.14 ms.
# _bwd_dkvsg keeps reading g: on the copy it spilled 1.6 KB of registers per thread (sm_90, offline).
G_SLOT_MAJOR = True


def _cap(maxnreg):
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def _split(*xs) -> bool:
    return FEED_SCAN and SPLIT_SCAN and all(x.dtype == torch.bfloat16 for x in xs)


def _chunk(M: int) -> int:
    return CHUNK or (32 if _slots(M) <= 64 else 16)


def _tile(D: int) -> int:
    return min(64, max(16, next_pow2(D)))


def _slots(M: int) -> int:
    """All M slots in one tile: the softmax runs over the whole row."""
    return max(16, next_pow2(M))


def _scan(g, cu, tables, first, second, want_ht, reverse, egc=None, split=False, logits_q=None):
    """The [M, D] state recursion of every chunk (fwd: states at chunk starts; reverse: gradients at chunk ends) of
    two states at once, each given as (w, x, h0): returns (states, final state or None) for each. With `egc`
    (e^{G_C} per chunk) the w come with their decays applied (FEED_SCAN). `second` None: the first state only
    (OUT_SCAN), returned alone; with `logits_q` (LOGITS_SCAN) its "states" are then the slot logits' inter-chunk
    parts from each D tile, fp32 [1, T, H, tiles x M], not the states."""
    from kernels.gsa.fwd import _state_scan

    chunk_offsets, _, NT = tables
    H, M = g.shape[2], g.shape[3]
    N = cu.numel() - 1
    alone = second is None
    (w1, x1, h01), (w2, x2, h02) = first, first if alone else second
    if (h01 is None) != (h02 is None):   # one final-state gradient unused: it is zero
        h01, h02 = (torch.zeros(N, H, M, x.shape[3], device=x.device) if h is None else h
                    for h, x in ((h01, x1), (h02, x2)))
    D1, D2 = x1.shape[3], 0 if alone else x2.shape[3]
    # about one program per SM counting both states' tiles (H100: B=2 T=16384 4.86 ms fwd+bwd with 32-wide tiles,
    # 5.42 with 16; B=8 T=4096 the same at 64 and 32)
    BD = (KEY_SCAN_BD or scan_tile(D1, N * H)) if alone else SCAN_BD or scan_tile(max(D1, D2), 2 * N * H)
    f32 = dict(device=g.device, dtype=torch.float32)
    out = []
    for x in (x1,) if alone else (x1, x2):
        hs = torch.empty(NT, H, M, x.shape[3], **f32) if logits_q is None else None
        out.append((hs, torch.empty(N, H, M, x.shape[3], **f32) if want_ht else None))
    zp = None if logits_q is None else torch.empty(*g.shape[:3], triton.cdiv(D1, BD) * M, **f32)
    if alone:
        out.append((None, None))
    grid = (N, H, triton.cdiv(D1, BD) + triton.cdiv(D2, BD))
    _state_scan[grid](w1, x1, h01, *out[0], w2, x2, h02, *out[1], g, egc, cu, chunk_offsets, logits_q, zp,
                      H=H, M=M, D1=D1, D2=D2, BT=_chunk(M), BM=_slots(M), BD=BD, REVERSE=reverse,
                      HAS_H0=h01 is not None, STORE_HT=want_ht, PREC=PREC, FEED=egc is not None,
                      SPLIT=split, EXACT=is_interpreting(), EGC_EARLY=EGC_EARLY, LOGITS=zp is not None,
                      num_warps=SCAN_WARPS)
    if not alone:
        return out
    return (out[0][0] if zp is None else zp), out[0][1]


def _out_scan_on(N: int, H: int, V: int) -> bool:
    """OUT_SCAN's choice for N sequences of H heads: with None, where one state's scan alone still has a program
    per SM at 64-wide tiles (H100: B=8 T=4096 fwd+bwd 2.59 ms against 2.75; at B=2 T=16384 its 32 sequence-heads
    would leave the SMs idle: 3.28 against 2.93)."""
    if not FEED_SCAN:
        return False
    return OUT_SCAN if OUT_SCAN is not None else N * H * triton.cdiv(V, 64) >= 128


def _out_scan(sE, v, hv0, want_ht, pe, a2, cu, tables, egc, split):
    """(OUT_SCAN) The forward's value-state scan forming the output o (v's dtype) from p e^{G} and A2: returns
    (o, final value state or None)."""
    from kernels.gsa.fwd import _out_scan as kernel

    chunk_offsets, _, _ = tables
    N, H, M, V = cu.numel() - 1, v.shape[2], pe.shape[3], v.shape[3]
    o = torch.empty_like(v)
    hvt = torch.empty(N, H, M, V, device=v.device, dtype=torch.float32) if want_ht else None
    BD = OUT_SCAN_BD or scan_tile(V, N * H)
    kernel[(N, H, triton.cdiv(V, BD))](sE, v, hv0, hvt, egc, cu, chunk_offsets, pe, a2, o, H=H, M=M, D=V,
                                       BT=_chunk(M), BM=_slots(M), BD=BD, HAS_H0=hv0 is not None,
                                       STORE_HT=want_ht, PREC=PREC, SPLIT=split, EXACT=is_interpreting(),
                                       EGC_EARLY=EGC_EARLY, num_warps=SCAN_WARPS)
    return o, hvt


def _dims(q, v, s):
    K, V, M = q.shape[-1], v.shape[-1], s.shape[-1]
    BT = _chunk(M)
    return dict(H=q.shape[2], K=K, V=V, M=M, BT=BT, BK=_tile(K), BV=_tile(V), BM=_slots(M),
                LEVELS=BT.bit_length() - 1, PREC=PREC, num_warps=CHUNK_WARPS)


def _gate_factors(s, g, cu, tables, split):
    """(s e^{sum_{j>t} g_j} [1, T, H, M] fp32, or [1, T, H, 2M] bf16 halves when split; e^{G_C} [NT, H, M]; g
    slot-major by chunk [H, M, NT x BT] or None) for the fed forward scans, or (s, None, None) unfed."""
    if not FEED_SCAN:
        return s, None, None
    from kernels.gsa.fwd import _gate_factors as kernel

    H, M = g.shape[2], g.shape[3]
    BT, NT = _chunk(M), tables[2]
    sE = _fed(g, split)
    egc = torch.empty(NT, H, M, device=g.device, dtype=torch.float32)
    gf = torch.empty(H, M, NT * BT, device=g.device, dtype=torch.float32) if G_SLOT_MAJOR else None
    kernel[(NT, H)](s, g, cu, tables[1], sE, egc, gf, NT * BT, H=H, M=M, BT=BT, BM=_slots(M), SPLIT=split,
                    STORE_GF=gf is not None)
    return sE, egc, gf


def _fed(g, split):
    """A scan's fed weights: fp32 [1, T, H, M], or bf16 [1, T, H, 2M] (hi | lo halves) when split."""
    if split:
        return torch.empty(*g.shape[:3], 2 * g.shape[3], device=g.device, dtype=torch.bfloat16)
    return torch.empty(g.shape, device=g.device, dtype=torch.float32)


def _fwd(q, k, v, s, g, scale, hk0, hv0, want_ht, cu, tables):
    from kernels.gsa.fwd import _fwd_out

    split = _split(k, v)
    sE, egc, gf = _gate_factors(s, g, cu, tables, split)
    out_scan = _out_scan_on(cu.numel() - 1, q.shape[2], v.shape[3])
    zp = None
    if out_scan:
        hv = None
        if LOGITS_SCAN:   # the key scan forms the slot logits' inter-chunk parts: no key state is stored either
            (zp, hkt), hk = _scan(g, cu, tables, (sE, k, hk0), None, want_ht, False, egc, split, q), None
        else:
            hk, hkt = _scan(g, cu, tables, (sE, k, hk0), None, want_ht, False, egc, split)
    else:
        (hk, hkt), (hv, hvt) = _scan(g, cu, tables, (sE, k, hk0), (sE, v, hv0), want_ht, False, egc, split)
    o = None if out_scan else torch.empty_like(v)   # (_out_scan makes it)
    f32 = dict(device=g.device, dtype=torch.float32)
    # the softmax p and the slot logits, kept for the backward (fp32 [T, H, M]): recomputing them there took
    # longer (H100, B=8 T=4096: 4.04 ms fwd+bwd against 3.91)
    p, z = (torch.empty(g.shape, **f32) for _ in range(2))
    BT = _chunk(g.shape[3])
    # A1 = q k^T and A2 (p against s) for the backward's _bwd_pairs and _bwd_dkvsg (PAIRS_KERNEL; A2 also for
    # _out_scan)
    a1 = torch.empty(*g.shape[:3], BT, **f32) if PAIRS_KERNEL else None
    a2 = torch.empty(*g.shape[:3], BT, **f32) if PAIRS_KERNEL or out_scan else None
    pe = torch.empty(g.shape, **f32) if out_scan else None
    passes = ((1, 4) if OUT_SCAN_PASSES == 2 else (3,)) if out_scan else (1, 2) if OUT_PASSES == 2 else (0,)
    for npass in passes:
        _fwd_out[(tables[2], q.shape[2])](q, k, v, s, g if gf is None else gf, cu, tables[1], hk, hv, o, p, z, a1,
                                          a2, pe, zp, scale, tables[2] * BT, PASS=npass, G_SM=gf is not None,
                                          KEEP_A=a1 is not None, NZP=0 if zp is None else zp.shape[3] // g.shape[3],
                                          **_cap(OUT_MAXNREG),
                                          **dict(_dims(q, v, s), num_warps=OUT_WARPS))
    if out_scan:
        o, hvt = _out_scan(sE, v, hv0, want_ht, pe, a2, cu, tables, egc, split)
    return o, hkt, hvt, (sE if FEED_SCAN else None, egc, p, z, gf, a1, a2 if PAIRS_KERNEL else None)


def _bwd(q, k, v, s, g, scale, hk0, hv0, cu, tables, do, dhkt, dhvt, sE, egc, p, z, gf, a1, a2):
    from kernels.gsa.bwd import _bwd_dkvsg, _bwd_dz, _bwd_pairs

    (hk, _), (hv, _) = _scan(g, cu, tables, (s if sE is None else sE, k, hk0), (s if sE is None else sE, v, hv0),
                             False, False, egc, sE is not None and sE.dtype == torch.bfloat16)
    grid = (tables[2], q.shape[2])
    f32 = dict(device=q.device, dtype=torch.float32)
    dz, dg = (torch.empty(g.shape, **f32) for _ in range(2))
    split = egc is not None and _split(q, do)
    pe, dze = (_fed(g, split) for _ in range(2)) if egc is not None else (p, dz)
    dims = _dims(q, v, s)
    TT = tables[2] * dims["BT"]
    pairs = a1 is not None
    d2 = torch.empty_like(a1) if pairs else None
    _bwd_dz[grid](v, s, g if gf is None else gf, do, cu, tables[1], hv, p, z, dz, dg, pe, dze, d2, scale, TT,
                  FEED=egc is not None, SPLIT=split, G_SM=gf is not None, STORE_D2=pairs, **_cap(DZ_MAXNREG),
                  **{n: x for n, x in dims.items() if n not in ("K", "BK")})   # it reads no key-side tensor
    dsi = da1 = None
    main = side = torch.cuda.current_stream() if q.is_cuda and PAIRS_STREAM else None
    if pairs:
        dsi, da1 = torch.empty(g.shape, **f32), torch.empty_like(a1)
        if main is not None:   # beside the reverse scan, which is independent of it
            side = torch.cuda.Stream(device=q.device)
            side.wait_stream(main)
        with torch.cuda.stream(side):   # (None: the current stream)
            # g as it is, not its slot-major copy: the copy's layout spilled here (624 bytes against none, sm_90)
            _bwd_pairs[grid](s, g, p, dz, a1, d2, cu, tables[1], dsi, da1, **_cap(PAIRS_MAXNREG),
                             **{n: dims[n] for n in ("H", "M", "BT", "BM", "LEVELS", "PREC")}, num_warps=PAIRS_WARPS)
    (dhk, dhk0), (dhv, dhv0) = _scan(g, cu, tables, (dze, q, dhkt), (pe, do, dhvt), hk0 is not None, True, egc,
                                     split)
    if pairs and main is not None:
        # every tensor it touched was allocated on the main stream and is freed after this wait
        main.wait_stream(side)
    dq, dk, dv, ds = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(s)
    g_sm = pairs and gf is not None   # without the levels, the copy's layout no longer spills (see G_SLOT_MAJOR)
    _bwd_dkvsg[grid](q, k, v, s, gf if g_sm else g, do, cu, tables[1], hk, hv, dhk, dhv, p, dz, dq, dk, dv, ds, dg,
                     dsi, a2, da1, TT, PAIRS=pairs, G_SM=g_sm, **_cap(DKVSG_MAXNREG if pairs else None), **dims)
    return dq, dk, dv, ds, dg, dhk0, dhv0


class _ChunkGSA(torch.autograd.Function):
    """Packed inputs [1, T, H, *]; states in the kernels' layout: Hk^T [N, H, M, K] and Hv [N, H, M, V]."""

    @staticmethod
    def forward(ctx, q, k, v, s, g, scale, hk0, hv0, want_ht, cu, tables):
        o, hkt, hvt, fed = _fwd(q, k, v, s, g, scale, hk0, hv0, want_ht, cu, tables)
        # only the inputs and small [T, H, M] factors (FEED_SCAN's, the softmax) are kept: the backward rescans
        # the chunk states (cheap) instead of holding them
        ctx.save_for_backward(q, k, v, s, g, hk0, hv0, cu, *fed)
        ctx.tables, ctx.scale = tables, scale
        return o, hkt, hvt

    @staticmethod
    def backward(ctx, do, dhkt, dhvt):
        q, k, v, s, g, hk0, hv0, cu, *fed = ctx.saved_tensors
        c = lambda x: None if x is None else x.contiguous()  # noqa: E731
        dq, dk, dv, ds, dg, dhk0, dhv0 = _bwd(q, k, v, s, g, ctx.scale, hk0, hv0, cu, ctx.tables,
                                              do.contiguous(), c(dhkt), c(dhvt), *fed)
        return dq, dk, dv, ds, dg, None, dhk0, dhv0, None, None, None


# Opaque to torch.compile: the model's blocks compile around this call (a graph break here), instead of Dynamo
# tracing into the kernel launches.
@torch.compiler.disable
def _chunk_gsa_triton(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens):
    B, T, H, K = q.shape
    V, M = v.shape[-1], s.shape[-1]
    if cu_seqlens is not None:
        assert B == 1, "cu_seqlens needs B == 1 (sequences packed along T)"
    BT = _chunk(M)
    assert BT >= 16 and BT & (BT - 1) == 0, "CHUNK must be a power of two >= 16"
    cu = as_varlen(B, T, cu_seqlens, q.device)
    flat = lambda x: x.reshape(1, B * T, H, x.shape[-1]).contiguous()  # noqa: E731
    # The gate stays fp32 whatever the model's dtype (bf16 log gates near 0 lose the slow slots).
    q_, k_, v_, s_ = (flat(x) for x in (q, k, v, s))
    g_ = flat(g.float())
    hk0 = hv0 = None
    if initial_state is not None:
        hk0 = initial_state[0].float().transpose(-1, -2).contiguous()
        hv0 = initial_state[1].float().contiguous()
    tables = chunk_tables(cu, BT, B * T, T if cu_seqlens is None else None)
    o, hkt, hvt = _ChunkGSA.apply(q_, k_, v_, s_, g_, float(scale), hk0, hv0, bool(output_final_state), cu, tables)
    final = (hkt.transpose(-1, -2), hvt) if output_final_state else None
    return o.reshape(B, T, H, V), final


def chunk_gsa(q, k, v, s, g, scale: float | None = None, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, backend: str | None = None):
    """GSA over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, (Hk, Hv) fp32 or None)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if initial_state is not None and (len(initial_state) != 2 or any(x is None for x in initial_state)):
        raise ValueError("initial_state must be a pair (Hk [N, H, K, M], Hv [N, H, M, V])")
    if backend is None:
        backend = "triton" if q.is_cuda and triton is not None else "torch"
    if backend == "torch":
        return chunk_gsa_torch(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_gsa_triton(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)


try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None
