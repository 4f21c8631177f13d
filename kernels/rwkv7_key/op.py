"""RWKV-7's key prologue as one op (README.md): the public call, its Settings, the launches and the custom ops
flame::rwkv7_key / flame::rwkv7_key_bwd (fakes, autograd).

    k_new, neg_kk, kk_a = rwkv7_key(k, a_lora, a0, k_k, k_a, head_dim, backend=None, settings=None)

k, a_lora [..., C] (a_lora: the low-rank term of a's pre-sigmoid input, any float dtype), a0 (its bias), k_k, k_a [C];
outputs in k's dtype, the chunk kernel's k, a and b. CUDA tensors run the Triton kernels, CPU tensors the plain
PyTorch forward and backward (naive.py); backend='triton' | 'torch' forces one (tests run Triton on CPU under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.launch import launch
from kernels.settings import TextSettings
from kernels.rwkv7_key.naive import naive_rwkv7_key, naive_rwkv7_key_bwd
from kernels.utils import cdiv, next_pow2, uses_triton


@dataclass(frozen=True)
class Settings(TextSettings):
    """Token tiles and warps of the two kernels (each program holds a [tokens, head_dim] tile of every tensor it
    reads); not autotuned."""

    fwd_tokens: int = 32
    """Tokens per program of the forward."""
    bwd_tokens: int = 32
    """Tokens per program of the backward (twice the live tiles of the forward); also the rows of dk_k/dk_a's
    partial sums are tokens / bwd_tokens."""
    warps: int = 4
    """Warps of both kernels."""



def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _fwd_triton(k, a_lora, a0, k_k, k_a, head_dim: int, s: Settings):
    from kernels.rwkv7_key.fwd import _key_fwd

    k2, a2 = _rows(k), _rows(a_lora)
    M, C = k2.shape
    outs = [torch.empty_like(k2) for _ in range(3)]
    launch(_key_fwd, (cdiv(M, s.fwd_tokens), C // head_dim), k2, a2, a0.contiguous(), k_k.contiguous(),
           k_a.contiguous(), *outs, M, C=C, N=head_dim, BT=s.fwd_tokens, BN=next_pow2(head_dim), num_warps=s.warps)
    return tuple(o.view(k.shape) for o in outs)


def _bwd_triton(k, a_lora, a0, k_k, k_a, dk_new, dneg_kk, dkk_a, head_dim: int, s: Settings):
    from kernels.rwkv7_key.bwd import _key_bwd

    k2, a2 = _rows(k), _rows(a_lora)
    M, C = k2.shape
    tiles = cdiv(M, s.bwd_tokens)
    dk, da_lora = torch.empty_like(k2), torch.empty_like(a2)
    parts = torch.empty(2, tiles, C, device=k.device, dtype=torch.float32)
    launch(_key_bwd, (tiles, C // head_dim), k2, a2, a0.contiguous(), k_k.contiguous(), k_a.contiguous(),
           _rows(dk_new), _rows(dneg_kk), _rows(dkk_a), dk, da_lora, parts[0], parts[1], M, C=C, N=head_dim,
           BT=s.bwd_tokens, BN=next_pow2(head_dim), num_warps=s.warps)
    dk_k, dk_a = parts[0].sum(0), parts[1].sum(0)   # two tensors (outputs may not alias each other)
    return dk.view(k.shape), da_lora.view(a_lora.shape), dk_k.to(k_k.dtype), dk_a.to(k_a.dtype)


@torch.library.custom_op("flame::rwkv7_key", mutates_args=())
def _key(k: Tensor, a_lora: Tensor, a0: Tensor, k_k: Tensor, k_a: Tensor, head_dim: int, backend: str,
         settings: str) -> tuple[Tensor, Tensor, Tensor]:
    if uses_triton(k, backend):
        return _fwd_triton(k, a_lora, a0, k_k, k_a, head_dim, Settings.decode(settings))
    return _contiguous(naive_rwkv7_key(k, a_lora, a0, k_k, k_a, head_dim))


def _contiguous(xs):
    # every path returns contiguous tensors, as the fakes say (elementwise ops on strided inputs keep their strides)
    return tuple(x.contiguous() for x in xs)


@_key.register_fake
def _(k, a_lora, a0, k_k, k_a, head_dim, backend, settings):
    return k.new_empty(k.shape), k.new_empty(k.shape), k.new_empty(k.shape)


@torch.library.custom_op("flame::rwkv7_key_bwd", mutates_args=())
def _key_bwd(k: Tensor, a_lora: Tensor, a0: Tensor, k_k: Tensor, k_a: Tensor, dk_new: Tensor, dneg_kk: Tensor,
             dkk_a: Tensor, head_dim: int, backend: str,
             settings: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if uses_triton(k, backend):
        return _bwd_triton(k, a_lora, a0, k_k, k_a, dk_new, dneg_kk, dkk_a, head_dim, Settings.decode(settings))
    return _contiguous(naive_rwkv7_key_bwd(k, a_lora, a0, k_k, k_a, dk_new, dneg_kk, dkk_a, head_dim))


@_key_bwd.register_fake
def _(k, a_lora, a0, k_k, k_a, dk_new, dneg_kk, dkk_a, head_dim, backend, settings):
    return tuple(x.new_empty(x.shape) for x in (k, a_lora, k_k, k_a))


def _setup_context(ctx, inputs, output):
    k, a_lora, a0, k_k, k_a, ctx.head_dim, ctx.backend, ctx.settings = inputs
    ctx.a0_dtype = a0.dtype
    ctx.save_for_backward(k, a_lora, a0, k_k, k_a)


def _backward(ctx, dk_new, dneg_kk, dkk_a):
    saved = ctx.saved_tensors   # unpacked once (activation checkpointing allows no second unpack)
    grads = [torch.zeros_like(saved[0]) if g is None else g for g in (dk_new, dneg_kk, dkk_a)]
    dk, da_lora, dk_k, dk_a = torch.ops.flame.rwkv7_key_bwd(*saved, *grads, ctx.head_dim, ctx.backend, ctx.settings)
    # a0's gradient: da_lora summed over the tokens, outside the kernel (a third per-tile column sum there cost more
    # than the compiled reduction)
    da0 = da_lora.reshape(-1, da_lora.shape[-1]).sum(0, dtype=torch.float32).to(ctx.a0_dtype)
    return dk, da_lora, da0, dk_k, dk_a, None, None, None


_key.register_autograd(_backward, setup_context=_setup_context)


def rwkv7_key(k: Tensor, a_lora: Tensor, a0: Tensor, k_k: Tensor, k_a: Tensor, head_dim: int,
              backend: str | None = None, settings: Settings | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(k_new, -kk, kk * a) in k's dtype: the chunk kernel's k, a and b (module docstring)."""
    return torch.ops.flame.rwkv7_key(k, a_lora, a0, k_k, k_a, head_dim, backend or "auto",
                                     (settings or Settings()).encode())

