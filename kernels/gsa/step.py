"""One token of the GSA recurrence (cached decoding: the two slot states carry the whole prefix), in plain PyTorch.

Same math and conventions as naive.py and chunk_gsa, per head with M slots, log forget gate g and slot writes s:
    Hk' = Hk diag(exp(g)) + k s^T;  p = softmax_M(scale * q^T Hk');  Hv' = diag(exp(g)) Hv + s v^T;  o = Hv'^T p
Every shape is fixed by the batch, so a CUDA graph can capture the step.
"""

from __future__ import annotations

import torch


def recurrent_step(q, k, v, s, g, state, scale: float | None = None):
    """q, k: [B, H, K]; v: [B, H, V]; s (slot writes), g (log forget gate): [B, H, M]; state a pair (Hk [B, H, K, M],
    Hv [B, H, M, V]) (fp32). scale None means K^-0.5. Computes in the states' dtype; returns (o [B, H, V] in v's
    dtype, (Hk', Hv') in the states' dtype). The given states are not modified."""
    hk, hv = state
    dt = hk.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, s, g = (x.to(dt) for x in (q, k, v, s, g))
    decay = g.exp()
    hk = hk * decay.unsqueeze(-2) + k.unsqueeze(-1) * s.unsqueeze(-2)
    p = torch.softmax(scale * (q.unsqueeze(-2) @ hk), dim=-1)               # [B, H, 1, M]
    hv = hv * decay.unsqueeze(-1) + s.unsqueeze(-1) * v.unsqueeze(-2)
    o = (p @ hv).squeeze(-2)
    return o.to(out_dtype), (hk, hv)
