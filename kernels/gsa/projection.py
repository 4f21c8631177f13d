"""GSA from its stacked input projection: the model's feature maps and the chunk op in one call whose backward writes
the projection's gradient directly.

    o = chunk_gsa_from_projection(y, heads, head_dim, slots, normalizer, scale=1.0, cu_seqlens=None,
                                  backend=None, settings=None)

y [B, T, 3 heads head_dim + heads slots] is (q | k | v | f), one matmul's output. The features are GSA's
(`feature_maps`): silu on q, k, v (the swish feature map on q, k), the log forget gate g = logsigmoid(f) / normalizer
in fp32, and the slot writes s = 1 - e^g. They are computed here in plain PyTorch (torch.compile fuses them with
what surrounds them). On the Triton path the chunk op's backward also takes y and returns its gradient through the
feature maps, formed where dq, dk, dv, ds and dg are (`_bwd_dkvsg`), so no pass of its own reads those five and
joins them into y's layout; the features' own gradients are then None, since y's carries them. That holds because
the features passed to the op are y's, made here and nowhere else. The PyTorch path (CPU) differentiates the same
composition by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gsa.chunk import Settings, _chunk_gsa_triton, chunk_gsa, triton


def feature_maps(q, k, v, f, normalizer: float):
    """GSA's features from the projections: (silu(q), silu(k), silu(v), s, g). The gate in fp32, explicitly (bf16 log
    gates near 0 lose the slow slots over long contexts): g = logsigmoid(f) / normalizer stays fp32 into the kernel,
    s = 1 - e^g = -expm1(g) (exact for g near 0; a slot write like k and v) goes in the features' dtype."""
    g = F.logsigmoid(f.float()) / normalizer
    return F.silu(q), F.silu(k), F.silu(v), (-torch.expm1(g)).to(q.dtype), g


def chunk_gsa_from_projection(y, heads: int, head_dim: int, slots: int, normalizer: float, scale: float = 1.0,
                              cu_seqlens=None, backend: str | None = None, settings: Settings | None = None):
    """o [B, T, heads, head_dim] in y's dtype (module docstring)."""
    B, T, W = y.shape
    widths = [heads * head_dim] * 3 + [heads * slots]
    if W != sum(widths):
        raise ValueError(f"y's last dimension must be 3 heads head_dim + heads slots = {sum(widths)}, got {W}")
    q, k, v, f = y.split(widths, dim=-1)
    q, k, v, s, g = feature_maps(q, k, v, f, normalizer)
    q, k, v = (x.view(B, T, heads, head_dim) for x in (q, k, v))
    s, g = s.view(B, T, heads, slots), g.view(B, T, heads, slots)
    if backend is None:
        backend = "triton" if y.is_cuda and triton is not None else "torch"
    if backend == "torch":
        return chunk_gsa(q, k, v, s, g, scale=scale, cu_seqlens=cu_seqlens, backend="torch")[0]
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_gsa_triton(q, k, v, s, g, scale, None, False, cu_seqlens, settings, projection=(y, 1 / normalizer))[0]
