"""Chunked RWKV-6 in plain PyTorch (the CPU path; backward by autograd). The math is in README.md.

Within a chunk of C steps, g_t = sum_{s<=t} w_s (inclusive) and ge_t = g_t - w_t (exclusive). Every decay factor is
exp(non-positive): exp(ge_t) (state to output), exp(g_C - g_s) (write to chunk end), exp(g_C), and the pairwise
exp(ge_t - g_s) for s < t with masked pairs replaced *before* the exp, so no inf ever meets a 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.utils import per_sequence, sequence_count


def _chunk_one(r, k, v, w, u, scale, s0, C):
    """One sequence (or equal-length batch). Inputs [B, T, H, *] and u [H, K] in the compute dtype; s0 [B, H, K, V]."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    NC = -(-T // C)
    pad = NC * C - T
    # Padded steps have w = 0 (decay 1) and zero r, k, v: they leave the state untouched.
    r, k, v, w = (F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, NC, C, H, -1).transpose(2, 3)
                  for x in (r, k, v, w))                                    # [B, NC, H, C, *]
    g = w.cumsum(-2)
    ge = g - w
    gC = g[..., -1:, :]                                                     # [B, NC, H, 1, K]
    idx = torch.arange(C, device=r.device)
    strict = (idx[:, None] > idx[None, :])[:, :, None]
    diff = ge[..., :, None, :] - g[..., None, :, :]                         # [B, NC, H, C, C, K]
    decay = torch.where(strict, torch.where(strict, diff, torch.zeros_like(diff)).exp(), torch.zeros_like(diff))
    A = torch.einsum("...tk,...sk,...tsk->...ts", r, k, decay)
    # the bonus: the current token's own write, read through u instead of the decay
    A = A + torch.diag_embed((r * u[:, None, :] * k).sum(-1))
    r_dec = r * ge.clamp_max(0).exp()
    k_end = k * (gC - g).clamp_max(0).exp()
    dC = gC.exp().squeeze(-2)[..., None]                                   # [B, NC, H, K, 1]
    S = s0
    outs = []
    for c in range(NC):
        outs.append(scale * (r_dec[:, c] @ S + A[:, c] @ v[:, c]))
        S = dC[:, c] * S + k_end[:, c].transpose(-1, -2) @ v[:, c]
    o = torch.stack(outs, dim=1).transpose(2, 3).reshape(B, NC * C, H, V)[:, :T]
    return o, S


def chunk_rwkv6_torch(r, k, v, w, u, scale: float | None = None, initial_state=None,
                      output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 16,
                      compute_dtype: torch.dtype = torch.float32):
    """Same call and results as `kernels.rwkv6.chunk_rwkv6`; computes in `compute_dtype` (fp32; fp64 makes a fast
    reference for long sequences), returns o in v's dtype and the final state in `compute_dtype`."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype = v.dtype
    r, k, v, w, u = (x.to(compute_dtype) for x in (r, k, v, w, u))
    if initial_state is None:
        initial_state = r.new_zeros(sequence_count(B, cu_seqlens), H, K, V)
    o, final = per_sequence(B, cu_seqlens, lambda rows, span: _chunk_one(
        r[:, span], k[:, span], v[:, span], w[:, span], u, scale, initial_state[rows].to(compute_dtype), chunk_size))
    return o.to(dtype), (final if output_final_state else None)
