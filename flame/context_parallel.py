"""Context parallelism for the recurrent models: every row of a micro-batch is cut into `size` contiguous pieces, one
per rank of a cp group, and the models exchange only what crosses a piece boundary (docs/context_parallel.md):

- the recurrent state: each rank forms, from its piece alone, its local final state S_r (from a zero state) and the
  transition A_r that carries an incoming state through the piece (RWKV-6 / GSA: a diagonal decay; RWKV-7: the K x K
  product of its per-token transitions). The pairs are all-gathered, each rank folds those of the ranks before it in
  order, E_r = A_r(E_{r-1}) + S_r, and adds what E_{r-1} contributes to its outputs (RWKV-7, RWKV-6: a product
  afterwards, the outputs being linear in the state; GSA: its chunk op runs from E_{r-1}). One chunk op per layer
  and rank in every case (RWKV-7's over V + K value columns). The gather is differentiable: its backward sums every
  rank's gradient of the gathered states and hands each rank the part of its own.
- the token shift / short convolution inputs: the previous rank's last token(s) of every row, gathered the same way.

Packed documents: a piece's row starts a segment of the local cu_seqlens; the incoming state and tokens reach only
its first segment, and only when that segment continues the previous rank's document (`cp_continues`); the
transition is zero unless the whole row piece is one continuing segment.

The API the trainer uses: ContextParallel, split_batch, enable (flame/config.py checks the sequence length against
kernels/limits.py's CHUNK_MULTIPLE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from flame import cp_chain
from flame.config import CONTEXT_PARALLEL_MODELS



LINKS = ("attn_shift", "state", "ffn_shift")
"""The chain's kinds of transfer, one process group each (flame/cp_chain.py)."""


@dataclass(frozen=True)
class ContextParallel:
    group: dist.ProcessGroup   # the ranks sharing one sequence, in sequence order
    rank: int                  # this rank's piece: 0 = the first T/size tokens of every row
    size: int
    links: dict[str, str] | None = field(default=None, compare=False)
    """The chain's process group per kind of transfer (LINKS; by name, as its custom ops take them): the layers pass
    states and tokens rank to rank (flame/cp_chain.py). None: they all-gather them (the gather)."""


def chain_links(cp_groups: list[list[int]]) -> dict[str, str]:
    """Creates a process group per kind of transfer for each cp group (its ranks in sequence order; every rank of the
    job calls this, with the same list) and returns this rank's: ContextParallel.links."""
    mine, rank = {}, dist.get_rank()
    for kind in LINKS:
        for ranks in cp_groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group.group_name
    return mine


def split_batch(batch: dict, cp: ContextParallel) -> dict:
    """The global micro-batch {"input_ids" [B, T], "labels" [B, T], optional "cu_seqlens" (int32 offsets of the
    flattened B*T tokens, a segment starting at every row start)} -> this rank's piece: input_ids, labels [B, T/size],
    cu_seqlens (the piece's own segments: one starts at every row start and at every document start inside the
    piece; absent when the batch has none) and cp_continues [B] bool (row b's first token continues the previous
    rank's document)."""
    unknown = set(batch) - {"input_ids", "labels", "cu_seqlens"}
    if unknown:
        raise ValueError(f"context parallel split_batch: unknown batch keys {sorted(unknown)}")
    ids = batch["input_ids"]
    B, T = ids.shape
    if T % cp.size:
        raise ValueError(f"context parallel: sequence length {T} is not divisible by the cp degree {cp.size}")
    n = T // cp.size
    lo = cp.rank * n
    piece = {"input_ids": ids[:, lo:lo + n].contiguous()}
    if batch.get("labels") is not None:
        piece["labels"] = batch["labels"][:, lo:lo + n].contiguous()
    cu = batch.get("cu_seqlens")
    if cu is None:
        piece["cp_continues"] = torch.full((B,), cp.rank > 0, dtype=torch.bool, device=ids.device)
        return piece
    starts = cu[:-1].long()
    row, col = starts // T, starts % T
    inside = (col >= lo) & (col < lo + n)
    row_starts = torch.arange(B, device=cu.device) * n
    local = torch.cat([row_starts, row[inside] * n + col[inside] - lo]).unique()   # sorted
    piece["cu_seqlens"] = torch.cat([local, local.new_tensor([B * n])]).to(torch.int32)
    starts_here = torch.zeros(B, dtype=torch.bool, device=ids.device)
    starts_here[row[col == lo]] = True
    piece["cp_continues"] = ~starts_here & (cp.rank > 0)
    return piece


def enable(model: torch.nn.Module, cp: ContextParallel | None) -> None:
    """Make `model` run as one piece of a cp group (None: off)."""
    name = getattr(getattr(model, "args", None), "name", type(model).__name__)
    if cp is not None:
        if name not in CONTEXT_PARALLEL_MODELS:
            raise ValueError(f"context parallel supports {', '.join(CONTEXT_PARALLEL_MODELS)}, not model {name!r}")
        if dist.get_world_size(cp.group) != cp.size or dist.get_rank(cp.group) != cp.rank:
            raise ValueError(f"context parallel: rank {cp.rank} of {cp.size} does not match the process group's "
                             f"rank {dist.get_rank(cp.group)} of {dist.get_world_size(cp.group)}")
    model.context_parallel = cp


@dataclass
class Piece:
    """What a model's layers need of their rank's piece: B rows of T tokens each (flattened to one packed row when
    cu_seqlens is given). Per row: continues (1 where its first token continues the previous rank's document, fp32
    [B]), first_seg / last_seg (its first and last segment among the chunk op's sequences), carries (1 where the row
    piece is one continuing segment: an incoming state crosses it), first_end / last_start (where its first segment
    ends and its last one starts)."""

    cp: ContextParallel
    B: int
    T: int
    continues: torch.Tensor
    first_seg: torch.Tensor
    last_seg: torch.Tensor
    carries: torch.Tensor
    last_start: torch.Tensor
    first_end: torch.Tensor
    segments: int

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] or one packed row [1, B*T, ...] as [B, T, ...]."""
        return x.reshape(self.B, self.T, *x.shape[2:])


def make_piece(cp: ContextParallel | None, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
               continues: torch.Tensor | None) -> Piece | None:
    """The Piece of a model's forward (input_ids [B, T] before any packing), or None without cp."""
    if cp is None:
        return None
    cp_chain.wait_sends()   # the previous pass's sends
    B, T = input_ids.shape
    dev = input_ids.device
    if continues is None:
        if cu_seqlens is not None:
            raise ValueError("context parallel with packed documents needs cp_continues (from split_batch)")
        continues = torch.full((B,), cp.rank > 0, device=dev)
    continues = continues.to(device=dev, dtype=torch.float32)
    if cu_seqlens is None:
        seg = torch.arange(B, device=dev)
        zero, end = torch.zeros(B, dtype=torch.long, device=dev), torch.full((B,), T, device=dev)
        return Piece(cp, B, T, continues, seg, seg, continues, zero, end, B)
    cu = cu_seqlens.long()
    row_starts = torch.arange(B, device=dev) * T
    first = torch.searchsorted(cu[:-1], row_starts)
    if not torch.equal(cu[first], row_starts):
        raise ValueError("context parallel: cu_seqlens must start a segment at every row start (use split_batch)")
    n = cu.numel() - 1
    last = torch.cat([first[1:], first.new_tensor([n])]) - 1
    carries = continues * (first == last).float()
    return Piece(cp, B, T, continues, first, last, carries, cu[last] - row_starts, cu[first + 1] - row_starts, n)


def all_gather_autograd():
    """torch's differentiable all-gather along dim 0 (its backward reduce-scatters: every rank's gradient summed, each
    rank keeping its own part). A functional collective: Dynamo traces it, so a compiled, checkpointed block stays one
    graph (a graph break inside a checkpoint runs the whole block eagerly). Newer torch names it
    all_gather_single_autograd (the older name warns there)."""
    import torch.distributed._functional_collectives as fc

    return getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


def _gather(cp: ContextParallel, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each rank's `tensors` (same shapes on every rank), differentiably: [rank][i]."""
    flat = torch.cat([t.float().reshape(-1) for t in tensors])
    rows = all_gather_autograd()(flat[None], 0, cp.group)
    sizes = [t.numel() for t in tensors]
    return [[p.view_as(t) for p, t in zip(row.split(sizes), tensors)] for row in rows.unbind(0)]


def incoming_state(piece: Piece, local: list[torch.Tensor], transition: list[torch.Tensor],
                   carry: Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """The state entering this rank's rows [B, ...] (fp32), each row's from the ranks before it:
    E_j = carry(A_j, E_{j-1}) + S_j over j < rank, E_{-1} = 0. local: this rank's S (zero initial state, each row's last
    segment); transition: its A (zero where the row does not carry)."""
    gathered = _gather(piece.cp, local + transition)
    n = len(local)
    # Every rank folds all pieces but the last and keeps its own prefix: the same graph on every rank, so each one
    # reaches the gather's backward (its collective) in the same order, rank 0 included.
    prefixes = [[torch.zeros_like(t, dtype=torch.float32) for t in local]]
    for j in range(piece.cp.size - 1):
        carried = carry(gathered[j][n:], prefixes[-1])
        prefixes.append([s + c for s, c in zip(gathered[j][:n], carried)])
    return [torch.stack(states)[piece.cp.rank] for states in zip(*prefixes)]


def previous_tokens(piece: Piece, last: torch.Tensor, kind: str, anchor: torch.Tensor) -> torch.Tensor:
    """The previous rank's `last` [B, n, C] (its rows' last n tokens, zeroed where they are not in its rows' last
    segment), zero where this rank's row does not continue that document: [B, n, C] fp32. kind and anchor: the
    chain's kind of transfer (LINKS) and a parameter of the layer (cp_chain.recv_prev)."""
    cp = piece.cp
    if cp.links is None:
        prev = _gather(cp, [last])[max(cp.rank - 1, 0)][0]
    else:
        group = cp.links[kind]
        link = cp_chain.send(group, cp.rank, cp.size, last)
        prev = cp_chain.receive(group, cp.rank, anchor, last, list(last.shape), last.dtype).float()
        if link is not None:   # the send's backward then receives last's gradient when prev's is there
            prev = prev + link
    return prev * piece.continues[:, None, None]


def last_tokens_of_piece(piece: Piece, x: torch.Tensor, n: int) -> torch.Tensor:
    """x's last n tokens of every row [B, n, C], zero before the row's last segment (what the next rank may read)."""
    tail = piece.rows(x)[:, piece.T - n:]
    idx = torch.arange(piece.T - n, piece.T, device=x.device)
    return tail * (idx[None] >= piece.last_start[:, None]).to(tail.dtype)[..., None]


def first_segment_states(piece: Piece, state: torch.Tensor) -> torch.Tensor:
    """Incoming row states [B, ...] -> initial states of the chunk op's sequences [segments, ...]: a row's state goes to
    its first segment where that continues the previous rank's document, zero elsewhere."""
    state = state * piece.continues.view(-1, *[1] * (state.dim() - 1))
    if piece.segments == piece.B:
        return state
    return state.new_zeros(piece.segments, *state.shape[1:]).index_add(0, piece.first_seg, state)


def first_segment_mask(piece: Piece) -> torch.Tensor:
    """[B, T, 1, 1] fp32: 1 on the tokens an incoming state reaches (the row's first segment, if it continues)."""
    idx = torch.arange(piece.T, device=piece.continues.device)
    mask = (idx[None] < piece.first_end[:, None]).float() * piece.continues[:, None]
    return mask[..., None, None]


def last_segment_mask(piece: Piece) -> torch.Tensor:
    """[B, T, 1, 1] fp32: 1 on the tokens of each row's last segment (those its final state sums)."""
    idx = torch.arange(piece.T, device=piece.continues.device)
    return (idx[None] >= piece.last_start[:, None]).float()[..., None, None]


def exclusive_cumsum(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Along dim 1: sum over s < t (reverse: s > t) of x_s."""
    if reverse:
        return exclusive_cumsum(x.flip(1)).flip(1)
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1).cumsum(1)


def row_log_decay_sum(piece: Piece, w: torch.Tensor) -> torch.Tensor:
    """The diagonal transition of each row's piece, exp(sum of the log decays w [B or 1, B*T, H, D]) [B, H, D] fp32,
    zero where the row does not carry."""
    total = piece.rows(w.float()).sum(1).exp()
    return total * piece.carries[:, None, None]


def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The operand type of the exchange's long products (over every token of a piece): bf16/fp16 inputs multiply in
    their own type with fp32 accumulation on the tensor cores, as the chunk kernels' products do; fp32 stays fp32 (the
    CPU reference). An fp32 product there runs on the GPU's CUDA cores at a fraction of that speed."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def add_incoming(piece: Piece, o: torch.Tensor, reach: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """o [B or 1, B*T, H, V] plus what the incoming state [B, H, K, V] adds to it: reach_t^T E on the tokens it
    reaches, reach [.., H, K] being what the identity state gives at t (the output is linear in the state)."""
    dt = product_dtype(o)
    extra = torch.einsum("bthk,bhkv->bthv", piece.rows(reach).to(dt), state.to(dt)) * first_segment_mask(piece)
    return o + extra.to(o.dtype).reshape(o.shape)


def chained_state(piece: Piece, anchor: torch.Tensor, after: torch.Tensor, row_shape: list[int],
                  chunk_op: Callable[[torch.Tensor | None, bool], tuple]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk op of this rank's piece through the chain: chunk_op(initial states or None, whether to return the final
    states) runs from the row states [B, *row_shape] fp32 the previous rank sends (placed after `after`; anchor:
    recv_prev's) and its rows' final states go on to the next rank. Returns (o, link) (chunk_rwkv7_cp)."""
    cp = piece.cp
    group, last_rank = cp.links["state"], cp.rank == cp.size - 1
    h0 = None
    if cp.rank > 0:
        incoming = cp_chain.receive(group, cp.rank, anchor, after, [piece.B, *row_shape], torch.float32)
        h0 = first_segment_states(piece, incoming)
    o, final = chunk_op(h0, not last_rank)
    return o, None if last_rank else cp_chain.send(group, cp.rank, cp.size, final[piece.last_seg])


# The three recurrences run as pieces: local outputs and state from zero, transition, exchange, then what the
# incoming state adds. Only the public chunk calls are used (the Triton path on CUDA, the PyTorch path on CPU).

def chunk_rwkv7_cp(piece: Piece, r, z, k, v, a, b, w0, cu_seqlens, settings=None):
    """chunk_rwkv7 (decay logits z, bias w0, scale 1, kernel `settings`) of this rank's piece, continuing the previous
    ranks' states:
    (o, link), link being the chain's (cp_chain.send_next: the caller adds it to a small tensor its output's
    backward differentiates, before the chunk op's; None for the gather).
    Chain: the chunk op runs from the state the previous rank sends, and sends its final state on.
    Gather: one chunk op over [v | 0] from [0 | I] (its columns are independent): the left V columns give the local
    outputs and final state, the right K the transition P = prod_t (diag(e^w_t) + b_t a_t^T) (final state) and each
    token's reach r_t^T prod_{s<=t} (...) (outputs), through which the incoming state E adds reach_t^T E."""
    from kernels.rwkv7 import chunk_rwkv7

    if piece.cp.links is not None:
        return chained_state(piece, w0, k, [*k.shape[2:], v.shape[-1]], lambda h0, final: chunk_rwkv7(
            r, z, k, v, a, b, scale=1.0, initial_state=h0, output_final_state=final, cu_seqlens=cu_seqlens,
            w_bias=w0, settings=settings))
    V, (_, _, H, K) = v.shape[-1], k.shape
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], -1)
    eye = torch.eye(K, device=k.device).expand(piece.segments, H, K, K)
    h0 = torch.cat([eye.new_zeros(piece.segments, H, K, V), eye], -1)
    o, final = chunk_rwkv7(r, z, k, wide, a, b, scale=1.0, initial_state=h0, output_final_state=True,
                           cu_seqlens=cu_seqlens, w_bias=w0, settings=settings)
    o, reach = o.split([V, K], -1)
    local, product = final[piece.last_seg].split([V, K], -1)
    state, = incoming_state(piece, [local], [product * piece.carries[:, None, None, None]],
                            lambda p, e: [p[0] @ e[0]])
    return add_incoming(piece, o, reach, state), None


def chunk_rwkv6_cp(piece: Piece, r, k, v, w, u, cu_seqlens):
    """chunk_rwkv6 (log decay w, bonus u, scale 1) of this rank's piece, continuing the previous ranks' states:
    (o, link) as chunk_rwkv7_cp's. Chain: the chunk op from the state the previous rank sends. Gather: the chunk op
    from zero, then the incoming state E adds (r_t e^{sum_{s<t} w_s})^T E (the bonus term has no state)."""
    from kernels.rwkv6 import chunk_rwkv6

    if piece.cp.links is not None:
        return chained_state(piece, u, k, [*k.shape[2:], v.shape[-1]], lambda h0, final: chunk_rwkv6(
            r, k, v, w, u, scale=1.0, initial_state=h0, output_final_state=final, cu_seqlens=cu_seqlens))
    o, final = chunk_rwkv6(r, k, v, w, u, scale=1.0, output_final_state=True, cu_seqlens=cu_seqlens)
    state, = incoming_state(piece, [final[piece.last_seg]], [row_log_decay_sum(piece, w)],
                            lambda d, e: [d[0][..., None] * e[0]])
    reach = r.float() * exclusive_cumsum(piece.rows(w.float())).exp().reshape(r.shape)
    return add_incoming(piece, o, reach, state), None


def chunk_gsa_cp(piece: Piece, q, k, v, s, g, cu_seqlens, anchor):
    """chunk_gsa (scale 1) of this rank's piece, continuing the previous ranks' two slot states: (o, link) as
    chunk_rwkv7_cp's (anchor: a parameter of the layer, the chain's recv_prev anchor).
    Chain: the chunk op from the two states the previous rank sends (one message: Hk and Hv flattened side by side).
    Gather: the softmax between the passes keeps the incoming state from being added afterwards, so the chunk op runs
    once, from it; the local final states it needs first are sums of decayed writes, Hk = sum_t k_t (s_t
    e^{sum_{u>t} g_u})^T and Hv = sum_t (s_t e^{...}) v_t^T over each row's last segment, and both cross a piece by
    the same diagonal decay."""
    from kernels.gsa import chunk_gsa

    if piece.cp.links is not None:
        (H, K), M, V = k.shape[2:], s.shape[-1], v.shape[-1]

        def chunk_op(h0, final):
            if h0 is not None:
                h0 = (h0[..., :K * M].unflatten(-1, (K, M)), h0[..., K * M:].unflatten(-1, (M, V)))
            o, states = chunk_gsa(q, k, v, s, g, scale=1.0, initial_state=h0, output_final_state=final,
                                  cu_seqlens=cu_seqlens)
            return o, None if states is None else torch.cat([states[0].flatten(2), states[1].flatten(2)], -1)

        return chained_state(piece, anchor, k, [H, K * M + M * V], chunk_op)
    dt = product_dtype(k)
    g_rows = piece.rows(g.float())
    writes = piece.rows(s.float()) * exclusive_cumsum(g_rows, reverse=True).exp() * last_segment_mask(piece)
    writes = writes.to(dt)
    hk = torch.einsum("bthk,bthm->bhkm", piece.rows(k.to(dt)), writes).float()
    hv = torch.einsum("bthm,bthv->bhmv", writes, piece.rows(v.to(dt))).float()
    hk_in, hv_in = incoming_state(piece, [hk, hv], [row_log_decay_sum(piece, g)],
                                  lambda d, e: [e[0] * d[0][:, :, None, :], d[0][..., None] * e[1]])
    h0 = (first_segment_states(piece, hk_in), first_segment_states(piece, hv_in))
    return chunk_gsa(q, k, v, s, g, scale=1.0, initial_state=h0, cu_seqlens=cu_seqlens)[0], None
