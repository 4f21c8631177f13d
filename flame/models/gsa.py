"""GSA (Gated Slot Attention, Zhang et al. 2024) as published in flash-linear-attention (FLA) 0.6.0: token mixing
through M gated memory slots (kernels.gsa), SwiGLU MLP.

Layer: q, k, v projections (each through a short causal convolution and silu when `use_short_conv`); the swish
feature map on q, k and silu on v; a per-slot forget gate f = logsigmoid(W_f x) / normalizer (log space, fp32)
writes s = 1 - e^f into the slots; two gated linear-attention passes joined by a softmax over the slots (scale 1);
then o_proj(RMSNorm(silu(o))), one RMSNorm (eps 1e-5) over the whole value width. Pre-norm blocks (RMSNorm), final
RMSNorm, untied head. Init: every matrix, convolution and the embedding normal(0, initializer_range), norms at 1, no
residual rescaling. Parameter names are FLA's inside each block, so converting a checkpoint renames prefixes only
(FLA's model.embeddings / model.layers / model.norm are embed / layers / norm here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flame.context_parallel import Piece, chunk_gsa_cp, last_tokens_of_piece, make_piece, previous_tokens
from flame.models import register
from flame.models.args import GSAArgs
from flame.models.layers import (LanguageModel, RMSNorm, ShortConv, SwiGLU, as_one_packed_row, packed_prompts,
                                 positions_from_cu_seqlens)
from kernels.gsa import chunk_gsa, chunk_gsa_from_projection, feature_maps
from kernels.gsa.step import recurrent_step
from kernels.silu_rms_norm import silu_rms_norm


@dataclass
class GSALayerCache:
    """One layer's part of a cache (see GSACache); updated in place by each cached pass."""

    q_conv: torch.Tensor | None
    """[B, conv_size - 1, C] the q convolution's last inputs (zeros before a sequence's start); None without convs."""
    k_conv: torch.Tensor | None
    """As q_conv, for k."""
    v_conv: torch.Tensor | None
    """As q_conv, for v."""
    hk: torch.Tensor
    """[B, H, K, M] fp32, the key slots after each sequence's last token."""
    hv: torch.Tensor
    """[B, H, M, V] fp32, the value slots."""


@dataclass
class GSACache:
    """What continues B sequences: per layer the short convolutions' last inputs and the two slot states (constant
    size: no tensor grows with the sequences)."""

    layers: list[GSALayerCache]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache, in a fixed order: what a CUDA graph of decode reads and writes in place (save
        and restore them around the graph's warm-up, which advances the sequences)."""
        return [t for layer in self.layers for t in vars(layer).values() if t is not None]

    @property
    def batch_size(self) -> int:
        return self.layers[0].hk.shape[0]


def last_inputs(x: torch.Tensor, n: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The last n tokens [B, n, D] of each document packed in x [1, N, D], zeros before a document's start."""
    idx = cu_seqlens[1:, None].long() - n + torch.arange(n, device=x.device)
    inside = (idx >= cu_seqlens[:-1, None].long())[..., None]
    return x[0, idx.clamp_min(0)] * inside.to(x.dtype)


def cached_conv(conv: ShortConv, x: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """conv(x) for a cached pass, which then stores each sequence's last (size - 1) inputs into `prev` in place.
    Rows of x [B, T, D] continue their sequences (the convolution reads the cached inputs); packed documents (a
    prefill) start from zero, as in training."""
    n = conv.size - 1
    if cu_seqlens is not None:
        if n:
            prev.copy_(last_inputs(x, n, cu_seqlens))
        return conv(x, positions)
    joined = torch.cat([prev.to(x.dtype), x], dim=1)
    if n:
        prev.copy_(joined[:, joined.shape[1] - n:])
    return conv(joined)[:, n:]


def convs_cp(convs: list[ShortConv], xs: list[torch.Tensor], positions: torch.Tensor | None,
             piece: Piece) -> list[torch.Tensor]:
    """conv(x) of each (conv, x) for one piece of a context-parallel row: each row's first document reads on into the
    previous rank's last (size - 1) inputs where they belong to the same document; the inputs' tails cross the
    boundary as one transfer."""
    n = convs[0].size - 1
    if n == 0:
        return [conv(x, positions) for conv, x in zip(convs, xs)]
    tails = torch.cat([last_tokens_of_piece(piece, x, n) for x in xs], -1)
    prevs = previous_tokens(piece, tails, "attn_shift", convs[0].weight).split([x.shape[-1] for x in xs], -1)
    rows_positions = None if positions is None else positions.view(piece.B, piece.T)
    return [conv(piece.rows(x), rows_positions, prev).reshape(x.shape) for conv, x, prev in zip(convs, xs, prevs)]


class GatedSlotAttention(nn.Module):
    def __init__(self, args: GSAArgs):
        super().__init__()
        self.args = args
        C, H, M = args.hidden_size, args.num_heads, args.num_slots
        self.n_heads, self.head_dim = H, C // H
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.f_proj = nn.Linear(C, H * M, bias=False)
        if args.use_short_conv:
            self.q_conv1d = ShortConv(C, args.conv_size)
            self.k_conv1d = ShortConv(C, args.conv_size)
            self.v_conv1d = ShortConv(C, args.conv_size)
        self.g_proj = nn.Linear(C, C, bias=False) if args.output_gate else None
        self.g_norm = RMSNorm(self.head_dim if args.output_gate else C, args.g_norm_eps)
        self.o_proj = nn.Linear(C, C, bias=False)

    def forward(self, x, cu_seqlens, positions, cache: GSALayerCache | None = None, piece: Piece | None = None):
        """Training (cache None), or a cached pass: a prefill (packed documents from an empty cache) or rows that
        continue their cached sequences; the cached pass reads and updates the cache in place. piece: training as
        one piece of a context-parallel row (flame.context_parallel)."""
        B, T, C = x.shape
        H, D, M = self.n_heads, self.head_dim, self.args.num_slots
        projections = (self.q_proj, self.k_proj, self.v_proj, self.f_proj)
        normalizer = self.args.gate_logit_normalizer
        link = None   # context parallelism's chain: see g_weight below
        if cache is None:
            # training: q, k, v and the gate logits from one matmul against the four weights stacked (the parameters
            # stay the modules' own), so backward sums the four input gradients inside one GEMM, not in a pass of
            # their own. Cached passes (decoding) skip the stacking: for a few tokens, copying the weights costs
            # more than the matmul that reads them.
            y = F.linear(x, torch.cat([p.weight for p in projections]))
            if piece is not None:
                q, k, v, f = y.split([p.out_features for p in projections], dim=-1)
                if self.args.use_short_conv:
                    q, k, v = convs_cp([self.q_conv1d, self.k_conv1d, self.v_conv1d], [q, k, v], positions, piece)
                o, link = self.attend(q, k, v, f, cu_seqlens, piece=piece)
            elif not self.args.use_short_conv:
                # the feature maps and the chunk op in one call, whose backward writes y's gradient directly
                o = chunk_gsa_from_projection(y, H, D, M, normalizer, scale=1.0, cu_seqlens=cu_seqlens)
            else:
                q, k, v, f = y.split([p.out_features for p in projections], dim=-1)
                q, k, v = self.q_conv1d(q, positions), self.k_conv1d(k, positions), self.v_conv1d(v, positions)
                o, link = self.attend(q, k, v, f, cu_seqlens)
        else:
            q, k, v, f = (p(x) for p in projections)
            if self.args.use_short_conv:
                q = cached_conv(self.q_conv1d, q, cache.q_conv, positions, cu_seqlens)
                k = cached_conv(self.k_conv1d, k, cache.k_conv, positions, cu_seqlens)
                v = cached_conv(self.v_conv1d, v, cache.v_conv, positions, cu_seqlens)
            o, link = self.attend(q, k, v, f, cu_seqlens, cache)
        # the chain's link: its backward receives the final states' gradient when g_norm's weight has its own
        g_weight = self.g_norm.weight if link is None else self.g_norm.weight + link
        if self.g_proj is None:
            # RMSNorm(silu(o)) over all heads together, fp32 inside (one fused op); its eps matters: at init
            # mean(silu(o)^2) is only ~1e-4
            o = silu_rms_norm(o.reshape(B, T, C), g_weight, self.g_norm.eps)
        else:
            o = (self.g_norm(o.float(), g_weight) * F.silu(self.g_proj(x).float()).view(B, T, H, D)).reshape(B, T, C)
        return self.o_proj(o.to(x.dtype))

    def attend(self, q, k, v, f, cu_seqlens, cache: GSALayerCache | None = None, piece: Piece | None = None):
        """The recurrence on the feature maps (kernels.gsa.feature_maps: swish on q, k, silu on v, the fp32 log
        gate and the slot writes) of q, k, v [B, T, H D] and the gate logits f [B, T, H M]: (o, the context-parallel
        chain's link or None)."""
        B, T, _ = q.shape
        H, D, M = self.n_heads, self.head_dim, self.args.num_slots
        q, k, v, s, g = feature_maps(q, k, v, f, self.args.gate_logit_normalizer)
        q, k, v = (t.view(B, T, H, D) for t in (q, k, v))
        s, g = s.view(B, T, H, M), g.view(B, T, H, M)
        if piece is not None:
            return chunk_gsa_cp(piece, q, k, v, s, g, cu_seqlens, self.g_norm.weight)
        if cache is None:
            return chunk_gsa(q, k, v, s, g, scale=1.0, cu_seqlens=cu_seqlens)[0], None
        return self.cached_op(q, k, v, s, g, cu_seqlens, cache), None

    @staticmethod
    def cached_op(q, k, v, s, f, cu_seqlens, cache: GSALayerCache):
        """The recurrence from the cached slots (updated in place): one step for one token per row (never the
        prefix), else the chunk op from the cached states."""
        if cu_seqlens is None and q.shape[1] == 1:
            o, (hk, hv) = recurrent_step(q[:, 0], k[:, 0], v[:, 0], s[:, 0], f[:, 0], (cache.hk, cache.hv), scale=1.0)
            o = o[:, None]
        else:
            o, (hk, hv) = chunk_gsa(q, k, v, s, f, scale=1.0, initial_state=(cache.hk, cache.hv),
                                    output_final_state=True, cu_seqlens=cu_seqlens)
        cache.hk.copy_(hk)
        cache.hv.copy_(hv)
        return o


class Block(nn.Module):
    def __init__(self, args: GSAArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = GatedSlotAttention(args)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = SwiGLU(args.hidden_size, args.ffn_size)

    def forward(self, x, cu_seqlens, positions, cache: GSALayerCache | None = None, piece: Piece | None = None):
        x = x + self.attn(self.attn_norm(x), cu_seqlens, positions, cache, piece)
        return x + self.mlp(self.mlp_norm(x))


@register("gsa")
class GSA(LanguageModel):
    def __init__(self, args: GSAArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.args.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, ShortConv)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward(self, input_ids, labels=None, cu_seqlens=None, cp_continues=None):
        """cp_continues: with context parallelism on (flame.context_parallel.enable), which rows' first token
        continues the previous rank's document (split_batch gives it)."""
        B, T = input_ids.shape
        piece = make_piece(self.context_parallel, input_ids, cu_seqlens, cp_continues)
        if piece is not None and self.args.use_short_conv and T < self.args.conv_size - 1:
            raise ValueError(f"context parallel: a piece of {T} tokens is shorter than the short convolutions' "
                             f"{self.args.conv_size - 1} previous inputs")
        positions = None
        if cu_seqlens is not None:
            input_ids, labels = as_one_packed_row(input_ids, labels, cu_seqlens)
            positions = positions_from_cu_seqlens(cu_seqlens, B * T)
        return self.logits_or_loss_sum(self.hidden(input_ids, cu_seqlens, positions, piece=piece), labels, B, T)

    def hidden(self, input_ids, cu_seqlens=None, positions=None, cache: GSACache | None = None,
               piece: Piece | None = None):
        """The last block's output [B, T, C] (before the final norm); with a cache, a cached pass through it; with a
        piece, as one piece of a context-parallel row."""
        x = self.embed(input_ids)
        for i, block in enumerate(self.layers):
            x = block(x, cu_seqlens, positions, None if cache is None else cache.layers[i], piece)
        return x

    def empty_cache(self, batch_size: int) -> GSACache:
        """Zero states for batch_size sequences (what no token has touched yet)."""
        a, p, B = self.args, self.embed.weight, batch_size
        H, D, M = a.num_heads, a.hidden_size // a.num_heads, a.num_slots
        conv = (lambda: p.new_zeros(B, a.conv_size - 1, a.hidden_size)) if a.use_short_conv else (lambda: None)
        return GSACache([GSALayerCache(conv(), conv(), conv(), p.new_zeros(B, H, D, M, dtype=torch.float32),
                                       p.new_zeros(B, H, M, D, dtype=torch.float32)) for _ in self.layers])

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]):
        ids, cu_seqlens = packed_prompts(prompts, self.embed.weight.device)
        cache = self.empty_cache(len(prompts))
        x = self.hidden(ids, cu_seqlens, positions_from_cu_seqlens(cu_seqlens, ids.shape[1]), cache)
        x = x[0, cu_seqlens[1:].long() - 1]                             # each prompt's last token
        return self.logits_or_loss_sum(x[:, None], None, len(prompts), 1)[:, 0], cache

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: GSACache, all_logits: bool = False):
        x = self.hidden(input_ids, cache=cache)
        if not all_logits:
            x = x[:, -1:]
        return self.logits_or_loss_sum(x, None, x.shape[0], x.shape[1]), cache

    def flops_per_token(self, seq_len: int) -> float:
        """6 x (matmul and convolution weights, head included) + the two slot passes: per token and head a K x M
        and an M x V state are each updated and read (4 (K + V) M FLOPs), times 3 for fwd + bwd. No term grows
        with seq_len (the within-chunk pairs are a constant factor of the chunk, not of the sequence)."""
        a = self.args
        return 6 * self.matmul_params() + 12 * a.num_layers * 2 * a.hidden_size * a.num_slots
