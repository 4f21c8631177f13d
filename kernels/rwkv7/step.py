"""One token of the RWKV-7 recurrence (cached decoding: the state carries the whole prefix), in plain PyTorch.

Same math and conventions as naive.py and chunk_rwkv7, per head with state S (K x V):
    sa = S^T a;  S' = diag(exp(w)) S + b sa^T + k v^T;  o = scale * S'^T r
Every shape is fixed by the batch, so a CUDA graph can capture the step.
"""

from __future__ import annotations


def recurrent_step(r, w, k, v, a, b, state, scale: float = 1.0):
    """r, w (log decay), k, a, b: [B, H, K]; v: [B, H, V]; state [B, H, K, V] (fp32). Computes in the state's dtype;
    returns (o [B, H, V] in v's dtype, the new state in the state's dtype). `state` itself is not modified."""
    dt = state.dtype
    out_dtype = v.dtype
    r, w, k, v, a, b = (x.to(dt) for x in (r, w, k, v, a, b))
    sa = (a.unsqueeze(-2) @ state)                                          # [B, H, 1, V], read before the decay
    new = state * w.exp().unsqueeze(-1) + b.unsqueeze(-1) * sa + k.unsqueeze(-1) * v.unsqueeze(-2)
    o = (r.unsqueeze(-2) @ new).squeeze(-2) * scale
    return o.to(out_dtype), new
