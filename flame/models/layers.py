"""Pieces several models share."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flame.loss import output_loss_sum


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the input dtype (bf16 loses the mean square's precision)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """weight: in place of self.weight (a tensor derived from it)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.weight if weight is None else weight).float()).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), no biases (Llama's MLP; the parameter names are the checkpoints')."""

    mlp_input_projections = ("gate_proj", "up_proj")   # (training.recompute = ["mlp_hidden"])

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim/2] for integer positions, in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, T, H, D] by the angles; cos/sin [B or 1, T, D/2]."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each token inside its own document, for a packed row of `total` tokens."""
    idx = torch.arange(total, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[1:], idx, right=True)
    return idx - cu_seqlens[doc]


class ShortConv(nn.Module):
    """Causal depthwise convolution over time, then silu: y_t = silu(sum_j weight[:, 0, size-1-j] x_{t-j}), j < size.
    The weight is laid out as nn.Conv1d's depthwise kernel [dim, 1, size] (its last tap multiplies x_t). Sums in
    fp32. With packed documents (`positions`: each token's position in its own document) no token reads across a
    document start."""

    def __init__(self, dim: int, size: int = 4):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(dim, 1, size))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                prev: torch.Tensor | None = None) -> torch.Tensor:
        """prev [B, size - 1, D]: the inputs before each row of x [B, T, D] (a context-parallel piece; zero where
        they belong to another document), read by the row's first document only."""
        if prev is not None:
            n = self.size - 1
            if positions is not None:   # the row's first document reads on into prev: its positions run n further
                first_doc = positions == torch.arange(x.shape[1], device=x.device)
                positions = torch.nn.functional.pad(positions + n * first_doc, (n, 0), value=n)
            return self(torch.cat([prev.to(x.dtype), x], dim=1), positions)[:, n:]
        # x [B, T, D]; a handful of shifted adds (size is 2-4): clearer than conv1d plus document masks
        w = self.weight[:, 0].float().flip(-1)                   # w[:, j] multiplies x_{t-j}
        xf = x.float()
        y = xf * w[:, 0]
        for j in range(1, min(self.size, x.shape[1])):
            shifted = torch.nn.functional.pad(xf, (0, 0, j, -j))
            if positions is not None:
                shifted = shifted * (positions >= j).float()[..., None]
            y = y + shifted * w[:, j]
        return torch.nn.functional.silu(y).to(x.dtype)


class LanguageModel(nn.Module):
    """What every flame model shares around its blocks. A subclass sets `args` (loss_chunk_size, l2wrap), `embed`
    (nn.Embedding), `norm` (the final norm) and `lm_head` (nn.Linear, or None when the head is the embedding)."""

    args: Any
    context_parallel = None
    """flame.context_parallel.ContextParallel while this model runs one piece of each row (set by its enable)."""
    embed: nn.Embedding
    norm: nn.Module
    lm_head: nn.Linear | None

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits_or_loss_sum(self, x: torch.Tensor, labels: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
        """The forward tail: final norm, then fp32 logits [B, T, V] without labels, else the fp32 sum of token
        losses over labels != IGNORE_INDEX (output projection and cross entropy in chunks of loss_chunk_size)."""
        x = self.norm(x)
        weight = self.output_weight()
        if labels is None:
            return (x @ weight.t()).float().view(B, T, -1)
        return output_loss_sum(x, weight, labels, self.args.loss_chunk_size, l2wrap=self.args.l2wrap)

    # Inference: continuing sequences from a cache (flame.generate, flame.eval, flame.lm_eval). The cache is the
    # model's own object: the recurrent models' per-layer states (matrix state, token-shift or conv inputs), the
    # Transformer's keys and values. Nothing in it is ever recomputed from the prefix.

    def prefill(self, prompts: list[list[int]]):
        """Run B prompts of any lengths (>= 1 token each) from the start, in chunk mode (one packed row): returns
        (fp32 logits of each prompt's last token [B, V], the cache of the B sequences)."""
        raise NotImplementedError(f"{type(self).__name__} has no cached inference")

    def decode(self, input_ids: torch.Tensor, cache, all_logits: bool = False):
        """Continue the B sequences of `cache` by input_ids [B, T]: (fp32 logits [B, T, V] if all_logits else of
        the last position [B, 1, V], the cache). T == 1 is one recurrent step per layer (the Transformer: one query
        against its cache); T > 1 runs chunk mode from the cached states. The cache is updated in place."""
        raise NotImplementedError(f"{type(self).__name__} has no cached inference")

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def matmul_params(self) -> int:
        """Weights used once per token in a product (every parameter of 2 or more dims, output head included), less
        the embedding table, a lookup, unless it is also the output head."""
        n = sum(p.numel() for p in self.parameters() if p.dim() >= 2)
        return n if self.lm_head is None else n - self.embed.weight.numel()


def as_one_packed_row(input_ids: torch.Tensor, labels: torch.Tensor | None, cu_seqlens: torch.Tensor):
    """[B, T] rows -> one [1, B*T] row. cu_seqlens spans the flattened B*T tokens and flame.data.packing starts a
    segment at every row start, so the packed row holds the same segments and gives the same results."""
    B, T = input_ids.shape
    if cu_seqlens[-1] != B * T:
        raise ValueError(f"cu_seqlens must end at B*T = {B * T}, got {int(cu_seqlens[-1])}")
    return input_ids.reshape(1, B * T), None if labels is None else labels.reshape(1, B * T)


def packed_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts as one packed row [1, N] of token ids and its cu_seqlens [B + 1] (int32)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prefill needs at least one prompt and at least one token in every prompt")
    lengths = torch.tensor([len(p) for p in prompts])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)[None]
    return ids, cu_seqlens
