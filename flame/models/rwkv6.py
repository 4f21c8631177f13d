"""RWKV-6 "Finch": time mixing through data-dependent decay (kernels.rwkv6), sqrelu channel mixing with a gate.

Follows the official RWKV-LM RWKV-6 (x060, RWKV-v5/src/model.py) definition and training: data-dependent token
shift (the time_maa lerps, moved per token by a low-rank tanh path), data-dependent decay (time_decay plus a low-rank
tanh path; log decay = -exp(.) in fp32), the per-head bonus u (time_faaaa), per-head GroupNorm, SiLU output gate;
channel mix with squared ReLU and a sigmoid receptance gate; pre-LayerNorm blocks with an extra LayerNorm on the
embeddings, final LayerNorm, untied head. Initialized as RWKV-LM's module constructors and then its
generate_init_weight leave the weights; optimizer groups and L2Wrap as RWKV-LM trains it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flame.context_parallel import Piece, chunk_rwkv6_cp
from flame.models import register
from flame.models.args import RWKV6Args
from flame.models.rwkv_shared import (RWKVCache, RWKVLayerCache, RWKVModel, cached_token_shift, norm_shift_mix_cached,
                                      norm_shift_mix_cp, token_shift, token_shift_cp)
from kernels.rwkv6 import chunk_rwkv6
from kernels.rwkv6.step import recurrent_step

LN_X_EPS = 64e-5
"""RWKV-LM's ln_x eps for x060: 1e-5 * head_size_divisor ** 2, with its default divisor 8."""
MIXES = ("w", "k", "v", "r", "g")
"""The five token-shift mixes of the time mix, in RWKV-LM's order (the rows of maa, the blocks of maa_w1 / maa_w2)."""


class TimeMix(nn.Module):
    low_rank_up_projections = ("maa_w2", "decay_w2")   # (training.recompute = ["low_rank"])

    def __init__(self, args: RWKV6Args, layer_id: int):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        C, N, D = args.hidden_size, args.head_dim, args.mix_low_rank
        self.n_heads = C // N
        self.maa_x = nn.Parameter(torch.empty(C))                 # the lerp that feeds the mix paths
        self.maa = nn.Parameter(torch.empty(len(MIXES), C))       # base lerps for w, k, v, r, g
        self.maa_w1 = nn.Parameter(torch.empty(C, len(MIXES) * D))
        self.maa_w2 = nn.Parameter(torch.empty(len(MIXES), D, C))
        self.decay = nn.Parameter(torch.empty(C))                 # w = -exp(decay + low-rank path)
        self.decay_w1 = nn.Parameter(torch.empty(C, args.decay_low_rank))
        self.decay_w2 = nn.Parameter(torch.empty(args.decay_low_rank, C))
        self.bonus = nn.Parameter(torch.empty(self.n_heads, N))  # u: the current token's extra weight
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.g_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.ln_x = nn.GroupNorm(self.n_heads, C, eps=LN_X_EPS)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        C, L, i = self.args.hidden_size, self.args.num_layers, self.layer_id
        ratio_0_to_1 = i / (L - 1)
        ratio_1_to_almost0 = 1.0 - i / L
        dev = self.maa.device
        ddd = torch.arange(C, device=dev, dtype=torch.float32) / C
        self.maa_x.copy_(1.0 - ddd ** ratio_1_to_almost0)
        full, half = ddd ** ratio_1_to_almost0, ddd ** (0.5 * ratio_1_to_almost0)
        rows = {"w": 1.0 - full, "k": 1.0 - full, "v": 1.0 - (full + 0.3 * ratio_0_to_1), "r": 1.0 - half,
                "g": 1.0 - half}
        self.maa.copy_(torch.stack([rows[m] for m in MIXES]))
        n = torch.arange(C, device=dev, dtype=torch.float32)
        self.decay.copy_(-6 + 5 * (n / (C - 1)) ** (0.7 + 1.3 * ratio_0_to_1))
        zigzag = ((n + 1) % 3 - 1) * 0.1
        self.bonus.copy_((ratio_0_to_1 * (1 - n / (C - 1)) + zigzag).view_as(self.bonus))
        # the low-rank paths start as constants: zero down-projections, small random up-projections
        nn.init.zeros_(self.maa_w1)
        nn.init.uniform_(self.maa_w2, -0.01, 0.01)
        nn.init.zeros_(self.decay_w1)
        nn.init.uniform_(self.decay_w2, -0.01, 0.01)
        # the projections and ln_x as RWKV-LM's generate_init_weight leaves them (it overrides the module's init)
        nn.init.orthogonal_(self.r_proj.weight, gain=1.0)
        nn.init.orthogonal_(self.k_proj.weight, gain=0.1)
        nn.init.orthogonal_(self.v_proj.weight, gain=1.0)
        nn.init.orthogonal_(self.g_proj.weight, gain=0.1)
        nn.init.zeros_(self.o_proj.weight)
        self.ln_x.weight.fill_(((i + 1) / L) ** 0.7)   # deeper layers start with larger outputs
        nn.init.zeros_(self.ln_x.bias)

    def forward(self, x, keep, cu_seqlens, cache: RWKVLayerCache | None = None, piece: Piece | None = None):
        """Training (cache None), or a cached pass: a prefill (packed documents from an empty cache) or rows that
        continue their cached sequences; the cached pass reads and updates the cache in place. piece: training as
        one piece of a context-parallel row (flame.context_parallel)."""
        B, T, C = x.shape
        H, N, D = self.n_heads, self.args.head_dim, self.args.mix_low_rank
        if piece is not None:
            xx = token_shift_cp(x, keep, piece, "attn_shift", self.maa_x) - x
        else:
            xx = (token_shift(x, keep) if cache is None else cached_token_shift(x, cache.attn_x, keep, cu_seqlens)) - x
        lora = torch.tanh((x + xx * self.maa_x.to(x.dtype)) @ self.maa_w1).view(B, T, len(MIXES), D)
        shifts = torch.einsum("btmd,mdc->mbtc", lora, self.maa_w2.to(x.dtype)) + self.maa[:, None, None].to(x.dtype)
        xw, xk, xv, xr, xg = x[None] + xx[None] * shifts
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        g = F.silu(self.g_proj(xg))
        # The log decay in fp32: the slow channels' exp(-exp(.)) sits within 1e-3 of 1, which bf16 cannot hold.
        z = self.decay.float() + torch.tanh((xw @ self.decay_w1).float()) @ self.decay_w2.float()
        w = -torch.exp(z)
        heads = lambda t: t.view(B, T, H, N)  # noqa: E731
        ln_weight = self.ln_x.weight
        if piece is not None:
            o, link = chunk_rwkv6_cp(piece, heads(r), heads(k), heads(v), heads(w), self.bonus, cu_seqlens)
            if link is not None:   # the chain's: its backward receives the final state's gradient before the op's
                ln_weight = ln_weight + link
        elif cache is None:
            o, _ = chunk_rwkv6(heads(r), heads(k), heads(v), heads(w), self.bonus, scale=1.0, cu_seqlens=cu_seqlens)
        else:
            o = self.cached_op(heads(r), heads(k), heads(v), heads(w), self.bonus, cu_seqlens, cache.state)
        o = F.group_norm(o.reshape(B * T, C).float(), H, ln_weight.float(), self.ln_x.bias.float(),
                         self.ln_x.eps).view(B, T, C)
        return self.o_proj(o.to(x.dtype) * g)

    @staticmethod
    def cached_op(r, k, v, w, u, cu_seqlens, state):
        """The recurrence from `state` (updated in place): one step for one token per row (never the prefix), else
        the chunk op from the cached states."""
        if cu_seqlens is None and r.shape[1] == 1:
            o, new_state = recurrent_step(r[:, 0], k[:, 0], v[:, 0], w[:, 0], u, state, scale=1.0)
            o = o[:, None]
        else:
            o, new_state = chunk_rwkv6(r, k, v, w, u, scale=1.0, initial_state=state, output_final_state=True,
                                       cu_seqlens=cu_seqlens)
        state.copy_(new_state)
        return o


class ChannelMix(nn.Module):
    mlp_input_projections = ("key",)   # (training.recompute = ["mlp_hidden"])

    def __init__(self, args: RWKV6Args, layer_id: int):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        C = args.hidden_size
        self.maa_k = nn.Parameter(torch.empty(C))
        self.maa_r = nn.Parameter(torch.empty(C))
        self.key = nn.Linear(C, args.ffn_width, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(args.ffn_width, C, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        C = self.args.hidden_size
        ratio_1_to_almost0 = 1.0 - self.layer_id / self.args.num_layers
        ddd = torch.arange(C, device=self.maa_k.device, dtype=torch.float32) / C
        self.maa_k.copy_(1.0 - ddd ** ratio_1_to_almost0)
        self.maa_r.copy_(1.0 - ddd ** ratio_1_to_almost0)
        nn.init.orthogonal_(self.key.weight, gain=1.0)   # [F, C], F > C: orthonormal columns
        nn.init.zeros_(self.receptance.weight)          # the gate starts at sigmoid(0) = 1/2 everywhere
        nn.init.zeros_(self.value.weight)

    def forward(self, x, norm, keep, cu_seqlens=None, cache: RWKVLayerCache | None = None,
                piece: Piece | None = None):
        """x: the residual stream; norm: the block's ffn_norm, applied with the token shift."""
        mix = torch.stack([self.maa_k, self.maa_r])
        if piece is not None:
            xk, xr = norm_shift_mix_cp(x, norm, mix, keep, piece, "ffn_shift")
        else:
            xk, xr = norm_shift_mix_cached(x, norm, mix, keep, cu_seqlens, None if cache is None else cache.ffn_x)
        k = torch.relu(self.key(xk)).square()
        return torch.sigmoid(self.receptance(xr)) * self.value(k)


class Block(nn.Module):
    def __init__(self, args: RWKV6Args, layer_id: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.attn = TimeMix(args, layer_id)
        self.ffn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn = ChannelMix(args, layer_id)

    def forward(self, x, keep, cu_seqlens, cache: RWKVLayerCache | None = None, piece: Piece | None = None):
        x = x + self.attn(self.attn_norm(x), keep, cu_seqlens, cache, piece)
        return x + self.ffn(x, self.ffn_norm, keep, cu_seqlens, cache, piece)


@register("rwkv6")
class RWKV6(RWKVModel):
    decay_bias = ".attn.decay"   # RWKV-LM's time_decay: 2x lr

    def __init__(self, args: RWKV6Args):
        super().__init__(args, Block)

    def run_blocks(self, x, keep, cu_seqlens, cache: RWKVCache | None, piece: Piece | None = None):
        for i, block in enumerate(self.layers):
            x = block(x, keep, cu_seqlens, None if cache is None else cache.layers[i], piece)
        return x

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul parameters (head included) + the recurrence: ~3 passes over a K x V state per token and head
        (decay and k v^T update, read o = S^T r), 2 FLOPs each, times 3 for fwd + bwd."""
        a = self.args
        return 6 * self.matmul_params() + 18 * a.num_layers * a.hidden_size * a.head_dim
