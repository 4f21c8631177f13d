"""Llama/Qwen2-style decoder baseline: RMSNorm, RoPE, SwiGLU, optional GQA, causal SDPA (flash attention on GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flame.config import ModelArgs, check
from flame.models import register
from flame.models.layers import (LanguageModel, RMSNorm, SwiGLU, apply_rotary, positions_from_cu_seqlens,
                                 rotary_cos_sin)


@dataclass
class TransformerArgs(ModelArgs):
    name: str = "transformer"
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    num_kv_heads: int | None = None
    """Grouped-query attention; None = num_heads (plain multi-head)."""
    intermediate_size: int | None = None
    """SwiGLU width; None = 8/3 * hidden rounded up to a multiple of 256."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    loss_chunk_size: int = 4096
    """Tokens per chunk of the output projection + cross entropy."""

    def validate(self) -> None:
        super().validate()
        for key in ("hidden_size", "num_layers", "num_heads"):
            check(getattr(self, key) >= 1, f"model.{key}", "an integer >= 1", getattr(self, key))
        check(self.hidden_size % self.num_heads == 0, "model.num_heads", "a divisor of model.hidden_size",
              self.num_heads)
        check((self.hidden_size // self.num_heads) % 2 == 0, "model.num_heads", "an even head dim for RoPE",
              self.num_heads)
        kv = self.kv_heads
        check(kv >= 1 and self.num_heads % kv == 0, "model.num_kv_heads", "a divisor of model.num_heads", kv)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 256 * math.ceil(8 * self.hidden_size / 3 / 256)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.kv_heads, args.hidden_size // args.num_heads
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
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

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


@register("transformer", TransformerArgs)
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
        cos, sin = rotary_cos_sin(pos, self.args.hidden_size // self.args.num_heads, self.args.rope_theta)
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x, cos, sin, mask)
        return self.logits_or_loss_sum(x, labels, B, T)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x (matmul parameters, output head included) + causal attention scores and mixing (fwd + bwd)."""
        a = self.args
        attention = 6 * a.num_layers * a.hidden_size * seq_len  # 12 * L * d * T, halved by the causal mask
        return 6 * self.matmul_params() + attention
