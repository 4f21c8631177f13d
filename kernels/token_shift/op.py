"""norm_shift_mix: a LayerNorm, then RWKV's token shift and its lerps, in one pass over x (math and design in README.md;
the Triton kernels in fwd.py and bwd.py, the plain PyTorch path in naive.py).

    outs = norm_shift_mix(x, weight, bias, eps, mix, keep=None, first=None, backend="auto", settings=None)

x [B, T, C]; weight, bias [C] and eps: the LayerNorm's; mix [n, C] (1 <= n <= 6); outs: a list of n tensors [B, T, C]
in x's dtype (separate tensors, so that their n grads reach the backward without being stacked into one),
outs[i] = xn + (xn_prev - xn) * mix[i] computed in fp32 from xn = LayerNorm(x) * weight + bias (never rounded),
where xn_prev is xn shifted by one token: `first` [B, C] (an already normalized token; zero if None) at t = 0, and zero
where keep is 0, the starts of packed documents (keep [T] or [T, 1]: the same for every row; [B, T]: each row's own).
Gradients flow to x, weight, bias and mix (their sums over tokens in fp32) and first (the cached token of an inference
pass, or the previous rank's last token in context parallelism), never to keep. One custom op,
flame::norm_shift_mix (backward flame::norm_shift_mix_bwd): CUDA tensors take the Triton kernels, CPU tensors the
PyTorch path; backend="triton" forces the kernels (tests run them on CPU under TRITON_INTERPRET=1), "torch" the
PyTorch path.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.launch import launch
from kernels.settings import TextSettings
from kernels.token_shift.naive import naive_norm_shift_mix, naive_norm_shift_mix_bwd
from kernels.utils import cdiv, next_pow2, uses_triton

MAX_MIXES = 6   # the kernels take one pointer per output and per grad


@dataclass(frozen=True)
class Settings(TextSettings):
    """Tiles and warps of the kernels (memory-bound passes: whole rows forward for the LayerNorm's statistics, tiles of
    whole 128-byte lines backward, enough tokens per program to amortize the one extra token each tile reads)."""

    fwd_bt: int = 1
    """Tokens per forward program; each program takes whole rows (C padded to its next power of two)."""
    fwd_warps: int = 2
    """Warps of the forward: a row's two sums stay within fewer warps, and more programs fit an SM."""
    bwd_bt: int = 1
    """Tokens per backward tile. One token per tile and one warp per program: the tile's sums over tokens then stay
    in each thread (taller tiles with a warp per row reduce across warps through shared memory, with barriers at
    every one of the n grads), and the compiler issues all 2n grad loads of a tile at once."""
    bwd_bc: int | None = None
    """Channels per backward program; None: 128 for n > 2 mixes (4 bf16 per thread of one warp: 8-byte loads), else
    256 (8 bf16: 16-byte loads). The kernel is bound by the loads in flight, which live in registers, and those grow
    with n: at n = 6, 256 channels take 224 registers a thread (9 programs an SM) and 128 channels 128 (16 an SM);
    at n = 1 or 2 the wider loads win."""
    bwd_tiles: int | None = None
    """Backward tiles per program, walked in order; None: 32 for n > 2, else 64. Each program writes one partial
    [n + 2, BC] (dmix, dweight, dbias), so more tokens per program make the partial sums (and their reduction) a
    smaller part of the traffic, fewer make more programs to spread over the SMs (RWKV-7 0.6B at 8 x 4096 tokens:
    10240 one-warp programs for its time mix, 2560 for its channel mix)."""
    bwd_warps: int = 1
    """Warps of the backward."""
    norm_bt: int = 8
    """Tokens per program of the LayerNorm's elementwise backward (channel tiles of bwd_bc)."""
    norm_warps: int = 4
    """Warps of the LayerNorm's elementwise backward."""


def _six(tensors: list) -> list:
    """The kernels' six pointer arguments: the tensors, then None."""
    return list(tensors) + [None] * (MAX_MIXES - len(tensors))


def _keep_stride(keep, T: int) -> int:
    """Elements between two rows' keep: T for a keep per row, 0 for one keep that every row shares."""
    return T if keep is not None and keep.numel() > T else 0


def _fwd(x, weight, bias, eps, mix, keep, first, s: Settings):
    from kernels.token_shift.fwd import _norm_shift_mix_fwd

    B, T, C = x.shape
    n = mix.shape[0]
    outs = [torch.empty_like(x) for _ in range(n)]
    stats = torch.empty(2, B, T, device=x.device, dtype=torch.float32)
    launch(_norm_shift_mix_fwd, (cdiv(T, s.fwd_bt), B), x, weight, bias, mix, keep, _keep_stride(keep, T),
           first, stats, *_six(outs),
           B, T, C, eps, N=n, BT=s.fwd_bt, BC=next_pow2(C), HAS_KEEP=keep is not None, HAS_FIRST=first is not None,
           num_warps=s.fwd_warps)
    return outs + [stats]


def _bwd(grads, x, weight, bias, mix, stats, keep, first, s: Settings):
    from kernels.token_shift.bwd import _norm_bwd, _shift_mix_bwd

    B, T, C = x.shape
    n = mix.shape[0]
    wide = n > 2   # Settings.bwd_bc: narrower tiles when the n grads take many registers
    BT, BC = s.bwd_bt, min(s.bwd_bc or (128 if wide else 256), next_pow2(C))
    tiles = max(1, min(s.bwd_tiles or (32 if wide else 64), cdiv(T, BT)))
    programs_t, n_c = cdiv(T, BT * tiles), cdiv(C, BC)
    dx = torch.empty_like(x)     # dxn * weight, then dx in place
    row_part = torch.empty(B, T, n_c, 2, device=x.device, dtype=torch.float32)   # each channel tile's two row sums
    param_part = torch.empty(B * programs_t, n + 2, C, device=x.device, dtype=torch.float32)
    launch(_shift_mix_bwd, (programs_t, n_c, B), x, weight, bias, mix, keep, _keep_stride(keep, T), first, stats,
           *_six(grads), dx, row_part, param_part, B, T, C, N=n, NP=next_pow2(n + 2), BT=BT, BC=BC, TILES=tiles,
           HAS_KEEP=keep is not None, HAS_FIRST=first is not None, num_warps=s.bwd_warps)
    launch(_norm_bwd, (cdiv(T, s.norm_bt), n_c, B), x, stats, dx, row_part, B, T, C, NC=n_c,
           NCP=next_pow2(n_c), BT=s.norm_bt, BC=BC, num_warps=s.norm_warps)
    params = param_part.sum(0)    # copies below: the op's outputs may not be views of one tensor
    return (dx, params[n].to(weight.dtype, copy=True), params[n + 1].to(bias.dtype, copy=True),
            params[:n].to(mix.dtype, copy=True))


@torch.library.custom_op("flame::norm_shift_mix", mutates_args=())
def _norm_shift_mix_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, mix: torch.Tensor,
                       keep: Optional[torch.Tensor], first: Optional[torch.Tensor], backend: str,
                       settings: str) -> list[torch.Tensor]:
    """The n outputs, then the row stats [2, B, T] (mean, rstd) the backward reads."""
    if uses_triton(x, backend):
        return _fwd(x, weight, bias, eps, mix, keep, first, Settings.decode(settings))
    return naive_norm_shift_mix(x, weight, bias, eps, mix, keep, first)


@_norm_shift_mix_op.register_fake
def _(x, weight, bias, eps, mix, keep, first, backend, settings):
    B, T, _ = x.shape
    stats_dtype = torch.float64 if x.dtype == torch.float64 and not uses_triton(x, backend) else torch.float32
    return [torch.empty_like(x) for _ in range(mix.shape[0])] + [x.new_empty(2, B, T, dtype=stats_dtype)]


@torch.library.custom_op("flame::norm_shift_mix_bwd", mutates_args=())
def _norm_shift_mix_bwd_op(grads: list[torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           mix: torch.Tensor, stats: torch.Tensor, keep: Optional[torch.Tensor],
                           first: Optional[torch.Tensor], backend: str,
                           settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dmix)."""
    if uses_triton(x, backend):
        return _bwd(grads, x, weight, bias, mix, stats, keep, first, Settings.decode(settings))
    return naive_norm_shift_mix_bwd(grads, x, weight, bias, mix, stats, keep, first)


@_norm_shift_mix_bwd_op.register_fake
def _(grads, x, weight, bias, mix, stats, keep, first, backend, settings):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias), torch.empty_like(mix)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, mix, keep, first, backend, settings = inputs
    ctx.save_for_backward(x, weight, bias, mix, output[-1], keep, first)
    ctx.backend, ctx.settings = backend, settings


def _backward(ctx, grads):
    x, weight, bias, mix, stats, keep, first = ctx.saved_tensors
    # an output nobody used has no grad; the stats have none
    grads = [torch.zeros_like(x) if g is None else g.contiguous() for g in grads[:-1]]
    dx, dweight, dbias, dmix = torch.ops.flame.norm_shift_mix_bwd(grads, x, weight, bias, mix, stats, keep, first,
                                                                  ctx.backend, ctx.settings)
    dfirst = None
    if first is not None:   # first[b] is xn_prev at t = 0 of row b: out_i = ... + first mix_i there (keep allowing)
        dfirst = (torch.stack([g[:, 0] for g in grads]).float() * mix.float()[:, None]).sum(0)
        if keep is not None:
            dfirst = dfirst * (keep.reshape(-1, x.shape[1])[:, :1] != 0)
        dfirst = dfirst.to(first.dtype)
    return dx, dweight, dbias, None, dmix, None, dfirst, None, None


_norm_shift_mix_op.register_autograd(_backward, setup_context=_setup_context)


def norm_shift_mix(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, mix: torch.Tensor,
                   keep: torch.Tensor | None = None, first: torch.Tensor | None = None, backend: str = "auto",
                   settings: Settings | None = None) -> list[torch.Tensor]:
    if x.dim() != 3:
        raise ValueError(f"norm_shift_mix: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if tuple(weight.shape) != (C,) or tuple(bias.shape) != (C,):
        raise ValueError(f"norm_shift_mix: weight and bias must be [C] = [{C}], got shapes {tuple(weight.shape)} and "
                         f"{tuple(bias.shape)}")
    if mix.dim() != 2 or mix.shape[1] != C or not 1 <= mix.shape[0] <= MAX_MIXES:
        raise ValueError(f"norm_shift_mix: mix must be [n, C] with C = {C} and 1 <= n <= {MAX_MIXES}, "
                         f"got shape {tuple(mix.shape)}")
    if keep is not None:
        if keep.numel() not in (T, B * T):
            raise ValueError(f"norm_shift_mix: keep must be [T], [T, 1] or [B, T] with B, T = {B}, {T}, got shape "
                             f"{tuple(keep.shape)}")
        keep = keep.reshape(-1).contiguous()
    if first is not None:
        if tuple(first.shape) != (B, C):
            raise ValueError(f"norm_shift_mix: first must be [B, C] = [{B}, {C}], got shape {tuple(first.shape)}")
        first = first.contiguous()
    outs = _norm_shift_mix_op(x.contiguous(), weight.contiguous(), bias.contiguous(), float(eps), mix.contiguous(),
                              keep, first, backend, (settings or Settings()).encode())
    return outs[:-1]
