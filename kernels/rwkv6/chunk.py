"""RWKV-6 ("Finch": diagonal data-dependent decay and a bonus for the current token), chunked: the public call, its
settings, the launches and the custom ops around them (math and design in README.md; the Triton kernels in scan.py,
fwd.py and bwd.py).

    o, final_state = chunk_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False,
                                 cu_seqlens=None, backend=None, settings=None)

r, k, w: [B, T, H, K]; v: [B, T, H, V]; u (bonus): [H, K]; w is the log decay (<= 0; computed and used in fp32).
scale None means K^-0.5. Initial and final states [N, H, K, V] fp32. cu_seqlens [N+1] packs N sequences into B = 1.
CUDA tensors go to the Triton kernel, CPU tensors to the PyTorch chunked path; backend='triton' | 'torch' forces one
(tests run the Triton kernel on CPU tensors under TRITON_INTERPRET=1, the sm_90 compile records its launches on meta
tensors).

The Triton path is the operator flame::chunk_rwkv6 (backward: flame::chunk_rwkv6_bwd), so that torch.compile traces
a whole block through it without a graph break. The PyTorch path stays outside: it is differentiable and traceable
as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.launch import launch, register_fake
from kernels.limits import RWKV6_MAX_K
from kernels.rwkv6.torch_chunk import chunk_rwkv6_torch
from kernels.settings import check_choice, check_tiles_and_warps, from_text, to_text
from kernels.utils import cdiv, check_head_sizes, chunk_count, chunk_tables, next_pow2, packed_rows, scan_tile


@dataclass(frozen=True)
class Settings:
    """Tiles, warps and the shape-chosen scan regime of the Triton kernel. Fixed values instead of autotuning: a
    first call compiles each kernel once (benchmarks/bench_kernels.py --set rwkv6.field=value times others)."""

    chunk: int = 32
    """Tokens per chunk (16 or 32): longer chunks mean fewer sequential scan steps and fewer stored states, at the
    price of a larger pairwise matrix per chunk; at 64 _bwd_chunk's tiles outgrow its registers (2.5 KB spilled per
    thread on sm_90, benchmarks/kernel_resources.py)."""
    wide_k_chunk: int = 16
    """Tokens per chunk where K > 64 (16 or 32): at K = 128 and chunks of 32, _bwd_chunk spills 1 KB per thread."""
    prec: str = "tf32"
    """Operand precision of the fp32 products ("tf32" or "ieee"): the scans' always, the per-chunk kernels' where
    their operands are not bf16; the interpreter computes exact fp32 whatever this says."""
    bf16_products: bool = True
    """For bf16 inputs, the per-chunk kernels' products (the pairwise matrix, the output, every gradient) take bf16
    operands with fp32 accumulation, as FLA's kernels do: about 1.1x faster than fp32 operands at B=8 T=4096, at about
    1.5x their error against an fp64 reference (README.md). The scans' state products stay fp32."""
    chunk_bv: int = 128
    """Widest V tile of the per-chunk kernels (_fwd_out, _bwd_chunk; chunk_tile): all of V at once up to 128; a loop
    over V tiles makes _bwd_chunk spill (4.7 KB per thread at K = V = 128 in tiles of 64)."""
    scan_bv: int | None = None
    """V tile of the sequence scans; None: kernels.utils.scan_tile, the widest tile that still gives about one
    program per SM."""
    scan_warps: int = 4
    """Warps of the scans (_scan, _block_scan)."""
    out_warps: int = 4
    """Warps of _fwd_out."""
    bwd_warps: int = 8
    """Warps of _bwd_chunk (it holds A, dA and six [chunk, K] tiles at once)."""
    blocked_scan: bool | None = None
    """Blocked scans (each block's map from zero, all blocks at once; the blocks in order, elementwise since the
    transition is diagonal; then each block's fill from its entering state) instead of sequence scans; None: blocked
    where the sequence scans would take narrow V tiles (few long sequences leave SMs idle)."""
    block_chunks: int = 32
    """Chunks per block of the blocked scans: longer blocks mean fewer block programs and a longer sequential
    part within each."""
    block_bv: int = 64
    """V tile of the blocked scans' per-block programs (maps and fills)."""

    def __post_init__(self):
        for name in ("chunk", "wide_k_chunk"):
            check_choice(self, name, (16, 32))
        check_tiles_and_warps(self)

    def chunk_size(self, K: int) -> int:
        return self.chunk if K <= 64 else self.wide_k_chunk

    def scan_tile(self, V: int, sequences_x_heads: int) -> int:
        return self.scan_bv or scan_tile(V, sequences_x_heads)

    def bf16(self, r: torch.Tensor) -> bool:
        """Whether the per-chunk products take bf16 operands for inputs like r."""
        return self.bf16_products and r.dtype == torch.bfloat16

    def chunk_tile(self, K: int, V: int) -> int:
        """V tile of the per-chunk kernels: all of V at once where the [K, V] state tiles are small; else a loop over
        tiles of at most 8192 / K columns, since a looped tile is double-buffered (at K = V = 256 in tiles of 128,
        _bwd_chunk would need 545 KB of shared memory, 137 KB in tiles of 32; an H100 block has 227)."""
        BK, whole = max(16, next_pow2(K)), max(16, next_pow2(V))
        if whole <= self.chunk_bv and BK * whole <= 16384:
            return whole
        return max(16, min(self.chunk_bv, 8192 // BK))

    def blocked(self, sequences: int, H: int, V: int) -> bool:
        """Whether the scans run blocked for this shape."""
        if self.blocked_scan is not None:
            return self.blocked_scan
        return self.scan_tile(V, sequences * H) < min(64, max(16, next_pow2(V)))


def _scan_states(x, y, w, scale, first, want_last, cu, tables, blocks, s: Settings, reverse: bool):
    """The state on entering each chunk, fp32 [NT, H, K, V], and after the last (None unless want_last), from
    `first` (or zero): forward (x = k, y = v, scale 1) h and the final state from h0; reverse (x = r, y = do, the
    output's scale) dh, the gradient at each chunk's end, and dh0 from dht. Blocked scans when `blocks` is not None."""
    from kernels.rwkv6.scan import _block_scan, _scan

    _, _, H, K = x.shape
    V = y.shape[-1]
    BT, BK = s.chunk_size(K), max(16, next_pow2(K))
    chunk_offsets, _, NT = tables
    N = cu.numel() - 1
    f32 = dict(device=x.device, dtype=torch.float32)
    states = torch.empty(NT, H, K, V, **f32)
    last = torch.empty(N, H, K, V, **f32) if want_last else None
    BV = s.scan_tile(V, N * H)
    scan = dict(H=H, K=K, V=V, BT=BT, BK=BK, L=s.block_chunks, REVERSE=reverse, PREC=s.prec, num_warps=s.scan_warps)
    if blocks is None:
        launch(_scan, (N, H, cdiv(V, BV)), x, y, w, cu, chunk_offsets, None, first, states, last, None, scale,
               BV=BV, BLOCKED=False, STORE_CHUNK=True, HAS_FIRST=first is not None, STORE_LAST=want_last, **scan)
        return states, last
    block_offsets, block_index, NB = blocks
    BVb = min(s.block_bv, max(16, next_pow2(V)))
    # per block, all at once: its last state from zero and its log decay; then the blocks in walk order; then the fill
    sb = torch.empty(NB, H, K, V, **f32)
    gb = torch.empty(NB, H, K, **f32)
    launch(_scan, (NB, H, cdiv(V, BVb)), x, y, w, cu, chunk_offsets, block_index, None, None, sb, gb, scale,
           BV=BVb, BLOCKED=True, STORE_CHUNK=False, HAS_FIRST=False, STORE_LAST=True, **scan)
    s_in = torch.empty(NB, H, K, V, **f32)
    launch(_block_scan, (N, H, cdiv(V, BV)), block_offsets, gb, sb, first, s_in, last, H=H, K=K, V=V, BK=BK,
           BV=BV, REVERSE=reverse, HAS_S0=first is not None, STORE_END=want_last, num_warps=s.scan_warps)
    launch(_scan, (NB, H, cdiv(V, BVb)), x, y, w, cu, chunk_offsets, block_index, s_in, states, None, None,
           scale, BV=BVb, BLOCKED=True, STORE_CHUNK=True, HAS_FIRST=True, STORE_LAST=False, **scan)
    return states, last


def _fwd(r, k, v, w, u, scale, h0, want_ht, cu, tables, blocks, s: Settings):
    from kernels.rwkv6.fwd import _fwd_out

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk_size(K), max(16, next_pow2(K))
    _, chunk_index, NT = tables
    h, ht = _scan_states(k, v, w, 1.0, h0, want_ht, cu, tables, blocks, s, reverse=False)
    o = torch.empty_like(v)
    a = torch.empty(NT, H, BT, BT, device=r.device, dtype=torch.float32)
    launch(_fwd_out, (NT, H), r, k, v, w, u, h, o, a, cu, chunk_index, scale, H=H, K=K, V=V, BT=BT, BK=BK,
           BV=s.chunk_tile(K, V), LEVELS=BT.bit_length() - 1, BF16=s.bf16(r), PREC=s.prec, num_warps=s.out_warps)
    return o, ht, h, a


def _bwd(r, k, v, w, u, scale, h0, cu, h, a, tables, blocks, do, dht, s: Settings):
    from kernels.rwkv6.bwd import _bwd_chunk

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk_size(K), max(16, next_pow2(K))
    _, chunk_index, NT = tables
    dh, dh0 = _scan_states(r, do, w, scale, dht, h0 is not None, cu, tables, blocks, s, reverse=True)
    dr, dk, dv, dw = (torch.empty_like(x) for x in (r, k, v, w))
    # each chunk's share of du (spare chunks of a packed batch write nothing: zeros)
    du = torch.zeros(NT, H, K, device=r.device, dtype=torch.float32)
    launch(_bwd_chunk, (NT, H), r, k, v, w, u, do, h, dh, a, cu, chunk_index, dr, dk, dv, dw, du, scale, H=H, K=K,
           V=V, BT=BT, BK=BK, BV=s.chunk_tile(K, V), LEVELS=BT.bit_length() - 1, BF16=s.bf16(r), PREC=s.prec,
           num_warps=s.bwd_warps)
    return dr, dk, dv, dw, du.sum(0).to(u.dtype), dh0


def _tables(cu, total: int, seq_len: int, K: int, H: int, V: int, s: Settings):
    """(chunk tables, block tables or None): seq_len 0 means packed sequences of unknown lengths."""
    seq_len = seq_len or None
    BT = s.chunk_size(K)
    tables = chunk_tables(cu, BT, total, seq_len)
    if not s.blocked(cu.numel() - 1, H, V):
        return tables, None
    return tables, chunk_tables(cu, BT * s.block_chunks, total, seq_len)


# The Triton kernel as one operator torch.compile traces as a whole (no graph break), with the backward a second one.
# Packed inputs [1, T, H, *] (w fp32), cu int32 [N+1]; seq_len the common length of equal rows or 0. Besides o and
# the final state, the forward returns what the backward reads: the chunk states h and the pairwise matrices a.
def _forward_op(r, k, v, w, u, scale, h0, want_ht, cu, seq_len, settings):
    s = from_text("rwkv6", settings)
    tables, blocks = _tables(cu, r.shape[1], seq_len, r.shape[3], r.shape[2], v.shape[3], s)
    return _fwd(r, k, v, w, u, scale, h0, want_ht, cu, tables, blocks, s)


chunk_rwkv6_op = torch.library.custom_op(
    "flame::chunk_rwkv6", _forward_op, mutates_args=(),
    schema="(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, float scale, Tensor? h0, bool want_ht, Tensor cu, "
           "SymInt seq_len, str settings) -> (Tensor o, Tensor? ht, Tensor h, Tensor a)")


def _fake_forward(r, k, v, w, u, scale, h0, want_ht, cu, seq_len, settings):
    s = from_text("rwkv6", settings)
    _, T, H, K = r.shape
    V, N = v.shape[3], cu.shape[0] - 1
    BT = s.chunk_size(K)
    NT = chunk_count(N, BT, T, seq_len or None)
    f32 = lambda *shape: r.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return torch.empty_like(v), f32(N, H, K, V) if want_ht else None, f32(NT, H, K, V), f32(NT, H, BT, BT)


def _backward_op(r, k, v, w, u, scale, h0, cu, seq_len, settings, h, a, do, dht):
    s = from_text("rwkv6", settings)
    tables, blocks = _tables(cu, r.shape[1], seq_len, r.shape[3], r.shape[2], v.shape[3], s)
    return _bwd(r, k, v, w, u, scale, h0, cu, h, a, tables, blocks, do, dht, s)


chunk_rwkv6_bwd_op = torch.library.custom_op(
    "flame::chunk_rwkv6_bwd", _backward_op, mutates_args=(),
    schema="(Tensor r, Tensor k, Tensor v, Tensor w, Tensor u, float scale, Tensor? h0, Tensor cu, SymInt seq_len, "
           "str settings, Tensor h, Tensor a, Tensor do, Tensor? dht) -> (Tensor dr, Tensor dk, Tensor dv, Tensor dw, "
           "Tensor du, Tensor? dh0)")


def _fake_backward(r, k, v, w, u, scale, h0, cu, seq_len, settings, h, a, do, dht):
    return (*(torch.empty_like(x) for x in (r, k, v, w, u)), None if h0 is None else torch.empty_like(h0))


def _autograd_setup(ctx, inputs, output):
    r, k, v, w, u, scale, h0, want_ht, cu, seq_len, settings = inputs
    h, a = output[2:]
    ctx.mark_non_differentiable(h, a)
    # no zero gradient made for the chunk states; an unused o gets one below
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(r, k, v, w, u, h0, cu, h, a)
    ctx.scale, ctx.seq_len, ctx.settings = scale, seq_len, settings


def _autograd_backward(ctx, do, dht, _h, _a):
    r, k, v, w, u, h0, cu, h, a = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dr, dk, dv, dw, du, dh0 = chunk_rwkv6_bwd_op(r, k, v, w, u, ctx.scale, h0, cu, ctx.seq_len, ctx.settings, h, a, do,
                                                 None if dht is None else dht.contiguous())
    return dr, dk, dv, dw, du, None, dh0, None, None, None, None


chunk_rwkv6_op.register_autograd(_autograd_backward, setup_context=_autograd_setup)
register_fake(chunk_rwkv6_op, _fake_forward, _forward_op)
register_fake(chunk_rwkv6_bwd_op, _fake_backward, _backward_op)


MAX_K = RWKV6_MAX_K
"""Largest key head size of the Triton kernel (kernels/limits.py says why)."""


def _chunk_rwkv6_triton(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, settings: str):
    B, T, H, K = r.shape
    V = v.shape[-1]
    cu, flat = packed_rows(B, T, H, cu_seqlens, r.device)
    # The decay stays fp32 whatever the model's dtype (bf16 log decays near 0 lose the slow channels).
    r_, k_, v_ = (flat(x) for x in (r, k, v))
    w_ = flat(w.float())
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht, _, _ = chunk_rwkv6_op(r_, k_, v_, w_, u.contiguous(), float(scale), h0, bool(output_final_state), cu,
                              T if cu_seqlens is None else 0, settings)
    return o.reshape(B, T, H, V), ht


def chunk_rwkv6(r, k, v, w, u, scale: float | None = None, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, backend: str | None = None, settings: Settings | None = None):
    """RWKV-6 over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, final state or None).
    `settings` tunes the Triton kernel (None: Settings())."""
    if backend is None:
        backend = "triton" if r.is_cuda and triton is not None else "torch"
    if backend == "triton":
        check_head_sizes("chunk_rwkv6", {"K": r.shape[-1], "V": v.shape[-1]}, {"K": MAX_K})
    if scale is None:
        scale = r.shape[-1] ** -0.5
    if backend == "torch":
        return chunk_rwkv6_torch(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_rwkv6_triton(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                               "" if settings is None else to_text(settings))


try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None
