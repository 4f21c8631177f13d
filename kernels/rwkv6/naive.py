"""Token-by-token RWKV-6 recurrence: the reference every kernel test compares against.

Per head, with state S (K x V), log decay w_t <= 0 and bonus u [K]:
    o_t = scale * (S_{t-1}^T r_t + (r_t . (u * k_t)) v_t)     (read before this step's write)
    S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T
"""

from __future__ import annotations

import torch

from kernels.utils import sequence_bounds


def _naive_one(r, k, v, w, u, scale, state):
    # r, k, w: [B, T, H, K]; v: [B, T, H, V]; u: [H, K]; state: [B, H, K, V]
    outs = []
    decay = w.exp()[..., None]                                              # [B, T, H, K, 1]
    bonus = u[..., None]                                                    # [H, K, 1]
    r, k, v = r[..., None], k[..., None], v[..., None, :]
    for t in range(decay.shape[1]):
        kv = k[:, t] * v[:, t]                                              # [B, H, K, V]
        outs.append(((state + bonus * kv) * r[:, t]).sum(-2) * scale)
        state = state * decay[:, t] + kv
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape[:-2] + v.shape[-1:])
    return o, state


def naive_rwkv6(r, k, v, w, u, scale: float | None = None, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, dtype: torch.dtype = torch.float64):
    """Returns (o in `dtype`, final state [N, H, K, V] in `dtype` or None); scale None means K^-0.5. Differentiable
    (autograd)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    r, k, v, w, u = (x.to(dtype) for x in (r, k, v, w, u))
    bounds = sequence_bounds(B, T, cu_seqlens)
    outs, finals = [], []
    for n, (row, bos, eos) in enumerate(bounds):
        s0 = r.new_zeros(1, H, K, V) if initial_state is None else initial_state[n:n + 1].to(dtype)
        sl = slice(bos, eos)
        o, s = _naive_one(r[row:row + 1, sl], k[row:row + 1, sl], v[row:row + 1, sl], w[row:row + 1, sl], u,
                          scale, s0)
        outs.append(o)
        finals.append(s)
    o = torch.cat(outs, dim=0) if cu_seqlens is None else torch.cat(outs, dim=1)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)
