"""RWKV-7's output epilogue as one op (README.md): the public call, its Settings, the launches and the custom ops
flame::rwkv7_out / flame::rwkv7_out_bwd (fakes, autograd).

    y = rwkv7_out(o, r, k, v, r_k, ln_w, ln_b, g, eps=64e-5, backend=None, settings=None)

o (the chunk kernel's output), r, k, v [B, T, H, N]; r_k [H, N]; ln_w, ln_b [C]; g [B, T, C] (C = H N):
y = (GroupNorm_per_head(o) ln_w + ln_b + sum_N(r k r_k) v) g in g's dtype, fp32 inside. CUDA tensors run the
Triton kernels, CPU tensors the plain PyTorch forward and backward (naive.py); backend='triton' | 'torch' forces one
(tests run Triton on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.launch import launch
from kernels.settings import TextSettings
from kernels.rwkv7_out.naive import naive_rwkv7_out, naive_rwkv7_out_bwd
from kernels.utils import cdiv, next_pow2, uses_triton


@dataclass(frozen=True)
class Settings(TextSettings):
    """Token tiles and warps of the two kernels (each program holds a [tokens, head_dim] tile of every tensor it
    reads); not autotuned."""

    fwd_tokens: int = 32
    """Tokens per program of the forward."""
    bwd_tokens: int = 32
    """Tokens per program of the backward (about twice the live tiles of the forward); the partial sums of dr_k,
    dln_w, dln_b have tokens / bwd_tokens rows."""
    warps: int = 4
    """Warps of both kernels."""



def _rows(x: Tensor, C: int) -> Tensor:
    return x.reshape(-1, C).contiguous()


def _fwd_triton(o, r, k, v, r_k, ln_w, ln_b, g, eps: float, s: Settings):
    from kernels.rwkv7_out.fwd import _out_fwd

    H, N = r_k.shape
    C = H * N
    g2 = _rows(g, C)
    M = g2.shape[0]
    y = torch.empty_like(g2)
    launch(_out_fwd, (cdiv(M, s.fwd_tokens), H), *(_rows(x, C) for x in (o, r, k, v, r_k, ln_w, ln_b)), g2, y,
           M, eps, C=C, N=N, BT=s.fwd_tokens, BN=next_pow2(N), num_warps=s.warps)
    return y.view(g.shape)


def _bwd_triton(o, r, k, v, r_k, ln_w, ln_b, g, dy, eps: float, s: Settings):
    from kernels.rwkv7_out.bwd import _out_bwd

    H, N = r_k.shape
    C = H * N
    ins = [_rows(x, C) for x in (o, r, k, v, r_k, ln_w, ln_b, g, dy)]
    M = ins[-1].shape[0]
    tiles = cdiv(M, s.bwd_tokens)
    grads = [torch.empty_like(x) for x in ins[:4]] + [torch.empty_like(ins[7])]    # do, dr, dk, dv, dg
    parts = torch.empty(3, tiles, C, device=g.device, dtype=torch.float32)
    launch(_out_bwd, (tiles, H), *ins, *grads, parts[0], parts[1], parts[2], M, eps, C=C, N=N, BT=s.bwd_tokens,
           BN=next_pow2(N), num_warps=s.warps)
    do, dr, dk, dv, dg = (d.view(x.shape) for d, x in zip(grads, (o, r, k, v, g)))
    # three tensors (outputs may not alias each other)
    dr_k, dln_w, dln_b = (p.sum(0).view(x.shape).to(x.dtype) for p, x in zip(parts, (r_k, ln_w, ln_b)))
    return do, dr, dk, dv, dr_k, dln_w, dln_b, dg


@torch.library.custom_op("flame::rwkv7_out", mutates_args=())
def _out(o: Tensor, r: Tensor, k: Tensor, v: Tensor, r_k: Tensor, ln_w: Tensor, ln_b: Tensor, g: Tensor, eps: float,
         backend: str, settings: str) -> Tensor:
    if uses_triton(g, backend):
        return _fwd_triton(o, r, k, v, r_k, ln_w, ln_b, g, eps, Settings.decode(settings))
    # contiguous, as the fakes say (elementwise ops on strided inputs keep their strides)
    return naive_rwkv7_out(o, r, k, v, r_k, ln_w, ln_b, g, eps).contiguous()


@_out.register_fake
def _(o, r, k, v, r_k, ln_w, ln_b, g, eps, backend, settings):
    return g.new_empty(g.shape)


@torch.library.custom_op("flame::rwkv7_out_bwd", mutates_args=())
def _out_bwd(o: Tensor, r: Tensor, k: Tensor, v: Tensor, r_k: Tensor, ln_w: Tensor, ln_b: Tensor, g: Tensor,
             dy: Tensor, eps: float, backend: str, settings: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                           Tensor, Tensor, Tensor]:
    if uses_triton(g, backend):
        return _bwd_triton(o, r, k, v, r_k, ln_w, ln_b, g, dy, eps, Settings.decode(settings))
    return tuple(x.contiguous() for x in naive_rwkv7_out_bwd(o, r, k, v, r_k, ln_w, ln_b, g, dy, eps))


@_out_bwd.register_fake
def _(o, r, k, v, r_k, ln_w, ln_b, g, dy, eps, backend, settings):
    return tuple(x.new_empty(x.shape) for x in (o, r, k, v, r_k, ln_w, ln_b, g))


def _setup_context(ctx, inputs, output):
    *tensors, ctx.eps, ctx.backend, ctx.settings = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, dy):
    grads = torch.ops.flame.rwkv7_out_bwd(*ctx.saved_tensors, dy, ctx.eps, ctx.backend, ctx.settings)
    return *grads, None, None, None


_out.register_autograd(_backward, setup_context=_setup_context)


def rwkv7_out(o: Tensor, r: Tensor, k: Tensor, v: Tensor, r_k: Tensor, ln_w: Tensor, ln_b: Tensor, g: Tensor,
              eps: float = 64e-5, backend: str | None = None, settings: Settings | None = None) -> Tensor:
    """The gated, normalized output plus the r k bonus, in g's dtype (module docstring)."""
    return torch.ops.flame.rwkv7_out(o, r, k, v, r_k, ln_w, ln_b, g, float(eps), backend or "auto",
                                     (settings or Settings()).encode())

