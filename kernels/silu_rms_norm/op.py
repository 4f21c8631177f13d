"""The GSA output norm as one op (README.md): the public call, its Settings, the launches and the custom ops
flame::silu_rms_norm / flame::silu_rms_norm_bwd (fakes, autograd).

    y = silu_rms_norm(o, w, eps=1e-5, backend=None, settings=None)

o [..., C], w [C]: y = silu(o) / sqrt(mean_C(silu(o)^2) + eps) w, in o's dtype, fp32 inside. CUDA tensors run the
Triton kernels, CPU tensors the plain PyTorch forward and backward (naive.py); backend='triton' | 'torch' forces one
(tests run Triton on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.launch import launch
from kernels.settings import TextSettings
from kernels.silu_rms_norm.naive import naive_silu_rms_norm, naive_silu_rms_norm_bwd
from kernels.utils import cdiv, next_pow2, uses_triton


@dataclass(frozen=True)
class Settings(TextSettings):
    """Row tiles and warps of the two kernels (a tile holds whole rows: the norm runs over all C channels); not
    autotuned."""

    fwd_rows: int = 4
    """Rows per program of the forward."""
    bwd_rows: int = 1
    """Rows per tile of the backward. It holds about three times the forward's live tiles: at C = 1280 (tiles of
    2048 channels), 8 warps and 4 rows it takes 215 registers, one program per SM; 1 row takes 92."""
    bwd_tiles: int = 16
    """Tiles each backward program walks: the partial sums of dw have rows / (bwd_rows bwd_tiles) rows."""
    warps: int = 8
    """Warps of both kernels."""


def _fwd_triton(o: Tensor, w: Tensor, eps: float, s: Settings) -> Tensor:
    from kernels.silu_rms_norm.fwd import _silu_norm_fwd

    C = o.shape[-1]
    o2 = o.reshape(-1, C).contiguous()
    M = o2.shape[0]
    y = torch.empty_like(o2)
    launch(_silu_norm_fwd, (cdiv(M, s.fwd_rows),), o2, w, y, M, eps, C=C, BT=s.fwd_rows, BC=next_pow2(C),
           num_warps=s.warps)
    return y.view(o.shape)


def _bwd_triton(o: Tensor, w: Tensor, dy: Tensor, eps: float, s: Settings) -> tuple[Tensor, Tensor]:
    from kernels.silu_rms_norm.bwd import _silu_norm_bwd

    C = o.shape[-1]
    o2, dy2 = (x.reshape(-1, C).contiguous() for x in (o, dy))
    M = o2.shape[0]
    programs = cdiv(M, s.bwd_rows * s.bwd_tiles)
    do = torch.empty_like(o2)
    part = torch.empty(programs, C, device=o.device, dtype=torch.float32)
    launch(_silu_norm_bwd, (programs,), o2, w, dy2, do, part, M, eps, C=C, BT=s.bwd_rows, BC=next_pow2(C),
           TILES=s.bwd_tiles, num_warps=s.warps)
    return do.view(o.shape), part.sum(0).to(w.dtype)


@torch.library.custom_op("flame::silu_rms_norm", mutates_args=())
def _norm(o: Tensor, w: Tensor, eps: float, backend: str, settings: str) -> Tensor:
    if uses_triton(o, backend):
        return _fwd_triton(o, w, eps, Settings.decode(settings))
    return naive_silu_rms_norm(o, w, eps).contiguous()


@_norm.register_fake
def _(o, w, eps, backend, settings):
    return o.new_empty(o.shape)


@torch.library.custom_op("flame::silu_rms_norm_bwd", mutates_args=())
def _norm_bwd(o: Tensor, w: Tensor, dy: Tensor, eps: float, backend: str, settings: str) -> tuple[Tensor, Tensor]:
    if uses_triton(o, backend):
        return _bwd_triton(o, w, dy, eps, Settings.decode(settings))
    return tuple(x.contiguous() for x in naive_silu_rms_norm_bwd(o, w, dy, eps))


@_norm_bwd.register_fake
def _(o, w, dy, eps, backend, settings):
    return o.new_empty(o.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    o, w, ctx.eps, ctx.backend, ctx.settings = inputs
    ctx.save_for_backward(o, w)


def _backward(ctx, dy):
    do, dw = torch.ops.flame.silu_rms_norm_bwd(*ctx.saved_tensors, dy, ctx.eps, ctx.backend, ctx.settings)
    return do, dw, None, None, None


_norm.register_autograd(_backward, setup_context=_setup_context)


def silu_rms_norm(o: Tensor, w: Tensor, eps: float = 1e-5, backend: str | None = None,
                  settings: Settings | None = None) -> Tensor:
    """RMSNorm(silu(o)) w over the last dim, in o's dtype (module docstring)."""
    return torch.ops.flame.silu_rms_norm(o, w, float(eps), backend or "auto", (settings or Settings()).encode())

