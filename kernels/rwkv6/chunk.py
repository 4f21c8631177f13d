"""RWKV-6 ("Finch": diagonal data-dependent decay and a bonus for the current token), chunked: the public call, its
settings, the launches and the autograd Function (math and design in README.md; the Triton kernels in fwd.py and
bwd.py).

    o, final_state = chunk_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False,
                                 cu_seqlens=None, backend=None, settings=None)

r, k, w: [B, T, H, K]; v: [B, T, H, V]; u (bonus): [H, K]; w is the log decay (<= 0; computed and used in fp32).
scale None means K^-0.5. Initial and final states [N, H, K, V] fp32. cu_seqlens [N+1] packs N sequences into B = 1.
CUDA tensors go to the Triton kernel, CPU tensors to the PyTorch chunked path; backend='triton' | 'torch' forces one
(tests run the Triton kernel on CPU tensors under TRITON_INTERPRET=1, the sm_90 compile records its launches on meta
tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.launch import launch
from kernels.rwkv6.torch_chunk import chunk_rwkv6_torch
from kernels.utils import as_varlen, chunk_tables, next_pow2, scan_tile


@dataclass(frozen=True)
class Settings:
    """Tiles and warps of the Triton kernel. Fixed values instead of autotuning: a first call compiles each kernel
    once (scripts/bench_kernels.py --set rwkv6.field=value times others)."""

    chunk: int = 32
    """Tokens per chunk (16 or 32): longer chunks mean fewer sequential scan steps and fewer stored states, at the
    price of a larger pairwise matrix per chunk; at 64 _bwd_chunk needs more shared memory than an H100 has."""
    wide_k_chunk: int = 16
    """Tokens per chunk where K > 64 (16 or 32): at K = 128 and chunks of 32, _bwd_chunk needs more shared memory
    than an H100 has."""
    prec: str = "tf32"
    """Operand precision of every fp32 product ("tf32" or "ieee"): tf32 is enough for bf16 models; the interpreter
    computes exact fp32 whatever this says."""
    chunk_bv: int = 64
    """V tile of the per-chunk kernels (_fwd_out, _bwd_chunk): all of V at once for V <= 64."""
    scan_bv: int | None = None
    """V tile of the sequence scans; None: kernels.utils.scan_tile, the widest tile that still gives about one
    program per SM."""
    scan_warps: int = 4
    """Warps of the scans (_fwd_scan, _bwd_scan)."""
    out_warps: int = 4
    """Warps of _fwd_out."""
    bwd_warps: int = 8
    """Warps of _bwd_chunk (it holds A, dA and six [chunk, K] tiles at once)."""

    def __post_init__(self):
        for name in ("chunk", "wide_k_chunk"):
            assert getattr(self, name) in (16, 32), f"rwkv6 Settings.{name} must be 16 or 32, got {getattr(self, name)}"

    def chunk_size(self, K: int) -> int:
        return self.chunk if K <= 64 else self.wide_k_chunk

    def scan_tile(self, V: int, sequences_x_heads: int) -> int:
        return self.scan_bv or scan_tile(V, sequences_x_heads)

    def chunk_tile(self, V: int) -> int:
        return min(self.chunk_bv, max(16, next_pow2(V)))


def _fwd(r, k, v, w, u, scale, h0, want_ht, cu, tables, s: Settings):
    from kernels.rwkv6.fwd import _fwd_out, _fwd_scan

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk_size(K), max(16, next_pow2(K))
    chunk_offsets, chunk_index, NT = tables
    N = cu.numel() - 1
    f32 = dict(device=r.device, dtype=torch.float32)
    h = torch.empty(NT, H, K, V, **f32)
    ht = torch.empty(N, H, K, V, **f32) if want_ht else None
    BV = s.scan_tile(V, N * H)
    launch(_fwd_scan, (N, H, triton.cdiv(V, BV)), k, v, w, cu, chunk_offsets, h0, h, ht, H=H, K=K, V=V, BT=BT,
           BK=BK, BV=BV, HAS_H0=h0 is not None, STORE_HT=want_ht, PREC=s.prec, num_warps=s.scan_warps)
    o = torch.empty_like(v)
    launch(_fwd_out, (NT, H), r, k, v, w, u, h, o, cu, chunk_index, scale, H=H, K=K, V=V, BT=BT, BK=BK,
           BV=s.chunk_tile(V), LEVELS=BT.bit_length() - 1, PREC=s.prec, num_warps=s.out_warps)
    return o, ht, h


def _bwd(r, k, v, w, u, scale, h0, cu, h, tables, do, dht, s: Settings):
    from kernels.rwkv6.bwd import _bwd_chunk, _bwd_scan

    _, T, H, K = r.shape
    V = v.shape[-1]
    BT, BK = s.chunk_size(K), max(16, next_pow2(K))
    chunk_offsets, chunk_index, NT = tables
    N = cu.numel() - 1
    f32 = dict(device=r.device, dtype=torch.float32)
    dh = torch.empty(NT, H, K, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    BV = s.scan_tile(V, N * H)
    launch(_bwd_scan, (N, H, triton.cdiv(V, BV)), r, w, do, cu, chunk_offsets, dht, dh, dh0, scale, H=H, K=K, V=V,
           BT=BT, BK=BK, BV=BV, HAS_DHT=dht is not None, STORE_DH0=h0 is not None, PREC=s.prec,
           num_warps=s.scan_warps)
    dr, dk, dv, dw = (torch.empty_like(x) for x in (r, k, v, w))
    # each chunk's share of du (spare chunks of a packed batch write nothing: zeros)
    du = torch.zeros(NT, H, K, **f32)
    launch(_bwd_chunk, (NT, H), r, k, v, w, u, do, h, dh, cu, chunk_index, dr, dk, dv, dw, du, scale, H=H, K=K,
           V=V, BT=BT, BK=BK, BV=s.chunk_tile(V), LEVELS=BT.bit_length() - 1, PREC=s.prec, num_warps=s.bwd_warps)
    return dr, dk, dv, dw, du.sum(0).to(u.dtype), dh0


class _ChunkRWKV6(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, k, v, w, u, scale, h0, want_ht, cu, tables, settings):
        o, ht, h = _fwd(r, k, v, w, u, scale, h0, want_ht, cu, tables, settings)
        ctx.save_for_backward(r, k, v, w, u, h0, cu, h)
        ctx.scale, ctx.tables, ctx.settings = scale, tables, settings
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, k, v, w, u, h0, cu, h = ctx.saved_tensors
        dr, dk, dv, dw, du, dh0 = _bwd(r, k, v, w, u, ctx.scale, h0, cu, h, ctx.tables, do.contiguous(),
                                       None if dht is None else dht.contiguous(), ctx.settings)
        return dr, dk, dv, dw, du, None, dh0, None, None, None, None


# Opaque to torch.compile: the model's blocks compile around this call (a graph break here), instead of Dynamo
# tracing into the kernel launches.
@torch.compiler.disable
def _chunk_rwkv6_triton(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, s: Settings):
    B, T, H, K = r.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        assert B == 1, "cu_seqlens needs B == 1 (sequences packed along T)"
    cu = as_varlen(B, T, cu_seqlens, r.device)
    flat = lambda x: x.reshape(1, B * T, H, x.shape[-1]).contiguous()  # noqa: E731
    # The decay stays fp32 whatever the model's dtype (bf16 log decays near 0 lose the slow channels).
    r_, k_, v_ = (flat(x) for x in (r, k, v))
    w_ = flat(w.float())
    h0 = None if initial_state is None else initial_state.float().contiguous()
    tables = chunk_tables(cu, s.chunk_size(K), B * T, T if cu_seqlens is None else None)
    o, ht = _ChunkRWKV6.apply(r_, k_, v_, w_, u.contiguous(), float(scale), h0, bool(output_final_state), cu,
                              tables, s)
    return o.reshape(B, T, H, V), ht


def chunk_rwkv6(r, k, v, w, u, scale: float | None = None, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, backend: str | None = None, settings: Settings | None = None):
    """RWKV-6 over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, final state or None).
    `settings` tunes the Triton kernel (None: Settings())."""
    if scale is None:
        scale = r.shape[-1] ** -0.5
    if backend is None:
        backend = "triton" if r.is_cuda and triton is not None else "torch"
    if backend == "torch":
        return chunk_rwkv6_torch(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_rwkv6_triton(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens,
                               settings or Settings())


try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None
