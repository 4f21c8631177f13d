"""shift_mix: RWKV's token shift and its lerps in one pass over x (math and design in README.md; the Triton kernels
in fwd.py and bwd.py, the plain PyTorch path in naive.py).

    outs = shift_mix(x, mix, keep=None, first=None, backend="auto", settings=None)

x [B, T, C]; mix [n, C] (1 <= n <= 6); outs: a list of n tensors [B, T, C] in x's dtype (separate tensors, so that
their n grads reach the backward without being stacked into one), outs[i] = x + (x_prev - x) * mix[i] computed in
fp32, where x_prev is x shifted by one token: `first` [B, C] (zero if None) at t = 0, and zero where keep [T] (or
[T, 1]) is 0, the starts of packed documents. Gradients flow to x and mix (dmix summed in fp32), never to keep or
first (first is the cached token of an inference pass). One custom op, flame::shift_mix (backward
flame::shift_mix_bwd): CUDA tensors take the Triton kernels, CPU tensors the PyTorch path; backend="triton" forces the
kernels (tests run them on CPU under TRITON_INTERPRET=1), "torch" the PyTorch path.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from kernels.launch import launch
from kernels.settings import TextSettings
from kernels.token_shift.naive import naive_shift_mix, naive_shift_mix_bwd
from kernels.utils import next_pow2, uses_triton

MAX_MIXES = 6   # the kernels take one pointer per output and per grad


@dataclass(frozen=True)
class Settings(TextSettings):
    """Tiles and warps of the two kernels (memory-bound elementwise passes: tiles wide along C for whole 128-byte
    lines, enough tokens per program to amortize the one extra token each tile reads)."""

    fwd_bt: int = 16
    """Tokens per forward program."""
    fwd_bc: int = 256
    """Channels per forward program (at most the next power of two of C): C = 1024, 1280, 1536, 2048 split evenly."""
    fwd_warps: int = 4
    """Warps of the forward."""
    bwd_bt: int = 1
    """Tokens per backward tile. One token per tile and one warp per program: the tile's sum over tokens for dmix
    then stays in each thread (taller tiles with a warp per row reduce across warps through shared memory, with
    barriers at every one of the n grads), and the compiler issues all 2n grad loads of a tile at once (n = 6, sm_90:
    168 registers, 32 bytes spilled; 146 at 4 x 256 with 4 warps, 255 and more spills at 8 x 256)."""
    bwd_bc: int = 256
    """Channels per backward program (8 bf16 per thread of one warp: 16-byte loads)."""
    bwd_tiles: int = 64
    """Backward tiles per program, walked in order: each program writes one partial dmix [n, BC], so more tokens per
    program make the partial sums (and their reduction) a smaller part of the traffic (64 tokens: 5% of it at n = 6),
    and the grid stays within what an H100 holds at once (RWKV-7 0.6B: 1280 one-warp programs)."""
    bwd_warps: int = 1
    """Warps of the backward."""



def _fwd(x, mix, keep, first, s: Settings):
    from kernels.token_shift.fwd import _shift_mix_fwd

    B, T, C = x.shape
    n = mix.shape[0]
    outs = [torch.empty_like(x) for _ in range(n)]
    BT, BC = s.fwd_bt, min(s.fwd_bc, next_pow2(C))
    launch(_shift_mix_fwd, (triton.cdiv(T, BT), triton.cdiv(C, BC), B), x, mix, keep, first, *_six(outs), T, C, N=n,
           BT=BT, BC=BC, HAS_KEEP=keep is not None, HAS_FIRST=first is not None, num_warps=s.fwd_warps)
    return outs


def _six(tensors: list) -> list:
    """The kernels' six pointer arguments: the tensors, then None."""
    return list(tensors) + [None] * (MAX_MIXES - len(tensors))


def _bwd(grads, x, mix, keep, first, s: Settings):
    from kernels.token_shift.bwd import _shift_mix_bwd

    B, T, C = x.shape
    n = mix.shape[0]
    BT, BC = s.bwd_bt, min(s.bwd_bc, next_pow2(C))
    tiles = max(1, min(s.bwd_tiles, triton.cdiv(T, BT)))
    programs_t = triton.cdiv(T, BT * tiles)
    dx = torch.empty_like(x)
    dmix_part = torch.empty(B * programs_t, n, C, device=x.device, dtype=torch.float32)
    launch(_shift_mix_bwd, (programs_t, triton.cdiv(C, BC), B), x, mix, keep, first, *_six(grads), dx, dmix_part, T, C,
           N=n, NP=next_pow2(n), BT=BT, BC=BC, TILES=tiles, HAS_KEEP=keep is not None, HAS_FIRST=first is not None,
           num_warps=s.bwd_warps)
    return dx, dmix_part.sum(0).to(mix.dtype)


@torch.library.custom_op("flame::shift_mix", mutates_args=())
def _shift_mix_op(x: torch.Tensor, mix: torch.Tensor, keep: Optional[torch.Tensor], first: Optional[torch.Tensor],
                  backend: str, settings: str) -> list[torch.Tensor]:
    if uses_triton(x, backend):
        return _fwd(x, mix, keep, first, Settings.decode(settings))
    return naive_shift_mix(x, mix, keep, first)


@_shift_mix_op.register_fake
def _(x, mix, keep, first, backend, settings):
    return [torch.empty_like(x) for _ in range(mix.shape[0])]


@torch.library.custom_op("flame::shift_mix_bwd", mutates_args=())
def _shift_mix_bwd_op(grads: list[torch.Tensor], x: torch.Tensor, mix: torch.Tensor, keep: Optional[torch.Tensor],
                      first: Optional[torch.Tensor], backend: str, settings: str) -> tuple[torch.Tensor, torch.Tensor]:
    if uses_triton(x, backend):
        return _bwd(grads, x, mix, keep, first, Settings.decode(settings))
    return naive_shift_mix_bwd(grads, x, mix, keep, first)


@_shift_mix_bwd_op.register_fake
def _(grads, x, mix, keep, first, backend, settings):
    return torch.empty_like(x), torch.empty_like(mix)


def _setup_context(ctx, inputs, output):
    x, mix, keep, first, backend, settings = inputs
    ctx.save_for_backward(x, mix, keep, first)
    ctx.backend, ctx.settings = backend, settings


def _backward(ctx, grads):
    x, mix, keep, first = ctx.saved_tensors
    # an output nobody used has no grad
    grads = [torch.zeros_like(x) if g is None else g.contiguous() for g in grads]
    dx, dmix = torch.ops.flame.shift_mix_bwd(grads, x, mix, keep, first, ctx.backend, ctx.settings)
    return dx, dmix, None, None, None, None


_shift_mix_op.register_autograd(_backward, setup_context=_setup_context)


def shift_mix(x: torch.Tensor, mix: torch.Tensor, keep: torch.Tensor | None = None, first: torch.Tensor | None = None,
              backend: str = "auto", settings: Settings | None = None) -> list[torch.Tensor]:
    if x.dim() != 3:
        raise ValueError(f"shift_mix: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if mix.dim() != 2 or mix.shape[1] != C or not 1 <= mix.shape[0] <= MAX_MIXES:
        raise ValueError(f"shift_mix: mix must be [n, C] with C = {C} and 1 <= n <= {MAX_MIXES}, "
                         f"got shape {tuple(mix.shape)}")
    if keep is not None:
        if keep.numel() != T:
            raise ValueError(f"shift_mix: keep must be [T] or [T, 1] with T = {T}, got shape {tuple(keep.shape)}")
        keep = keep.reshape(T).contiguous()
    if first is not None:
        if tuple(first.shape) != (B, C):
            raise ValueError(f"shift_mix: first must be [B, C] = [{B}, {C}], got shape {tuple(first.shape)}")
        if first.requires_grad:
            raise ValueError("shift_mix: first (the cached previous token) gets no gradient; pass first.detach() "
                             "(shift_mix with first is for inference)")
        first = first.contiguous()
    return _shift_mix_op(x.contiguous(), mix.contiguous(), keep, first, backend, (settings or Settings()).encode())
