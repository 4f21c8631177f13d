"""RWKV-7's output epilogue in plain PyTorch, forward and backward: the CPU path of rwkv7_out."""

from __future__ import annotations

import torch


def _terms(o, r, k, v, r_k, ln_w, ln_b, eps):
    """fp32 per head [M, H, N]: the normalized o (xhat), its 1 / std [M, H, 1], the bonus weight s = sum_N r k r_k
    [M, H, 1], v, and z = xhat ln_w + ln_b + s v (the output before the gate)."""
    H, N = r_k.shape
    heads = lambda x: x.reshape(-1, H, N).float()  # noqa: E731
    of, rf, kf, vf = heads(o), heads(r), heads(k), heads(v)
    xc = of - of.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    s = (rf * kf * r_k.float()).sum(-1, keepdim=True)
    z = xhat * heads(ln_w) + heads(ln_b) + s * vf
    return rf, kf, vf, xhat, rstd, s, z


def naive_rwkv7_out(o, r, k, v, r_k, ln_w, ln_b, g, eps: float):
    """y = (GroupNorm_per_head(o) ln_w + ln_b + sum_N(r k r_k) v) g in g's dtype (fp32 inside); o, r, k, v
    [..., H, N], r_k [H, N], ln_w, ln_b [C], g [..., C]."""
    z = _terms(o, r, k, v, r_k, ln_w, ln_b, eps)[-1]
    return (z.view(g.shape) * g.float()).to(g.dtype)


def naive_rwkv7_out_bwd(o, r, k, v, r_k, ln_w, ln_b, g, dy, eps: float):
    """(do, dr, dk, dv, dr_k, dln_w, dln_b, dg) of naive_rwkv7_out for dy, each in its input's dtype."""
    H, N = r_k.shape
    rf, kf, vf, xhat, rstd, s, z = _terms(o, r, k, v, r_k, ln_w, ln_b, eps)
    dz = (dy.float() * g.float()).view(z.shape)
    dg = dy.float() * z.view(g.shape)
    ds = (dz * vf).sum(-1, keepdim=True)
    dxhat = dz * ln_w.float().view(H, N)
    do = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    cast = lambda x, like: x.reshape(like.shape).to(like.dtype)  # noqa: E731
    return (cast(do, o), cast(ds * kf * r_k.float(), r), cast(ds * rf * r_k.float(), k), cast(dz * s, v),
            cast((ds * rf * kf).sum(0), r_k), cast((dz * xhat).sum(0), ln_w), cast(dz.sum(0), ln_b), cast(dg, g))
