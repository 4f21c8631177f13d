"""What both RWKV generations (flame/models/rwkv6.py, rwkv7.py) share: the token shift (with the block's LayerNorm
and its lerps fused, and alone for RWKV-6's data-dependent lerps), with their cached forms for decoding, RWKV-LM's
orthogonal init, the cache, and the model around the blocks (RWKVModel)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flame.context_parallel import Piece, make_piece, previous_tokens
from flame.models.layers import LanguageModel, as_one_packed_row, packed_prompts
from flame.optim import ParamGroup, trainable_parameters
from kernels.token_shift import norm_shift_mix


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


def norm_shift_mix_cached(x: torch.Tensor, norm: nn.LayerNorm, mix: torch.Tensor, keep: torch.Tensor | None,
                          cu_seqlens: torch.Tensor | None = None,
                          prev: torch.Tensor | None = None) -> list[torch.Tensor]:
    """xn + (xn_{t-1} - xn) * mix[i] for each row of mix [n, C], xn = norm(x): n tensors [B, T, C], in one pass over x
    (kernels.token_shift).
    With a cache's `prev` [B, C] (a cached pass) rows of x continue their sequences from prev, packed documents (a
    prefill) start from zero as in training; prev then holds each sequence's last xn (updated in place)."""
    out = norm_shift_mix(x, norm.weight, norm.bias, norm.eps, mix, keep,
                         prev if prev is not None and cu_seqlens is None else None)
    if prev is not None:
        prev.copy_(norm(last_tokens(x, cu_seqlens)))
    return out


def norm_shift_mix_cp(x: torch.Tensor, norm: nn.LayerNorm, mix: torch.Tensor, keep: torch.Tensor | None,
                      piece: Piece, kind: str) -> list[torch.Tensor]:
    """norm_shift_mix for one piece of a context-parallel row: each row's first token shifts in the previous rank's
    last normalized token (where it continues that document; kind: the transfer's, flame.context_parallel.LINKS) as
    the op's `first`, which takes its gradient. The op runs over the piece's B rows (one packed row of B * T tokens
    too), with each row's own keep and every row's first token kept: `first` is zero where the row does not
    continue."""
    first = previous_tokens(piece, norm(piece.rows(x)[:, -1:]), kind, norm.weight)[:, 0]
    if keep is not None:
        keep = keep.reshape(piece.B, piece.T)
        keep = torch.cat([torch.ones_like(keep[:, :1]), keep[:, 1:]], 1)
    outs = norm_shift_mix(piece.rows(x), norm.weight, norm.bias, norm.eps, mix, keep, first)
    return [out.reshape(x.shape) for out in outs]


def token_shift_cp(x: torch.Tensor, keep: torch.Tensor | None, piece: Piece, kind: str,
                   anchor: torch.Tensor) -> torch.Tensor:
    """token_shift for one piece of a context-parallel row (the previous rank's last token where it continues;
    kind, anchor: flame.context_parallel.previous_tokens')."""
    shifted = token_shift(x, keep)
    piece.rows(shifted)[:, 0] += previous_tokens(piece, piece.rows(x)[:, -1:], kind, anchor)[:, 0].to(x.dtype)
    return shifted


def last_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's last token [B, C]: of the rows of x [B, T, C], or of the documents packed in x [1, N, C]."""
    return x[:, -1] if cu_seqlens is None else x[0, cu_seqlens[1:].long() - 1]


def ortho_init(w: torch.Tensor, scale: float, gain_from_shape: bool = True) -> None:
    """RWKV-LM's ortho_init: orthogonal with gain scale * sqrt(rows / cols) when rows > cols."""
    rows, cols = w.shape
    gain = math.sqrt(rows / cols) if gain_from_shape and rows > cols else 1.0
    nn.init.orthogonal_(w, gain=gain * scale)


@dataclass
class RWKVLayerCache:
    """One layer's part of an RWKV cache; updated in place by each cached pass."""

    attn_x: torch.Tensor
    """[B, C] the time mix's input (after attn_norm) at each sequence's last token: the next token's shift."""
    ffn_x: torch.Tensor
    """[B, C] the channel mix's input (after ffn_norm) at each sequence's last token."""
    state: torch.Tensor
    """[B, H, K, V] fp32, the matrix state after each sequence's last token."""


@dataclass
class RWKVCache:
    """What continues B sequences: per layer the two token-shift inputs and the matrix state (constant size: no
    tensor grows with the sequences)."""

    layers: list[RWKVLayerCache]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache, in a fixed order: what a CUDA graph of decode reads and writes in place."""
        return [t for layer in self.layers for t in vars(layer).values()]

    @property
    def batch_size(self) -> int:
        return self.layers[0].state.shape[0]


class RWKVModel(LanguageModel):
    """What RWKV-6 and RWKV-7 share around their blocks: RWKV-LM's init of the embedding, head and norms, the
    packed-document token-shift reset, cached inference and RWKV-LM's optimizer groups. A subclass passes its
    block class (blocks with reset_parameters on their parts), sets `decay_bias` (the name ending of the parameter
    RWKV-LM trains at 2x lr) and runs its blocks in `run_blocks`."""

    decay_bias: str

    def __init__(self, args, block: type):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)   # RWKV's ln0, before layer 0
        self.layers = nn.ModuleList(block(args, i) for i in range(args.num_layers))
        self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def run_blocks(self, x, keep, cu_seqlens, cache: RWKVCache | None, piece: Piece | None = None) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def init_weights(self) -> None:
        a = self.args
        nn.init.uniform_(self.embed.weight, -1e-4, 1e-4)
        # orthogonal head with gain 0.5 sqrt(V / C): logits start with std ~0.5, so the first loss is ~ln(V)
        ortho_init(self.lm_head.weight, 0.5 * math.sqrt(a.vocab_size / a.hidden_size) if a.vocab_size > a.hidden_size
                   else 0.5, gain_from_shape=False)
        for norm in (self.embed_norm, self.norm):
            norm.reset_parameters()
        for block in self.layers:
            block.attn_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
            block.attn.reset_parameters()
            block.ffn.reset_parameters()

    def forward(self, input_ids, labels=None, cu_seqlens=None, cp_continues=None):
        """cp_continues: with context parallelism on (flame.context_parallel.enable), which rows' first token
        continues the previous rank's document (split_batch gives it)."""
        B, T = input_ids.shape
        piece = make_piece(self.context_parallel, input_ids, cu_seqlens, cp_continues)
        if cu_seqlens is not None:
            input_ids, labels = as_one_packed_row(input_ids, labels, cu_seqlens)
        x = self.hidden(input_ids, cu_seqlens, piece=piece)
        return self.logits_or_loss_sum(x, labels, B, T)

    def hidden(self, input_ids, cu_seqlens=None, cache: RWKVCache | None = None, piece: Piece | None = None):
        """The last block's output [B, T, C] (before the final norm); with a cache, a cached pass through it; with a
        piece, as one piece of a context-parallel row."""
        keep = None
        if cu_seqlens is not None:   # 0 at every document start: the token shift restarts there
            n = input_ids.shape[1]
            keep = torch.ones(n, 1, device=input_ids.device)
            keep[cu_seqlens[:-1].long().clamp_max(n - 1)] = 0
        x = self.embed_norm(self.embed(input_ids))
        return self.run_blocks(x, None if keep is None else keep.to(x.dtype), cu_seqlens, cache, piece)

    def empty_cache(self, batch_size: int) -> RWKVCache:
        """Zero states for batch_size sequences (what no token has touched yet)."""
        a, p, B = self.args, self.embed.weight, batch_size
        H, N = a.hidden_size // a.head_dim, a.head_dim
        return RWKVCache([RWKVLayerCache(p.new_zeros(B, a.hidden_size), p.new_zeros(B, a.hidden_size),
                                         p.new_zeros(B, H, N, N, dtype=torch.float32)) for _ in self.layers])

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]):
        ids, cu_seqlens = packed_prompts(prompts, self.embed.weight.device)
        cache = self.empty_cache(len(prompts))
        x = last_tokens(self.hidden(ids, cu_seqlens, cache), cu_seqlens)
        return self.logits_or_loss_sum(x[:, None], None, len(prompts), 1)[:, 0], cache

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: RWKVCache, all_logits: bool = False):
        x = self.hidden(input_ids, None, cache)
        if not all_logits:
            x = x[:, -1:]
        return self.logits_or_loss_sum(x, None, x.shape[0], x.shape[1]), cache

    def optimizer_groups(self) -> list[ParamGroup]:
        """RWKV-LM's groups: the decay bias at twice the learning rate; the weights of the linear layers (head
        included) and the embedding with weight decay; everything else (low-rank factors, lerps and other vectors,
        norms) at 1x without decay. RWKV-LM: decay on small tensors makes the model much worse."""
        tables = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        lr_2x, decay, lr_1x = [], [], []
        for name, p in trainable_parameters(self).items():
            if name.endswith(self.decay_bias):
                lr_2x.append(name)
            elif id(p) in tables:
                decay.append(name)
            else:
                lr_1x.append(name)
        return [ParamGroup("decay", decay, weight_decay=True), ParamGroup("lr_1x", lr_1x, weight_decay=False),
                ParamGroup("lr_2x", lr_2x, weight_decay=False, lr_scale=2.0)]
