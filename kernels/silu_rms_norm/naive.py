"""The GSA output norm in plain PyTorch, forward and backward: the CPU path of silu_rms_norm."""

from __future__ import annotations

import torch


def _terms(o, w, eps):
    """fp32 rows [M, C]: u = silu(o), its 1 / rms [M, 1], and the normalized u * rstd."""
    of = o.reshape(-1, o.shape[-1]).float()
    u = torch.nn.functional.silu(of)
    rstd = torch.rsqrt(u.square().mean(-1, keepdim=True) + eps)
    return of, u, rstd, u * rstd


def naive_silu_rms_norm(o, w, eps: float):
    """y = RMSNorm(silu(o)) w over the last dim, in o's dtype (fp32 inside); o [..., C], w [C]."""
    return (_terms(o, w, eps)[-1] * w.float()).view(o.shape).to(o.dtype)


def naive_silu_rms_norm_bwd(o, w, dy, eps: float):
    """(do, dw) of naive_silu_rms_norm for dy, each in its input's dtype."""
    of, u, rstd, uhat = _terms(o, w, eps)
    gy = dy.reshape(uhat.shape).float()
    g = gy * w.float()
    du = rstd * (g - uhat * (g * uhat).mean(-1, keepdim=True))
    sig = torch.sigmoid(of)
    do = du * sig * (1 + of * (1 - sig))
    return do.view(o.shape).to(o.dtype), (gy * uhat).sum(0).to(w.dtype)
