"""Pieces both RWKV generations (flame/models/rwkv6.py, rwkv7.py) share: the token shift, with its cached form for
decoding, and RWKV-LM's orthogonal init."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def token_shift(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """x_{t-1} (zero at t = 0 and, with packed documents, at every document start: `keep` is 0 there)."""
    shifted = F.pad(x, (0, 0, 1, -1))
    return shifted if keep is None else shifted * keep


def cached_token_shift(x: torch.Tensor, prev: torch.Tensor, keep: torch.Tensor | None,
                       cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """token_shift for a cached pass, which then stores each sequence's last x into `prev` [B, C] in place. Rows of
    x [B, T, C] continue their sequences: the first token sees the cached prev. Packed documents (a prefill) start
    from zero, as in training."""
    if cu_seqlens is None:
        shifted = torch.cat([prev[:, None].to(x.dtype), x[:, :-1]], dim=1)    # a new tensor: prev is free to change
    else:
        shifted = token_shift(x, keep)
    prev.copy_(last_tokens(x, cu_seqlens))
    return shifted


def last_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's last token [B, C]: of the rows of x [B, T, C], or of the documents packed in x [1, N, C]."""
    return x[:, -1] if cu_seqlens is None else x[0, cu_seqlens[1:].long() - 1]


def ortho_init(w: torch.Tensor, scale: float, gain_from_shape: bool = True) -> None:
    """RWKV-LM's ortho_init: orthogonal with gain scale * sqrt(rows / cols) when rows > cols."""
    rows, cols = w.shape
    gain = math.sqrt(rows / cols) if gain_from_shape and rows > cols else 1.0
    nn.init.orthogonal_(w, gain=gain * scale)
