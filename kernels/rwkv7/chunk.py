"""RWKV-7 (generalized delta rule, diagonal-plus-rank-one transition), chunked: the public call, its settings, the
launches and the custom ops around them (math and design in README.md; the Triton kernels in fwd.py and bwd.py).

    o, final_state = chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                                 cu_seqlens=None, w_bias=None, backend=None, settings=None)

r, w, k, a, b: [B, T, H, K]; v: [B, T, H, V]; w is the log decay (<= 0; computed and used in fp32), or with w_bias
[H * K] given RWKV-7's decay logits: the log decay is then decay.log_decay(w, w_bias), formed in fp32 inside the
kernel, and w's gradient comes in w's dtype. Initial and final states [N, H, K, V] fp32. cu_seqlens [N+1] packs N
sequences into B = 1. CUDA tensors go to the Triton kernel, CPU tensors to the PyTorch chunked path;
backend='triton' | 'torch' forces one (tests run the Triton kernel on CPU tensors under TRITON_INTERPRET=1, the sm_90
compile records its launches on meta tensors).

The Triton path is the operator flame::chunk_rwkv7 (backward: flame::chunk_rwkv7_bwd), so that torch.compile traces
a whole block through it without a graph break. The PyTorch path stays outside: it is differentiable and traceable
as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.launch import launch, register_fake
from kernels.limits import RWKV7_MAX_K
from kernels.rwkv7 import scan_cuda
from kernels.rwkv7.decay import DECAY_SCALE, log_decay
from kernels.rwkv7.torch_chunk import chunk_rwkv7_torch
from kernels.settings import check_choice, check_tiles_and_warps, from_text, to_text
from kernels.utils import cdiv, check_head_sizes, chunk_count, chunk_tables, next_pow2, packed_rows, scan_tile


BWD_WARPS = 4
"""Warps of _bwd_chunk: fixed, since with 8 Triton 3.6 builds its bf16 products with reads past the end of its
shared memory (compute-sanitizer: an invalid __shared__ read, then an illegal address at T = 512, H = 4)."""


@dataclass(frozen=True)
class Settings:
    """Tiles, warps and the shape-chosen scan regime of the Triton kernel. Fixed values instead of autotuning: a
    first call compiles each kernel once (benchmarks/bench_kernels.py --set rwkv7.field=value times others)."""

    chunk: int = 16
    """Tokens per chunk (16 only): a chunk's pairwise matrices, T and its level decays then fit in registers. At 32
    the per-chunk kernels spill (sm_90: 1.2 KB a thread in _fwd_prep, 1.7 KB in _bwd_chunk), the op took 1.8x as
    long, and its backward read an illegal address on an H200 (Triton 3.6)."""
    prec: str = "tf32"
    """Operand precision of the fp32 products ("tf32" or "ieee"): the scans' always, the per-chunk kernels' where
    their operands are not bf16; the interpreter computes exact fp32 whatever this says."""
    bf16_products: bool = True
    """For bf16 inputs, the per-chunk kernels' products (the pairwise matrices, A_ak v, every gradient of _bwd_chunk)
    take bf16 operands with fp32 accumulation, as FLA's kernels do. T = (I - A_ab)^{-1} and its products stay fp32,
    and so do the scans' state products."""
    chunk_bv: int = 64
    """V tile of the per-chunk kernels (_fwd_prep, _bwd_chunk): all of V at once for V <= 64."""
    scan_bv: int | None = None
    """V tile of the sequence scans and of the blocked scan's sequential part; None: kernels.utils.scan_tile, the
    widest tile that still gives about one program per SM."""
    scan_warps: int = 4
    """Warps of the Triton scans (sequence scans, block fills, the blocked scan's sequential part)."""
    cuda_scan: bool = True
    """The sequence scans, forward and backward, in CUDA (scan.cu, bwd_scan.cu: the state or its gradient held in
    tensor-core registers for the whole sequence) where scan_cuda.runs says they take the call (bf16, K = 64, V a
    multiple of 64, sm_90 or later, the default products: cuda_products); the Triton scans elsewhere and with False.
    Same inputs, outputs and products (tf32 operands, fp32 accumulation)."""
    cuda_prep: bool = True
    """The forward's per-chunk work in CUDA (prep.cu: a warp a chunk, three blocks of 4 an SM) where scan_cuda.runs
    says it takes the call (as cuda_scan's) and the decay comes from its logits (w_bias); the Triton _fwd_prep
    elsewhere and with False. Same outputs (bf16 mma products of the same bf16 factors, fp32 accumulation; T by forward
    substitution in fp32 where _fwd_prep multiplies out its product form, equal up to rounding)."""
    prep_warps: int = 4
    """Warps of _fwd_prep."""
    prep_maxnreg: int | None = 168
    """Register cap of _fwd_prep (None: ptxas decides, 192): 168 fits 3 blocks per SM for a few spilled bytes."""
    blocked_scan: bool | None = None
    """Blocked scans (the chunk steps of a block in parallel, one product per block in order) instead of sequence
    scans; None: blocked where the sequence scans would take narrow V tiles (few long sequences leave SMs idle)."""
    block_chunks: int = 32
    """Chunks per block of the blocked scans: longer blocks leave a shorter sequential part."""
    block_bv: int = 64
    """V tile of the blocked scans' per-block programs (the fills, and the backward's block map)."""
    block_map_bv: int = 128
    """Column tile of the forward's block maps [M | N] ([K, K + V]): 128 is one program per block and head at
    K = V = 64."""
    block_map_warps: int = 4
    """Warps of the forward's block maps."""
    keep_chunk_tensors: bool = True
    """The forward keeps for the backward every per-chunk tensor it forms besides the chunk states h (U, A_rb, A_rk,
    A_ak and T: 352 bytes per token and head at K = V = 64 in bf16, besides h's 512; and w by chunk, 256, where the
    backward does not form it from the logits: _forms_w). False: it keeps h alone (and the blocked scans' block maps)
    and the backward forms the rest again from the inputs and h, every chunk in parallel (_fwd_prep, then
    U = W h + Uv): what a layer's op keeps under selective checkpointing drops to 0.59 of it by the tensors' sizes
    (the 0.6B at 8 x 4096: 566 to 335 MB a layer), for a second _fwd_prep in the backward."""
    bwd_dh_chunks: int = 1024
    """Over equal rows the backward holds the chunk-end state gradients dh (fp32 K x V per chunk and head: 16 KiB at
    K = V = 64, twice the bf16 chunk state) for about this many chunks at a time instead of all: _bwd_scan and
    _bwd_chunk run in turn per group (sequence scans: segments of this / N chunks of every sequence, the last first,
    the state gradient carried between them; blocked scans: runs of this / block_chunks blocks). 0: all at once
    (packed sequences always). 1024: two groups at 8 x 4096, one pass's time for half its dh; each group costs
    two launches (tens of microseconds of host time each) and a last partial wave."""

    def __post_init__(self):
        check_choice(self, "chunk", (16,))
        check_tiles_and_warps(self)

    def scan_tile(self, V: int, sequences_x_heads: int) -> int:
        return self.scan_bv or scan_tile(V, sequences_x_heads)

    def bf16(self, r: torch.Tensor) -> bool:
        """Whether the per-chunk products take bf16 operands for inputs like r."""
        return self.bf16_products and r.dtype == torch.bfloat16

    def cuda_products(self, r: torch.Tensor) -> bool:
        """Whether these settings ask for the products the CUDA kernels take for inputs like r: bf16 operands for the
        per-chunk products (and the chunk states, U and dZ kept in bf16), tf32 operands for the fp32 ones."""
        return self.bf16(r) and self.prec == "tf32"

    def blocked(self, sequences: int, H: int, V: int) -> bool:
        """Whether the scans run blocked for this shape."""
        if self.blocked_scan is not None:
            return self.blocked_scan
        return self.scan_tile(V, sequences * H) < min(64, max(16, next_pow2(V)))


def kept_dtype(r: torch.Tensor, s: Settings) -> torch.dtype:
    """dtype of the chunk states h, of U and A_ak, kept for the backward, and of dZ (from _bwd_scan to _bwd_chunk):
    bf16 where _bwd_chunk's products take bf16 operands (its only reads of U, A_ak and dZ are such products, so bf16
    copies give the results of fp32 ones; h also enters the chunk decay's gradient sum(S0 * dS_C)), else fp32."""
    return torch.bfloat16 if s.bf16(r) else torch.float32


def _fp32(w_bias: torch.Tensor) -> torch.Tensor:
    """The decay's bias as the CUDA kernels read it: fp32 (exact for a bf16 parameter under FSDP's mixed precision, as
    the Triton kernels' loads)."""
    return w_bias.float().contiguous()


def _forms_w(r, w, w_bias, v, blocked: bool, s: Settings) -> bool:
    """Whether the backward forms the log decays from their logits (the CUDA scans' LOGITS builds serve the call:
    bf16 logits, sequence scans), so that the forward keeps no w by chunk; _bwd_chunk then forms them too, and so
    does the Triton _bwd_scan where the CUDA scan turns a call down. Elsewhere the Triton scans read w by chunk:
    formed inside their sequential loops it costs more than it saves (2 x 16384 x 20 heads: 4 %). Decided from what
    a fake tensor has too (the op's outputs are as many either way)."""
    return (w_bias is not None and w.dtype == torch.bfloat16 and not blocked and s.cuda_scan
            and scan_cuda.serves(scan_cuda.FORWARD_LOGITS, r, v, s.cuda_products(r)))


def _prep(r, w, w_bias, k, v, a, b, cu, tables, s: Settings, need_wf: bool = True):
    """_fwd_prep's launch (prep.cu's where it runs): W and Uv (fp32, for the scans), A_rb, A_rk, A_ak, T (the
    backward's) and w by chunk (None where need_wf is False and prep.cu runs: _forms_w)."""
    from kernels.rwkv7.fwd import _fwd_prep

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk, max(16, next_pow2(K))
    _, chunk_index, NT = tables
    f32 = dict(device=r.device, dtype=torch.float32)
    W = torch.empty(1, T, H, K, **f32)
    Uv = torch.empty(1, T, H, V, **f32)
    Arb, Ark, Tinv = (torch.empty(1, T, H, BT, **f32) for _ in range(3))
    # what only the backward's bf16 products read is stored in bf16 (half the memory kept per layer)
    Aak = torch.empty(1, T, H, BT, device=r.device, dtype=kept_dtype(r, s))
    # w feature-major by chunk (tl_utils.by_chunk): the scans that read w by chunk read it from this
    TT = NT * BT
    if (s.cuda_prep and w_bias is not None and w.dtype == torch.bfloat16
            and scan_cuda.runs(scan_cuda.PREP, r, v, (r, w, k, v, a, b), s.cuda_products(r))):
        wf = torch.empty(H, K, TT, **f32) if need_wf else None
        scan_cuda.fwd_prep(r, w, _fp32(w_bias), k, v, a, b, cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv, wf,
                           DECAY_SCALE, TT, NT)
        return W, Uv, Arb, Ark, Aak, Tinv, wf
    wf = torch.empty(H, K, TT, **f32)
    launch(_fwd_prep, (NT, H), r, w, w_bias, k, v, a, b, cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv, wf, TT,
           DECAY_SCALE, H=H, K=K, V=V, BT=BT, BK=BK, BV=min(s.chunk_bv, max(16, next_pow2(V))),
           LEVELS=BT.bit_length() - 1, LOGITS=w_bias is not None, BF16=s.bf16(r), PREC=s.prec, num_warps=s.prep_warps,
           maxnreg=s.prep_maxnreg)
    return W, Uv, Arb, Ark, Aak, Tinv, wf


def _chunk_tensors_again(r, w, w_bias, k, v, a, b, cu, tables, h, forms_w: bool, s: Settings):
    """What a forward with keep_chunk_tensors=False did not keep, formed again from the inputs and the chunk states:
    (U, A_rb, A_rk, A_ak, T, w by chunk: None where the scans form w from the logits)."""
    from kernels.rwkv7.fwd import _chunk_u

    W, Uv, Arb, Ark, Aak, Tinv, wf = _prep(r, w, w_bias, k, v, a, b, cu, tables, s, need_wf=not forms_w)
    _, T, H, K = r.shape
    V = v.shape[-1]
    U = torch.empty(1, T, H, V, device=r.device, dtype=kept_dtype(r, s))
    BV = min(s.chunk_bv, max(16, next_pow2(V)))
    launch(_chunk_u, (tables[2], H, cdiv(V, BV)), cu, tables[1], W, Uv, h, U, H=H, K=K, V=V, BT=s.chunk,
           BK=max(16, next_pow2(K)), BV=BV, PREC=s.prec)
    return U, Arb, Ark, Aak, Tinv, wf


def _fwd(r, w, w_bias, k, v, a, b, scale, h0, want_ht, cu, tables, blocks, s: Settings):
    from kernels.rwkv7.fwd import _block_scan, _fwd_scan

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk, max(16, next_pow2(K))
    chunk_offsets, chunk_index, NT = tables
    N = cu.numel() - 1
    f32 = dict(device=r.device, dtype=torch.float32)
    kept = dict(device=r.device, dtype=kept_dtype(r, s))
    forms_w = _forms_w(r, w, w_bias, v, blocks is not None, s)   # no w by chunk kept (nor stored for the CUDA scan)
    cuda = (blocks is None and s.cuda_scan
            and scan_cuda.runs(scan_cuda.forward(forms_w), r, v, (r, w, k, v, b) if forms_w else (r, k, v, b),
                               s.cuda_products(r)))
    W, Uv, Arb, Ark, Aak, Tinv, wf = _prep(r, w, w_bias, k, v, a, b, cu, tables, s, need_wf=not (forms_w and cuda))
    wf_kept = torch.empty(0, **f32) if forms_w else wf
    TT = NT * BT
    h = torch.empty(NT, H, K, V, **kept)
    U = torch.empty(1, T, H, V, **kept)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if want_ht else None
    BV = s.scan_tile(V, N * H)
    scan = dict(H=H, K=K, BT=BT, BK=BK, L=s.block_chunks, PREC=s.prec)
    tensors = (r, wf, k, v, b, cu, chunk_offsets)
    per_chunk = (W, Uv, Arb, Ark, h0, o, h, U, ht)
    if cuda:
        decay = (w, _fp32(w_bias)) if forms_w else (wf, None)
        scan_cuda.fwd_scan(r, *decay, DECAY_SCALE, k, v, b, cu, chunk_offsets, W, Uv, Arb, Ark, h0, o, h, U, ht, scale,
                           TT)
        return o, ht, (h, U, Arb, Ark, Aak, Tinv, wf_kept, None)
    if blocks is None:
        launch(_fwd_scan, (N, H, cdiv(V, BV)), *tensors, None, *per_chunk, None, None, scale, TT, V=V, BV=BV,
               BLOCKED=False, OUT=True, HAS_H0=h0 is not None, STORE_HT=want_ht, num_warps=s.scan_warps, **scan)
        return o, ht, (h, U, Arb, Ark, Aak, Tinv, wf_kept, None)
    block_offsets, block_index, NB = blocks
    # per block, all at once: the block's map S_end = M S_start + N (M: the identity's columns carried through),
    # both as one [K, K + V] state
    Mb = torch.empty(NB, H, K, K, **f32)
    Nb = torch.empty(NB, H, K, V, **f32)
    BVb, BVm = min(s.block_bv, max(16, next_pow2(V))), min(s.block_map_bv, next_pow2(K + V))
    launch(_fwd_scan, (NB, H, cdiv(K + V, BVm)), *tensors, block_index, *per_chunk, Nb, Mb, scale, TT, V=V,
           BV=BVm, BLOCKED=True, OUT=False, HAS_H0=False, STORE_HT=False, num_warps=s.block_map_warps, **scan)
    # in order, one product per block: the state entering every block (and the final state)
    hb = torch.empty(NB, H, K, V, **f32)
    launch(_block_scan, (N, H, cdiv(V, BV)), cu, block_offsets, Mb, Nb, h0, hb, ht, H=H, K=K, V=V,
           BL=BT * s.block_chunks, BK=BK, BV=BV, REVERSE=False, HAS_S0=h0 is not None, STORE_END=want_ht,
           PREC=s.prec, num_warps=s.scan_warps)
    # per block again: the chunk states, U and the output from the block's entering state
    launch(_fwd_scan, (NB, H, cdiv(V, BVb)), *tensors, block_index, *per_chunk, hb, None, scale, TT, V=V,
           BV=BVb, BLOCKED=True, OUT=True, HAS_H0=False, STORE_HT=False, num_warps=s.scan_warps, **scan)
    return o, ht, (h, U, Arb, Ark, Aak, Tinv, wf_kept, Mb)


def _bwd(r, w, w_bias, k, v, a, b, scale, h0, cu, seq_len, saved, tables, blocks, do, dht, s: Settings):
    from kernels.rwkv7.bwd import _bwd_chunk, _bwd_scan
    from kernels.rwkv7.fwd import _block_scan

    h, U, Arb, Ark, Aak, Tinv, wf, Mb = saved
    forms_w = _forms_w(r, w, w_bias, v, blocks is not None, s)   # as the forward decided: it kept no w by chunk
    if not s.keep_chunk_tensors:
        U, Arb, Ark, Aak, Tinv, wf = _chunk_tensors_again(r, w, w_bias, k, v, a, b, cu, tables, h, forms_w, s)
    chunk_offsets, chunk_index, NT = tables
    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk, max(16, next_pow2(K))
    N = cu.numel() - 1
    f32 = dict(device=r.device, dtype=torch.float32)
    # dZ: only _bwd_chunk's products read it, as bf16 operands where they take such (chunk.kept_dtype)
    dZ = torch.empty(1, T, H, V, device=r.device, dtype=kept_dtype(r, s))
    dr, dk, da, db = (torch.empty_like(x) for x in (r, k, a, b))
    dw = torch.empty_like(w)   # the logits' gradient in their dtype, or the log decay's (fp32)
    dv = torch.empty_like(v)
    BV = s.scan_tile(V, N * H)
    TT = NT * BT
    scan = dict(H=H, K=K, V=V, BT=BT, BK=BK, L=s.block_chunks, FORM_W=forms_w, PREC=s.prec)
    tensors = (r, w, w_bias, wf, a, b, do, cu, chunk_offsets)
    ops = (r, w, w_bias, wf, k, v, a, b, do, cu, chunk_index, Ark, Aak, h)
    grads = (U, dZ, dr, dw, dk, dv, da, db, scale, TT, DECAY_SCALE)
    per_chunk = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=min(s.chunk_bv, max(16, next_pow2(V))),
                     LEVELS=BT.bit_length() - 1, LOGITS=w_bias is not None, FORM_W=forms_w, BF16=s.bf16(r),
                     PREC=s.prec, num_warps=BWD_WARPS)
    C = NT // N if seq_len else 0   # chunks per sequence (equal rows)
    L = max(1, s.bwd_dh_chunks // N)
    # the CUDA scan reads the bf16 logits or w by chunk (where do's alignment turns it down, the Triton scan forms w
    # from the logits as well)
    cuda_w, cuda_bias = (w, _fp32(w_bias)) if forms_w else (wf, None)
    cuda = (blocks is None and s.cuda_scan
            and scan_cuda.runs(scan_cuda.backward(forms_w), r, v, (r, cuda_w, a, b, do), s.cuda_products(r)))

    def sequence_scan(dS_end, dh, dS_start, first, count, segment):
        """_bwd_scan's sequence role (in CUDA where it runs): dh and dZ from dS at the sequences' (or segments') ends,
        dS at their starts to dS_start where given."""
        if cuda:
            scan_cuda.bwd_scan(r, cuda_w, cuda_bias, DECAY_SCALE, a, b, do, cu, chunk_offsets, Arb, Tinv, dS_end, dh,
                               dZ, dS_start, scale, TT, first, count, segment)
        else:
            launch(_bwd_scan, (N, H, cdiv(V, BV)), *tensors, None, Arb, Tinv, dS_end, dh, dZ, dS_start, None, scale,
                   TT, DECAY_SCALE, first, count, BV=BV, BLOCKED=False, OUT=True, SEGMENT=segment,
                   HAS_DHT=dS_end is not None, STORE_DH0=dS_start is not None, num_warps=s.scan_warps, **scan)

    if blocks is None and s.bwd_dh_chunks and L < C:
        # segments of L chunks of every sequence, the last first: dh holds one segment's chunk ends, the gradient
        # dS carried from segment to segment in dS (read at a segment's end, written at its start)
        dh = torch.empty(N * L, H, K, V, **f32)
        dS = torch.empty(N, H, K, V, **f32)
        for first in reversed(range(0, C, L)):
            count = min(L, C - first)
            dS_end = dS if first + count < C else dht
            sequence_scan(dS_end, dh, dS, first, count, True)
            launch(_bwd_chunk, (N * count, H), *ops, dh, *grads, first, count, C, **per_chunk)
        return dr, dw, dk, dv, da, db, dS if h0 is not None else None
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    if blocks is None:
        dh = torch.empty(NT, H, K, V, **f32)
        sequence_scan(dht, dh, dh0, 0, 0, False)
        launch(_bwd_chunk, (NT, H), *ops, dh, *grads, 0, NT, 0, **per_chunk)
    else:
        block_offsets, block_index, NB = blocks
        BVb = min(s.block_bv, max(16, next_pow2(V)))
        grid = (NB, H, cdiv(V, BVb))
        # per block: R in dS_start = M^T dS_end + R; in reverse order: dS at every block's end; per block: the rest
        Rb = torch.empty(NB, H, K, V, **f32)
        launch(_bwd_scan, grid, *tensors, block_index, Arb, Tinv, None, None, dZ, None, Rb, scale, TT, DECAY_SCALE, 0,
               0, BV=BVb, BLOCKED=True, OUT=False, SEGMENT=False, HAS_DHT=False, STORE_DH0=False,
               num_warps=s.scan_warps, **scan)
        dhb = torch.empty(NB, H, K, V, **f32)
        launch(_block_scan, (N, H, cdiv(V, BV)), cu, block_offsets, Mb, Rb, dht, dhb, dh0, H=H, K=K, V=V,
               BL=BT * s.block_chunks, BK=BK, BV=BV, REVERSE=True, HAS_S0=dht is not None, STORE_END=h0 is not None,
               PREC=s.prec, num_warps=s.scan_warps)
        # the fill and the per-chunk gradients in turn per run of GB blocks (equal rows: a run's chunks are one
        # range of global chunks, [c_lo, c_hi)); dh holds one run's chunk ends
        Lb = s.block_chunks
        GB = max(1, s.bwd_dh_chunks // Lb) if C and s.bwd_dh_chunks else NB
        per_seq = cdiv(C, Lb) if C else 1
        dh = torch.empty(min(NT, GB * Lb) if C else NT, H, K, V, **f32)
        for g0 in range(0, NB, GB):
            g1 = min(NB, g0 + GB)
            c_lo, c_hi = 0, NT
            if C:   # block g is block g % per_seq of sequence g // per_seq
                c_lo = g0 // per_seq * C + g0 % per_seq * Lb
                c_hi = (g1 - 1) // per_seq * C + min(((g1 - 1) % per_seq + 1) * Lb, C)
            launch(_bwd_scan, (g1 - g0, H, cdiv(V, BVb)), *tensors, block_index[g0:], Arb, Tinv, None, dh, dZ,
                   None, dhb[g0:], scale, TT, DECAY_SCALE, c_lo, 0, BV=BVb, BLOCKED=True, OUT=True, SEGMENT=False,
                   HAS_DHT=False, STORE_DH0=False, num_warps=s.scan_warps, **scan)
            launch(_bwd_chunk, (c_hi - c_lo, H), *ops, dh, *grads, c_lo, c_hi - c_lo, 0, **per_chunk)
    return dr, dw, dk, dv, da, db, dh0


def _tables(cu, total: int, seq_len: int, H: int, V: int, s: Settings):
    """(chunk tables, block tables or None): seq_len 0 means packed sequences of unknown lengths."""
    seq_len = seq_len or None
    tables = chunk_tables(cu, s.chunk, total, seq_len)
    if not s.blocked(cu.numel() - 1, H, V):
        return tables, None
    return tables, chunk_tables(cu, s.chunk * s.block_chunks, total, seq_len)


# The Triton kernel as one operator torch.compile traces as a whole (no graph break), with the backward a second one.
# Packed inputs [1, T, H, *] (w fp32, or the decay's logits with w_bias [H * K]), cu int32 [N+1]; seq_len the common
# length of equal rows or 0. Besides o and the final state, the forward returns what the backward reads: the chunk
# states h, U, the chunk matrices, w by chunk and (blocked scans) the block maps Mb.
def _forward_op(r, w, w_bias, k, v, a, b, scale, h0, want_ht, cu, seq_len, settings):
    s = from_text("rwkv7", settings)
    tables, blocks = _tables(cu, r.shape[1], seq_len, r.shape[2], v.shape[3], s)
    o, ht, saved = _fwd(r, w, w_bias, k, v, a, b, scale, h0, want_ht, cu, tables, blocks, s)
    if not s.keep_chunk_tensors:   # h and Mb kept; U, A_rb, A_rk, A_ak, T and w by chunk formed again in backward
        saved = (saved[0], *(x.new_empty(0) for x in saved[1:7]), saved[7])
    return o, ht, *saved


chunk_rwkv7_op = torch.library.custom_op(
    "flame::chunk_rwkv7", _forward_op, mutates_args=(),
    schema="(Tensor r, Tensor w, Tensor? w_bias, Tensor k, Tensor v, Tensor a, Tensor b, float scale, Tensor? h0, "
           "bool want_ht, Tensor cu, SymInt seq_len, str settings) -> (Tensor o, Tensor? ht, Tensor h, Tensor U, "
           "Tensor Arb, Tensor Ark, Tensor Aak, Tensor Tinv, Tensor wf, Tensor? Mb)")


def _fake_forward(r, w, w_bias, k, v, a, b, scale, h0, want_ht, cu, seq_len, settings):
    s = from_text("rwkv7", settings)
    _, T, H, K = r.shape
    V, N, BT = v.shape[3], cu.shape[0] - 1, s.chunk
    NT = chunk_count(N, BT, T, seq_len or None)
    f32 = lambda *shape: r.new_empty(shape, dtype=torch.float32)  # noqa: E731
    Mb = None
    if s.blocked(N, H, V):
        Mb = f32(chunk_count(N, BT * s.block_chunks, T, seq_len or None), H, K, K)
    kept = lambda *shape: r.new_empty(shape, dtype=kept_dtype(r, s))  # noqa: E731
    per_chunk = (kept(1, T, H, V), f32(1, T, H, BT), f32(1, T, H, BT), kept(1, T, H, BT), f32(1, T, H, BT),
                 f32(H, K, NT * BT))
    if not s.keep_chunk_tensors:
        per_chunk = tuple(x.new_empty(0) for x in per_chunk)
    if _forms_w(r, w, w_bias, v, Mb is not None, s):
        per_chunk = (*per_chunk[:5], per_chunk[5].new_empty(0))
    return (torch.empty_like(v), f32(N, H, K, V) if want_ht else None, kept(NT, H, K, V), *per_chunk, Mb)


def _backward_op(r, w, w_bias, k, v, a, b, scale, h0, cu, seq_len, settings, h, U, Arb, Ark, Aak, Tinv, wf, Mb, do,
                 dht):
    s = from_text("rwkv7", settings)
    tables, blocks = _tables(cu, r.shape[1], seq_len, r.shape[2], v.shape[3], s)
    saved = (h, U, Arb, Ark, Aak, Tinv, wf, Mb)
    return _bwd(r, w, w_bias, k, v, a, b, scale, h0, cu, seq_len, saved, tables, blocks, do, dht, s)


chunk_rwkv7_bwd_op = torch.library.custom_op(
    "flame::chunk_rwkv7_bwd", _backward_op, mutates_args=(),
    schema="(Tensor r, Tensor w, Tensor? w_bias, Tensor k, Tensor v, Tensor a, Tensor b, float scale, Tensor? h0, "
           "Tensor cu, SymInt seq_len, str settings, Tensor h, Tensor U, Tensor Arb, Tensor Ark, Tensor Aak, "
           "Tensor Tinv, Tensor wf, Tensor? Mb, Tensor do, Tensor? dht) -> (Tensor dr, Tensor dw, Tensor dk, "
           "Tensor dv, Tensor da, Tensor db, Tensor? dh0)")


def _fake_backward(r, w, w_bias, k, v, a, b, scale, h0, cu, seq_len, settings, h, U, Arb, Ark, Aak, Tinv, wf, Mb,
                   do, dht):
    return (*(torch.empty_like(x) for x in (r, w, k, v, a, b)), None if h0 is None else torch.empty_like(h0))


def _autograd_setup(ctx, inputs, output):
    r, w, w_bias, k, v, a, b, scale, h0, want_ht, cu, seq_len, settings = inputs
    saved = output[2:]
    ctx.mark_non_differentiable(*(x for x in saved if x is not None))
    # no zero gradients made for the saved outputs (as large as the chunk states); an unused o gets one below
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(r, w, w_bias, k, v, a, b, h0, cu, *saved)
    ctx.scale, ctx.seq_len, ctx.settings = scale, seq_len, settings


def _autograd_backward(ctx, do, dht, *_):
    r, w, w_bias, k, v, a, b, h0, cu, *saved = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dht = None if dht is None else dht.contiguous()
    dr, dw, dk, dv, da, db, dh0 = chunk_rwkv7_bwd_op(r, w, w_bias, k, v, a, b, ctx.scale, h0, cu, ctx.seq_len,
                                                     ctx.settings, *saved, do, dht)
    # the bias's gradient: the logits' gradient (as stored, in their dtype) summed over the tokens in fp32, read as
    # stored (an fp32 copy of dw first would be twice its size at the backward's peak, and a pass of its own)
    d_bias = None if w_bias is None else dw.sum((0, 1), dtype=torch.float32).view(w_bias.shape).to(w_bias.dtype)
    return dr, dw, d_bias, dk, dv, da, db, None, dh0, None, None, None, None


chunk_rwkv7_op.register_autograd(_autograd_backward, setup_context=_autograd_setup)
register_fake(chunk_rwkv7_op, _fake_forward, _forward_op)
register_fake(chunk_rwkv7_bwd_op, _fake_backward, _backward_op)


MAX_K = RWKV7_MAX_K
"""Largest key head size of the Triton kernel (kernels/limits.py says why)."""


def _chunk_rwkv7_triton(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, w_bias,
                        settings: str):
    B, T, H, K = r.shape
    V = v.shape[-1]
    cu, flat = packed_rows(B, T, H, cu_seqlens, r.device)
    # The log decay stays fp32 whatever the model's dtype (bf16 log decays near 0 lose the slow channels); logits are
    # taken as they come (the kernel forms the log decay from them in fp32).
    r_, k_, v_, a_, b_ = (flat(x) for x in (r, k, v, a, b))
    w_ = flat(w.float() if w_bias is None else w)
    bias = None if w_bias is None else w_bias.reshape(H * K).contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht, *_ = chunk_rwkv7_op(r_, w_, bias, k_, v_, a_, b_, float(scale), h0, bool(output_final_state), cu,
                               T if cu_seqlens is None else 0, settings)
    return o.reshape(B, T, H, V), ht


def chunk_rwkv7(r, w, k, v, a, b, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, w_bias=None, backend: str | None = None, settings: Settings | None = None):
    """RWKV-7 over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, final state or None).
    With `w_bias`, w holds the decay's logits (module docstring). `settings` tunes the Triton kernel (None:
    Settings())."""
    if backend is None:
        backend = "triton" if r.is_cuda and triton is not None else "torch"
    if backend == "triton":
        check_head_sizes("chunk_rwkv7", {"K": r.shape[-1], "V": v.shape[-1]}, {"K": MAX_K})
    if backend == "torch":
        if w_bias is not None:
            w = log_decay(w, w_bias)
        return chunk_rwkv7_torch(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_rwkv7_triton(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, w_bias,
                               "" if settings is None else to_text(settings))


try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None
