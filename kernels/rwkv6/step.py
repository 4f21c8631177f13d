"""One token of the RWKV-6 recurrence (cached decoding: the state carries the whole prefix), in plain PyTorch.

Same math and conventions as naive.py and chunk_rwkv6, per head with state S (K x V):
    o = scale * (S^T r + (r . (u * k)) v);  S' = diag(exp(w)) S + k v^T
Every shape is fixed by the batch, so a CUDA graph can capture the step.
"""

from __future__ import annotations


def recurrent_step(r, k, v, w, u, state, scale: float | None = None):
    """r, k, w (log decay): [B, H, K]; v: [B, H, V]; u (bonus): [H, K]; state [B, H, K, V] (fp32). scale None means
    K^-0.5. Computes in the state's dtype; returns (o [B, H, V] in v's dtype, the new state in the state's dtype).
    `state` itself is not modified."""
    dt = state.dtype
    scale = r.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    r, k, v, w, u = (x.to(dt) for x in (r, k, v, w, u))
    bonus = (r * u * k).sum(-1, keepdim=True)                               # [B, H, 1]
    o = ((r.unsqueeze(-2) @ state).squeeze(-2) + bonus * v) * scale
    new = state * w.exp().unsqueeze(-1) + k.unsqueeze(-1) * v.unsqueeze(-2)
    return o.to(out_dtype), new
