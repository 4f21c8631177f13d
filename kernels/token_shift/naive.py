"""Token shift + lerps in plain PyTorch (fp32 arithmetic, fp64 for fp64 inputs): the CPU path of shift_mix and its
backward.

    out[i] = x + (x_prev - x) * mix[i],   x_prev[t] = x[t-1] (first at t = 0), 0 where keep == 0
"""

import torch
import torch.nn.functional as F


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or fp64 if it is fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def previous_tokens(x: torch.Tensor, keep: torch.Tensor | None, first: torch.Tensor | None) -> torch.Tensor:
    """x_prev (wide): x shifted by one token along T, `first` [B, C] (or zero) at t = 0, zero where keep == 0."""
    prev = F.pad(wide(x), (0, 0, 1, -1))
    if first is not None:
        prev[:, 0] = first.to(prev.dtype)
    if keep is not None:
        prev = prev * (keep.reshape(-1, 1) != 0)
    return prev


def naive_shift_mix(x, mix, keep=None, first=None) -> list[torch.Tensor]:
    """The n outputs [B, T, C] in x's dtype from x [B, T, C], mix [n, C], keep [T] / [T, 1] or None, first [B, C] or
    None."""
    xf = wide(x)
    d = previous_tokens(x, keep, first) - xf
    return [(xf + d * m).to(x.dtype) for m in wide(mix)]


def naive_shift_mix_bwd(grads, x, mix, keep=None, first=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dmix in mix's dtype) from the grads [B, T, C] of the n outputs."""
    gf, xf, m = torch.stack([wide(g) for g in grads]), wide(x), wide(mix)[:, None, None]
    dmix = (gf * (previous_tokens(x, keep, first) - xf)[None]).sum((1, 2))
    through_prev = (gf * m).sum(0)                      # what x_prev[t] passes on to x[t - 1]
    dx = gf.sum(0) - through_prev
    from_next = F.pad(through_prev, (0, 0, -1, 1))      # through_prev[t + 1], zero at the last token
    if keep is not None:
        from_next = from_next * (F.pad(keep.reshape(-1), (-1, 1)) != 0)[:, None]
    return (dx + from_next).to(x.dtype), dmix.to(mix.dtype)
