"""LayerNorm + token shift + lerps in plain PyTorch (fp32 arithmetic, fp64 for fp64 inputs): the CPU path of
norm_shift_mix and its backward.

    xn = LayerNorm(x) * weight + bias
    out[i] = xn + (xn_prev - xn) * mix[i],   xn_prev[t] = xn[t-1] (first at t = 0), 0 where keep == 0
"""

import torch
import torch.nn.functional as F


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or fp64 if it is fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def row_stats(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[2, B, T]: the mean and 1 / sqrt(variance + eps) of each token's channels (wide)."""
    xf = wide(x)
    return torch.stack([xf.mean(-1), torch.rsqrt(xf.var(-1, unbiased=False) + eps)])


def normalized(x, stats) -> torch.Tensor:
    """(x - mean) * rstd, wide, before the LayerNorm's weight and bias."""
    return (wide(x) - stats[0, ..., None]) * stats[1, ..., None]


def previous_tokens(xn: torch.Tensor, keep: torch.Tensor | None, first: torch.Tensor | None) -> torch.Tensor:
    """xn_prev: xn shifted by one token along T, `first` [B, C] (or zero) at t = 0, zero where keep == 0."""
    prev = F.pad(xn, (0, 0, 1, -1))
    if first is not None:
        prev[:, 0] = first.to(prev.dtype)
    if keep is not None:
        prev = prev * (keep_rows(keep, xn.shape[1]) != 0)
    return prev


def keep_rows(keep: torch.Tensor, T: int) -> torch.Tensor:
    """keep [T] / [T, 1] (every row) or [B, T] (each row its own) as [1 or B, T, 1]."""
    return keep.reshape(-1, T, 1)


def naive_norm_shift_mix(x, weight, bias, eps, mix, keep=None, first=None) -> list[torch.Tensor]:
    """The n outputs [B, T, C] in x's dtype, then the row stats [2, B, T] (fp32 or fp64), from x [B, T, C], the
    LayerNorm's weight and bias [C] and eps, mix [n, C], keep [T] / [T, 1] / [B, T] or None, first [B, C] (already
    normalized) or None."""
    stats = row_stats(x, eps)
    xn = normalized(x, stats) * wide(weight) + wide(bias)
    d = previous_tokens(xn, keep, first) - xn
    return [(xn + d * m).to(x.dtype) for m in wide(mix)] + [stats]


def naive_norm_shift_mix_bwd(grads, x, weight, bias, mix, stats, keep=None, first=None):
    """(dx, dweight, dbias, dmix), each in its input's dtype, from the grads [B, T, C] of the n outputs."""
    gf, m = torch.stack([wide(g) for g in grads]), wide(mix)[:, None, None]
    xh = normalized(x, stats)
    xn = xh * wide(weight) + wide(bias)
    dmix = (gf * (previous_tokens(xn, keep, first) - xn)[None]).sum((1, 2))
    through_prev = (gf * m).sum(0)                      # what xn_prev[t] passes on to xn[t - 1]
    from_next = F.pad(through_prev, (0, 0, -1, 1))      # through_prev[t + 1], zero at the last token
    if keep is not None:
        from_next = from_next * (F.pad(keep_rows(keep, x.shape[1])[..., 0], (-1, 1)) != 0)[..., None]
    dxn = gf.sum(0) - through_prev + from_next
    # LayerNorm's backward: the gradient of xh, less its projections on the constant and on xh
    gw = dxn * wide(weight)
    dx = stats[1, ..., None] * (gw - gw.mean(-1, keepdim=True) - xh * (gw * xh).mean(-1, keepdim=True))
    return (dx.to(x.dtype), (dxn * xh).sum((0, 1)).to(weight.dtype), dxn.sum((0, 1)).to(bias.dtype),
            dmix.to(mix.dtype))
