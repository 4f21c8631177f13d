"""Token-by-token GSA (Gated Slot Attention) recurrence: the reference every kernel test compares against.

Per head, with M memory slots, a log forget gate g_t <= 0 and slot writes s_t (both in R^M):
    Hk_t = Hk_{t-1} diag(exp(g_t)) + k_t s_t^T            (K x M)
    p_t  = softmax_M(scale * q_t^T Hk_t)
    Hv_t = diag(exp(g_t)) Hv_{t-1} + s_t v_t^T            (M x V)
    o_t  = Hv_t^T p_t
"""

from __future__ import annotations

import torch

from kernels.utils import sequence_bounds


def _naive_one(q, k, v, s, g, scale, hk, hv):
    # q, k: [B, T, H, K]; v: [B, T, H, V]; s, g: [B, T, H, M]; hk: [B, H, K, M]; hv: [B, H, M, V]
    outs = []
    decay = g.exp()
    for t in range(q.shape[1]):
        d = decay[:, t]                                                       # [B, H, M]
        hk = hk * d[:, :, None, :] + k[:, t, :, :, None] * s[:, t, :, None, :]
        p = torch.softmax(scale * torch.einsum("bhk,bhkm->bhm", q[:, t], hk), dim=-1)
        hv = hv * d[..., None] + s[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhm,bhmv->bhv", p, hv))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, hk, hv


def naive_gsa(q, k, v, s, g, scale: float | None = None, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, dtype: torch.dtype = torch.float64):
    """Returns (o in `dtype`, (Hk [N, H, K, M], Hv [N, H, M, V]) in `dtype` or None). Differentiable (autograd)."""
    B, T, H, K = q.shape
    V, M = v.shape[-1], s.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, s, g = (x.to(dtype) for x in (q, k, v, s, g))
    bounds = sequence_bounds(B, T, cu_seqlens)
    outs, hks, hvs = [], [], []
    for n, (row, bos, eos) in enumerate(bounds):
        if initial_state is None:
            hk0, hv0 = q.new_zeros(1, H, K, M), q.new_zeros(1, H, M, V)
        else:
            hk0, hv0 = (x[n:n + 1].to(dtype) for x in initial_state)
        sl = (slice(row, row + 1), slice(bos, eos))
        o, hk, hv = _naive_one(q[sl], k[sl], v[sl], s[sl], g[sl], scale, hk0, hv0)
        outs.append(o)
        hks.append(hk)
        hvs.append(hv)
    o = torch.cat(outs, dim=0) if cu_seqlens is None else torch.cat(outs, dim=1)
    return o, ((torch.cat(hks), torch.cat(hvs)) if output_final_state else None)
