"""RWKV-7 "Goose": time mixing through the generalized delta rule (kernels.rwkv7), sqrelu channel mixing.

Follows the official RWKV-LM RWKV-7 (x070) definition and training: token shift with learned lerps, low-rank
decay / in-context-rate / value-residual / gate paths, L2-normalized removal key kk, per-head GroupNorm and the r*k
bonus, pre-LayerNorm blocks with an extra LayerNorm on the embeddings, final LayerNorm, untied head. Initialized as
RWKV-LM's module constructors and then its generate_init_weight leave the weights; optimizer groups and L2Wrap as
RWKV-LM trains it.
"""

from __future__ import annotations

import torch
from torch import nn

from flame.context_parallel import Piece, chunk_rwkv7_cp
from flame.models import register
from flame.models.args import RWKV7Args
from flame.models.rwkv_shared import (RWKVCache, RWKVLayerCache, RWKVModel, norm_shift_mix_cached, norm_shift_mix_cp,
                                      ortho_init)
from kernels.rwkv7 import chunk_rwkv7
from kernels.rwkv7.chunk import Settings
from kernels.rwkv7.decay import log_decay
from kernels.rwkv7.step import recurrent_step
from kernels.rwkv7_key import rwkv7_key
from kernels.rwkv7_out import rwkv7_out

STATES_ONLY = Settings(keep_chunk_tensors=False)
"""The chunk kernel's default settings but for what it keeps: the chunk states alone."""


class TimeMix(nn.Module):
    low_rank_up_projections = ("w2", "a2", "g2", "v2")   # (training.recompute = ["low_rank"])
    keep_chunk_tensors = True
    """False: the chunk kernel keeps its chunk states alone for backward (training.recompute = ["chunk_tensors"])."""

    def __init__(self, args: RWKV7Args, layer_id: int):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        # forward branches on this bool, never on layer_id: torch.compile treats an int attribute as a constant,
        # so branching on layer_id compiled the block once per layer and fell back to eager past its recompile limit
        # (8 of 24 layers compiled)
        self.supplies_v_first = layer_id == 0
        C, N = args.hidden_size, args.head_dim
        self.n_heads = C // N
        self.lerp = nn.Parameter(torch.empty(6, C))        # token-shift mix for r, w, k, v, a, g
        self.w0 = nn.Parameter(torch.empty(C))
        self.w1 = nn.Parameter(torch.empty(C, args.lora("decay")))
        self.w2 = nn.Parameter(torch.empty(args.lora("decay"), C))
        self.a0 = nn.Parameter(torch.empty(C))
        self.a1 = nn.Parameter(torch.empty(C, args.lora("a")))
        self.a2 = nn.Parameter(torch.empty(args.lora("a"), C))
        if layer_id > 0:                                    # layer 0 supplies v_first, the others lerp toward it
            self.v0 = nn.Parameter(torch.empty(C))
            self.v1 = nn.Parameter(torch.empty(C, args.lora("v")))
            self.v2 = nn.Parameter(torch.empty(args.lora("v"), C))
        self.g1 = nn.Parameter(torch.empty(C, args.lora("gate")))
        self.g2 = nn.Parameter(torch.empty(args.lora("gate"), C))
        self.k_k = nn.Parameter(torch.empty(C))
        self.k_a = nn.Parameter(torch.empty(C))
        self.r_k = nn.Parameter(torch.empty(self.n_heads, N))
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.ln_x = nn.GroupNorm(self.n_heads, C, eps=64e-5)  # RWKV-LM's eps: 1e-5 * head_size_divisor^2

    @torch.no_grad()
    def reset_parameters(self) -> None:
        C, N, L, i = self.args.hidden_size, self.args.head_dim, self.args.num_layers, self.layer_id
        ratio_0_to_1 = i / (L - 1)
        ratio_1_to_almost0 = 1.0 - i / L
        dev = self.lerp.device
        ddd = torch.arange(C, device=dev, dtype=torch.float32) / C
        powers = torch.tensor([0.2, 0.9, 0.7, 0.7, 0.9, 0.2], device=dev)[:, None] * ratio_1_to_almost0
        self.lerp.copy_(1.0 - ddd[None, :] ** powers)
        n = torch.arange(C, device=dev, dtype=torch.float32)
        linear = n / (C - 1) - 0.5
        zigzag = ((n % N) - (N - 1) / 2) / ((N - 1) / 2)
        zigzag = zigzag * zigzag.abs()
        www = -6 + 6 * (n / (C - 1)) ** (1 + ratio_0_to_1 ** 0.3)
        self.w0.copy_(www + 0.5 + zigzag * 2.5)            # 0.5: RWKV-LM's softplus offset
        self.a0.copy_(-0.19 + zigzag * 0.3 + linear * 0.4)
        for lo, hi in ((self.w1, self.w2), (self.a1, self.a2), (self.g1, self.g2)):
            nn.init.zeros_(lo)
            ortho_init(hi, 0.1)
        if self.layer_id > 0:
            self.v0.copy_(0.73 - linear * 0.4)
            nn.init.zeros_(self.v1)
            ortho_init(self.v2, 0.1)
        self.k_k.copy_(0.71 - linear * 0.1)
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        # the projections and ln_x as RWKV-LM's generate_init_weight leaves them (it overrides the module's init)
        nn.init.orthogonal_(self.r_proj.weight, gain=1.0)
        nn.init.orthogonal_(self.k_proj.weight, gain=0.1)
        nn.init.orthogonal_(self.v_proj.weight, gain=1.0)
        nn.init.zeros_(self.o_proj.weight)
        self.ln_x.weight.fill_(((i + 1) / L) ** 0.7)   # deeper layers start with larger outputs
        nn.init.zeros_(self.ln_x.bias)

    def forward(self, x, norm, v_first, keep, cu_seqlens, cache: RWKVLayerCache | None = None,
                piece: Piece | None = None):
        """Training (cache None), or a cached pass: a prefill (packed documents from an empty cache) or rows that
        continue their cached sequences; the cached pass reads and updates the cache in place. x: the residual
        stream; norm: the block's attn_norm, applied with the token shift. piece: training as one piece of a
        context-parallel row (flame.context_parallel)."""
        B, T, C = x.shape
        H, N = self.n_heads, self.args.head_dim
        if piece is not None:
            xr, xw, xk, xv, xa, xg = norm_shift_mix_cp(x, norm, self.lerp, keep, piece, "attn_shift")
        else:
            prev = None if cache is None else cache.attn_x
            xr, xw, xk, xv, xa, xg = norm_shift_mix_cached(x, norm, self.lerp, keep, cu_seqlens, prev)
        r, k = self.r_proj(xr), self.k_proj(xk)
        if self.supplies_v_first:
            v = v_first = self.v_proj(xv)
        else:
            v, v_low = self.value_and_gate_input(xv)
            v = v + ((v_first - v) * torch.sigmoid((self.v0 + v_low @ self.v2).float())).to(v.dtype)
        # The decay's logits less w0: the log decay is -e^{-1/2} sigmoid(z + w0) (kernels.rwkv7.decay), which the
        # chunk kernel forms in fp32 from z and w0 (w_bias). The nonlinearities in fp32, explicitly: bf16 sigmoid/tanh
        # near 0 and 1 lose the slow channels over long contexts. The low-rank products run in x's dtype (fp32
        # accumulation), as RWKV-LM's.
        z = torch.tanh((xw @ self.w1).float()).to(x.dtype) @ self.w2
        a_lora = (xa @ self.a1) @ self.a2        # the in-context rate a = sigmoid(a0 + a_lora), formed in rwkv7_key
        g = torch.sigmoid((xg @ self.g1).float()).to(x.dtype) @ self.g2   # gates in fp32 too, as the decay
        # k updated by the rate, the removal key -kk and the replacement kk * a (kk = normalize(k * k_k) per head)
        k, neg_kk, kk_a = (t.view(B, T, H, N) for t in rwkv7_key(k, a_lora, self.a0, self.k_k, self.k_a, N))
        heads = lambda t: t.view(B, T, H, N)  # noqa: E731
        r_k = self.r_k
        if piece is not None:
            o, link = chunk_rwkv7_cp(piece, heads(r), heads(z), k, heads(v), neg_kk, kk_a, self.w0, cu_seqlens,
                                     self.chunk_settings())
            if link is not None:   # the chain's: its backward receives the final state's gradient before the op's
                r_k = r_k + link
        elif cache is None:
            o, _ = chunk_rwkv7(heads(r), heads(z), k, heads(v), neg_kk, kk_a, scale=1.0, cu_seqlens=cu_seqlens,
                               w_bias=self.w0, settings=self.chunk_settings())
        else:
            o = self.cached_op(heads(r), heads(z), self.w0, k, heads(v), neg_kk, kk_a, cu_seqlens, cache.state)
        # per-head GroupNorm (ln_x) + the r k bonus, gated
        o = rwkv7_out(o, heads(r), k, heads(v), r_k, self.ln_x.weight, self.ln_x.bias, g, self.ln_x.eps)
        return self.o_proj(o), v_first

    def chunk_settings(self) -> Settings | None:
        """The training chunk op's kernel settings: the defaults, or the chunk states alone kept."""
        return None if self.keep_chunk_tensors else STATES_ONLY

    def value_and_gate_input(self, xv):
        """v_proj(xv) and the value residual gate's low-rank input xv @ v1 (layers > 0). With autograd on, one product
        of the two weights joined: xv's gradient then comes from one matmul instead of two summed. Without it (eval,
        decoding) the join would only copy the weights at every call, so the two products run apart."""
        if not torch.is_grad_enabled():
            return self.v_proj(xv), xv @ self.v1
        joined = xv @ torch.cat((self.v_proj.weight, self.v1.t())).t()
        return joined.split((self.args.hidden_size, self.v1.shape[1]), -1)

    @staticmethod
    def cached_op(r, z, w0, k, v, a, b, cu_seqlens, state):
        """The recurrence from `state` (updated in place): one step for one token per row (never the prefix), else
        the chunk op from the cached states. z: the decay's logits less w0."""
        if cu_seqlens is None and r.shape[1] == 1:
            w = log_decay(z[:, 0], w0)
            o, new_state = recurrent_step(r[:, 0], w, k[:, 0], v[:, 0], a[:, 0], b[:, 0], state, scale=1.0)
            o = o[:, None]
        else:
            o, new_state = chunk_rwkv7(r, z, k, v, a, b, scale=1.0, initial_state=state, output_final_state=True,
                                       cu_seqlens=cu_seqlens, w_bias=w0)
        state.copy_(new_state)
        return o


class ChannelMix(nn.Module):
    mlp_input_projections = ("key",)   # (training.recompute = ["mlp_hidden"])

    def __init__(self, args: RWKV7Args, layer_id: int):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        C = args.hidden_size
        self.x_k = nn.Parameter(torch.empty(C))
        self.key = nn.Linear(C, args.ffn_mult * C, bias=False)
        self.value = nn.Linear(args.ffn_mult * C, C, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        C = self.args.hidden_size
        ratio_1_to_almost0 = 1.0 - self.layer_id / self.args.num_layers
        ddd = torch.arange(C, device=self.x_k.device, dtype=torch.float32) / C
        self.x_k.copy_(1.0 - ddd ** (ratio_1_to_almost0 ** 4))
        nn.init.orthogonal_(self.key.weight, gain=1.0)   # [4C, C]: orthonormal columns, no sqrt(4) shape gain
        nn.init.zeros_(self.value.weight)

    def forward(self, x, norm, keep, cu_seqlens=None, cache: RWKVLayerCache | None = None,
                piece: Piece | None = None):
        """x: the residual stream; norm: the block's ffn_norm, applied with the token shift."""
        if piece is not None:
            return self.value(torch.relu(self.key(norm_shift_mix_cp(x, norm, self.x_k[None], keep, piece, "ffn_shift")[0])).square())
        h = norm_shift_mix_cached(x, norm, self.x_k[None], keep, cu_seqlens, None if cache is None else cache.ffn_x)[0]
        return self.value(torch.relu(self.key(h)).square())


class Block(nn.Module):
    def __init__(self, args: RWKV7Args, layer_id: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.attn = TimeMix(args, layer_id)
        self.ffn_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn = ChannelMix(args, layer_id)

    def forward(self, x, v_first, keep, cu_seqlens, cache: RWKVLayerCache | None = None, piece: Piece | None = None):
        """(x, v_first) from the first layer, (x, None) from the others: handing an input back out makes FSDP2 warn
        that the block returned a view (its pre-forward hook makes views of the inputs). With a cache: a cached pass
        (TimeMix.forward)."""
        h, v = self.attn(x, self.attn_norm, v_first, keep, cu_seqlens, cache, piece)
        x = x + h
        return x + self.ffn(x, self.ffn_norm, keep, cu_seqlens, cache, piece), v if self.attn.supplies_v_first else None


@register("rwkv7")
class RWKV7(RWKVModel):
    decay_bias = ".attn.w0"   # RWKV-LM's w0: 2x lr

    def __init__(self, args: RWKV7Args):
        super().__init__(args, Block)

    def run_blocks(self, x, keep, cu_seqlens, cache: RWKVCache | None, piece: Piece | None = None):
        # v_first (layer 0's value) is per token: recomputed at every step, never cached
        v_first = None
        for i, block in enumerate(self.layers):
            x, v = block(x, v_first, keep, cu_seqlens, None if cache is None else cache.layers[i], piece)
            v_first = v_first if v is None else v
        return x

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul parameters (head included) + the recurrence: ~4 products of a K x V state per token and
        head (read sa, two rank-one updates, read o), 2 FLOPs each, times 3 for fwd + bwd."""
        a = self.args
        return 6 * self.matmul_params() + 24 * a.num_layers * a.hidden_size * a.head_dim
