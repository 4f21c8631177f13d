"""Chunked RWKV-7 in plain PyTorch (the CPU path; backward by autograd). The math is in README.md.

Within a chunk of C steps, g_t = sum_{s<=t} w_s (inclusive) and ge_t = g_t - w_t (exclusive). Every decay factor is
exp(non-positive): exp(g_t), exp(ge_t), exp(g_C - g_s), and for the pairwise matrices exp(g_t - g_s) (s <= t) or
exp(ge_t - g_s) (s < t), with masked pairs replaced *before* the exp, so no inf ever meets a 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.utils import per_sequence, sequence_count


def _pairwise(x, gx, y, gy, mask):
    """A[t, s] = sum_k x[t, k] y[s, k] exp(gx[t, k] - gy[s, k]) on the mask, 0 elsewhere. x, y: [..., C, K]."""
    diff = gx[..., :, None, :] - gy[..., None, :, :]                      # [..., C, C, K]
    m = mask[:, :, None]
    decay = torch.where(m, torch.where(m, diff, torch.zeros_like(diff)).exp(), torch.zeros_like(diff))
    return torch.einsum("...tk,...sk,...tsk->...ts", x, y, decay)


def _chunk_one(r, w, k, v, a, b, scale, s0, C):
    """One sequence (or equal-length batch). Inputs [B, T, H, *] fp32; s0 [B, H, K, V] fp32."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    NC = -(-T // C)
    pad = NC * C - T
    # Padded steps have w = 0 (decay 1) and zero r, k, v, a, b: they leave the state untouched.
    r, w, k, v, a, b = (F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, NC, C, H, -1).transpose(2, 3)
                        for x in (r, w, k, v, a, b))                        # [B, NC, H, C, *]
    g = w.cumsum(-2)
    ge = g - w
    gC = g[..., -1:, :]                                                     # [B, NC, H, 1, K]
    idx = torch.arange(C, device=r.device)
    incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    A_rb = _pairwise(r, g, b, g, incl)
    A_rk = _pairwise(r, g, k, g, incl)
    A_ab = _pairwise(a, ge, b, g, strict)
    A_ak = _pairwise(a, ge, k, g, strict)
    # WY/UT form: U = (I - A_ab)^{-1} (a~ S_0 + A_ak V) = W S_0 + Uv, with W and Uv independent of the state.
    eye = torch.eye(C, device=r.device, dtype=r.dtype)
    L = eye - A_ab
    W = torch.linalg.solve_triangular(L, a * ge.exp(), upper=False, unitriangular=True)
    Uv = torch.linalg.solve_triangular(L, A_ak @ v, upper=False, unitriangular=True)
    r_dec = r * g.exp()
    b_end = b * (gC - g).exp()
    k_end = k * (gC - g).exp()
    dC = gC.exp().squeeze(-2)[..., None]                                   # [B, NC, H, K, 1]
    S = s0
    outs = []
    for c in range(NC):
        U = W[:, c] @ S + Uv[:, c]
        outs.append(scale * (r_dec[:, c] @ S + A_rb[:, c] @ U + A_rk[:, c] @ v[:, c]))
        S = dC[:, c] * S + b_end[:, c].transpose(-1, -2) @ U + k_end[:, c].transpose(-1, -2) @ v[:, c]
    o = torch.stack(outs, dim=1).transpose(2, 3).reshape(B, NC * C, H, V)[:, :T]
    return o, S


def chunk_rwkv7_torch(r, w, k, v, a, b, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                      cu_seqlens=None, chunk_size: int = 16, compute_dtype: torch.dtype = torch.float32):
    """Same call and results as `kernels.rwkv7.chunk_rwkv7`; computes in `compute_dtype` (fp32; fp64 makes a fast
    reference for long sequences), returns o in v's dtype and the final state in `compute_dtype`."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    dtype = v.dtype
    r, w, k, v, a, b = (x.to(compute_dtype) for x in (r, w, k, v, a, b))
    if initial_state is None:
        initial_state = r.new_zeros(sequence_count(B, cu_seqlens), H, K, V)
    o, final = per_sequence(B, cu_seqlens, lambda rows, span: _chunk_one(
        r[:, span], w[:, span], k[:, span], v[:, span], a[:, span], b[:, span], scale,
        initial_state[rows].to(compute_dtype), chunk_size))
    return o.to(dtype), (final if output_final_state else None)
