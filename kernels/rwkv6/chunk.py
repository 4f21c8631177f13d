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

from kernels.rwkv6.torch_chunk import chunk_rwkv6_torch


@dataclass(frozen=True)
class Settings:
    """Tiles and warps of the Triton kernel. Fixed values instead of autotuning: a first call compiles each kernel
    once (scripts/bench_kernels.py --set rwkv6.field=value times others)."""

    chunk: int = 64
    """Tokens per chunk (16, 32 or 64)."""


def chunk_rwkv6(r, k, v, w, u, scale: float | None = None, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, backend: str | None = None, settings: Settings | None = None):
    """RWKV-6 over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, final state or None).
    `settings` tunes the Triton kernel (None: Settings())."""
    if scale is None:
        scale = r.shape[-1] ** -0.5
    if backend is None:
        backend = "triton" if r.is_cuda else "torch"
    if backend == "torch":
        return chunk_rwkv6_torch(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    raise NotImplementedError("chunk_rwkv6: the Triton kernel is not written yet (use backend='torch')")
