"""Token-by-token RWKV-7 recurrence: the reference every kernel test compares against.

Per head, with state S (K x V):
    sa_t = S_{t-1}^T a_t                                   (read before the decay)
    S_t  = diag(exp(w_t)) S_{t-1} + b_t sa_t^T + k_t v_t^T
    o_t  = scale * S_t^T r_t
"""

from __future__ import annotations

import torch

from kernels.utils import sequence_bounds


def _naive_one(r, w, k, v, a, b, scale, state):
    # r, w, k, a, b: [B, T, H, K]; v: [B, T, H, V]; state: [B, H, K, V]
    outs = []
    decay = w.exp()[..., None]                                              # [B, T, H, K, 1]
    r, k, a, b, v = r[..., None], k[..., None], a[..., None], b[..., None], v[..., None, :]
    for t in range(decay.shape[1]):
        sa = (state * a[:, t]).sum(-2, keepdim=True)                       # [B, H, 1, V]
        state = state * decay[:, t] + b[:, t] * sa + k[:, t] * v[:, t]
        outs.append((state * r[:, t]).sum(-2) * scale)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def naive_rwkv7(r, w, k, v, a, b, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, dtype: torch.dtype = torch.float64):
    """Returns (o in `dtype`, final state [N, H, K, V] in `dtype` or None). Differentiable (autograd)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    r, w, k, v, a, b = (x.to(dtype) for x in (r, w, k, v, a, b))
    bounds = sequence_bounds(B, T, cu_seqlens)
    outs, finals = [], []
    for n, (row, bos, eos) in enumerate(bounds):
        if initial_state is None:
            s0 = r.new_zeros(1, H, K, V)
        else:
            s0 = initial_state[n:n + 1].to(dtype)
        sl = slice(bos, eos)
        o, s = _naive_one(r[row:row + 1, sl], w[row:row + 1, sl], k[row:row + 1, sl], v[row:row + 1, sl],
                          a[row:row + 1, sl], b[row:row + 1, sl], scale, s0)
        outs.append(o)
        finals.append(s)
    o = torch.cat(outs, dim=0) if cu_seqlens is None else torch.cat(outs, dim=1)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)
