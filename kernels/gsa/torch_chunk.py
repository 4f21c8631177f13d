"""Chunked GSA in plain PyTorch (the CPU path; backward by autograd). The math is in README.md.

Both passes share one decay: within a chunk, G_t = sum_{s<=t} g_s (inclusive) and G_C its last row. The states
never depend on q or on the softmax, so they are scanned first (chunk by chunk), then every chunk's output is formed
at once. Every decay factor is exp(non-positive): exp(G_t), exp(G_C - G_s), and exp(G_t - G_s) for s <= t, with
masked pairs replaced *before* the exp, so no inf ever meets a 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.utils import per_sequence, sequence_count


def _pair_decay(g):
    """D[..., t, s, m] = exp(sum_{s<j<=t} g[j, m]) for s <= t, else 0. g: [..., C, M].

    The exponent is summed over the steps in between, not taken as a difference of cumulative sums: a difference of
    two large sums (-500 - (-499.99)) keeps only their absolute precision, which spoils slots that barely decay
    inside a chunk where others decay fast."""
    C = g.shape[-2]
    idx = torch.arange(C, device=g.device)
    later = (idx[None, :] > idx[:, None])[:, :, None]                       # [s, j]: j > s
    seg = torch.where(later, g[..., None, :, :], 0.).cumsum(-2)              # [..., s, t, M]: sum_{s<j<=t} g_j
    seg = seg.transpose(-3, -2)                                              # [..., t, s, M]
    m = (idx[:, None] >= idx[None, :])[:, :, None]
    return torch.where(m, torch.where(m, seg, 0.).exp(), 0.)


def _chunk_one(q, k, v, s, g, scale, hk0, hv0, C):
    """One sequence (or equal-length batch). Inputs [B, T, H, *]; hk0 [B, H, K, M], hv0 [B, H, M, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = -(-T // C)
    pad = NC * C - T
    # Padded steps have g = 0 (decay 1) and zero q, k, v, s: they leave the states untouched.
    q, k, v, s, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).view(B, NC, C, H, -1).transpose(2, 3)
                     for x in (q, k, v, s, g))                               # [B, NC, H, C, *]
    G = g.cumsum(-2)
    GC = G[..., -1, :]                                                       # [B, NC, H, M]
    to_end = g.flip(-2).cumsum(-2).flip(-2) - g                              # sum_{j>t} g_j, summed, not G_C - G_t
    s_end = s * to_end.exp()                                                 # s_t decayed to the chunk end
    # States Hk^T and Hv (both [M, *], decayed along M) at the start of every chunk.
    add_k = s_end.transpose(-1, -2) @ k                                      # [B, NC, H, M, K]
    add_v = s_end.transpose(-1, -2) @ v                                      # [B, NC, H, M, V]
    dec = GC.exp()[..., None]                                                # [B, NC, H, M, 1]
    hk, hv = hk0.transpose(-1, -2), hv0
    hk_start, hv_start = [], []
    for c in range(NC):
        hk_start.append(hk)
        hv_start.append(hv)
        hk = dec[:, c] * hk + add_k[:, c]
        hv = dec[:, c] * hv + add_v[:, c]
    hk_start, hv_start = torch.stack(hk_start, 1), torch.stack(hv_start, 1)  # [B, NC, H, M, *]
    # Outputs of all chunks at once.
    D = _pair_decay(g)                                                       # [B, NC, H, C, C, M]
    eG = G.exp()
    A1 = q @ k.transpose(-1, -2)                                             # q_t . k_s
    Z = scale * (eG * (q @ hk_start.transpose(-1, -2)) + torch.einsum("...ts,...sm,...tsm->...tm", A1, s, D))
    P = torch.softmax(Z, dim=-1)
    A2 = torch.einsum("...tm,...sm,...tsm->...ts", P, s, D)                  # sum_m p_tm s_sm exp(G_tm - G_sm)
    O = (P * eG) @ hv_start + A2 @ v
    o = O.transpose(2, 3).reshape(B, NC * C, H, V)[:, :T]
    return o, hk.transpose(-1, -2), hv


def chunk_gsa_torch(q, k, v, s, g, scale: float | None = None, initial_state=None, output_final_state: bool = False,
                    cu_seqlens=None, chunk_size: int = 16, compute_dtype: torch.dtype = torch.float32):
    """Same call and results as `kernels.gsa.chunk_gsa`; computes in `compute_dtype` (fp32; fp64 makes a fast
    reference for long sequences), returns o in v's dtype and the final states in `compute_dtype`."""
    B, T, H, K = q.shape
    V, M = v.shape[-1], s.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, s, g = (x.to(compute_dtype) for x in (q, k, v, s, g))
    if initial_state is None:
        n_seq = sequence_count(B, cu_seqlens)
        hk0, hv0 = q.new_zeros(n_seq, H, K, M), q.new_zeros(n_seq, H, M, V)
    else:
        hk0, hv0 = (x.to(compute_dtype) for x in initial_state)
    o, hk, hv = per_sequence(B, cu_seqlens, lambda rows, span: _chunk_one(
        q[:, span], k[:, span], v[:, span], s[:, span], g[:, span], scale, hk0[rows], hv0[rows], chunk_size))
    return o.to(dtype), ((hk, hv) if output_final_state else None)
