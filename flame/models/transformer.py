"""Llama/Qwen2-style decoder baseline: RMSNorm, RoPE, SwiGLU, optional GQA, causal SDPA (flash attention on GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flame.models import register
from flame.models.args import TransformerArgs
from flame.models.layers import (LanguageModel, RMSNorm, SwiGLU, apply_rotary, positions_from_cu_seqlens,
                                 rotary_cos_sin)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.kv_heads, args.hidden_size // args.num_heads
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, slots: CacheSlots | None = None):
        B, T, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if slots is not None:
            k, v = slots.store(k, v)
        gqa = self.n_kv != self.n_heads
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = SwiGLU(args.hidden_size, args.ffn_size)

    def forward(self, x, cos, sin, mask, slots: CacheSlots | None = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, slots)
        return x + self.mlp(self.mlp_norm(x))


# ------------------------------------------------------------------------------------------------------ inference
@dataclass
class KVCache:
    """Keys and values of B sequences, each layer's [B, n_kv, capacity, head_dim] (rotated keys, the model's dtype),
    and each sequence's length: sequence b's token i sits in slot i, slots from lengths[b] on are free (stale
    contents, never attended)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    """[B] long, on the device: tokens held per sequence (also the RoPE position of the next token)."""
    longest: int
    """max(lengths), kept on the host so that a step never waits for the device to check the capacity."""

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, needed: int) -> None:
        """Room for `needed` tokens per sequence: reallocate (double) only when the slots run out, so a decode loop
        that reserved its length up front keeps the same tensors (a CUDA graph of the step stays valid)."""
        if needed <= self.capacity:
            return
        size = max(needed, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                buffers[i] = old.new_zeros(*old.shape[:2], size, old.shape[3])
                buffers[i][:, :, :old.shape[2]] = old


@dataclass
class CacheSlots:
    """One layer's cache buffers and where the step's keys and values go in them ([B, n_kv, T, D] slot indices).
    A prefill attends over its own tokens only (causal, the fast kernel); a decode step over the whole cache under
    a mask of each sequence's filled slots."""

    keys: torch.Tensor
    values: torch.Tensor
    index: torch.Tensor
    attend_cache: bool

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.scatter_(2, self.index, k)
        self.values.scatter_(2, self.index, v)
        return (self.keys, self.values) if self.attend_cache else (k, v)


@register("transformer")
class Transformer(LanguageModel):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.args.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.layers:
            for linear in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.mlp.gate_proj,
                           block.mlp.up_proj):
                nn.init.normal_(linear.weight, std=std)
            # residual-branch outputs scaled down with depth (GPT-2), so the residual stream's variance stays O(1)
            for linear in (block.attn.o_proj, block.mlp.down_proj):
                nn.init.normal_(linear.weight, std=std / math.sqrt(2 * self.args.num_layers))
            block.attn_norm.reset_parameters()
            block.mlp_norm.reset_parameters()
        self.norm.reset_parameters()

    def forward(self, input_ids, labels=None, cu_seqlens=None):
        B, T = input_ids.shape
        mask = None
        if cu_seqlens is None:
            pos = torch.arange(T, device=input_ids.device)[None]
        else:  # packed documents: attend within each document only. cu_seqlens spans the flattened B*T tokens
            # and a segment starts at every row start (flame.data.packing), so each row masks on its own.
            if cu_seqlens[-1] != B * T:
                raise ValueError(f"cu_seqlens must end at B*T = {B * T}, got {int(cu_seqlens[-1])}")
            pos = positions_from_cu_seqlens(cu_seqlens, B * T).view(B, T)
            doc = torch.searchsorted(cu_seqlens[1:], torch.arange(B * T, device=input_ids.device), right=True)
            doc = doc.view(B, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
            mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # [B, 1, T, T]
        return self.logits_or_loss_sum(self.blocks(input_ids, pos, mask), labels, B, T)

    def blocks(self, input_ids, positions, mask, cache: KVCache | None = None, attend_cache: bool = False):
        """Embedding and every block (the one path of training and inference): hidden states [B, T, C] of tokens at
        RoPE `positions` [B or 1, T]; with a cache, each layer also stores its keys and values at those slots."""
        head_dim = self.args.hidden_size // self.args.num_heads
        cos, sin = rotary_cos_sin(positions, head_dim, self.args.rope_theta)
        x = self.embed(input_ids)
        index = None
        if cache is not None:
            B, T = input_ids.shape
            index = positions.expand(B, T)[:, None, :, None].expand(B, self.args.kv_heads, T, head_dim)
        for i, block in enumerate(self.layers):
            slots = None if cache is None else CacheSlots(cache.keys[i], cache.values[i], index, attend_cache)
            x = block(x, cos, sin, mask, slots)
        return x

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], max_len: int | None = None):
        """The prompts right-padded into one [B, longest] batch under the causal mask (a prompt's tokens never see
        the padding after them, and the padding's slots are free in the cache). max_len: the cache's slots per
        sequence (default: the longest prompt + 128; decode doubles them when they run out)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt, each of at least one token")
        device = self.embed.weight.device
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, T, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        capacity = max(max_len or T + 128, T)
        shape = (B, self.args.kv_heads, capacity, self.args.hidden_size // self.args.num_heads)
        dtype = self.embed.weight.dtype
        cache = KVCache([torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
                        [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers], lengths, T)
        x = self.blocks(ids, torch.arange(T, device=device)[None], None, cache)
        last = x[torch.arange(B, device=device), lengths - 1][:, None]  # [B, 1, C]
        return self.logits_or_loss_sum(last, None, B, 1)[:, 0], cache

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: KVCache, all_logits: bool = False):
        """T new tokens per sequence at positions lengths..lengths+T-1, attending to every filled slot of their
        own sequence (and, among the new ones, causally). No host sync: a T == 1 step can be a CUDA graph."""
        B, T = input_ids.shape
        cache.reserve(cache.longest + T)
        positions = cache.lengths[:, None] + torch.arange(T, device=input_ids.device)  # [B, T]
        slot = torch.arange(cache.capacity, device=input_ids.device)
        mask = (slot[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, capacity]
        x = self.blocks(input_ids, positions, mask, cache, attend_cache=True)
        cache.lengths.add_(T)
        cache.longest += T
        if not all_logits:
            x, T = x[:, -1:], 1
        return self.logits_or_loss_sum(x, None, B, T), cache

    def flops_per_token(self, seq_len: int) -> float:
        """6 x (matmul parameters, output head included) + causal attention scores and mixing (fwd + bwd)."""
        a = self.args
        attention = 6 * a.num_layers * a.hidden_size * seq_len  # 12 * L * d * T, halved by the causal mask
        return 6 * self.matmul_params() + attention
