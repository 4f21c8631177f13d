"""Triton cross entropy over logit rows, one program per row (the math of naive.cross_entropy_rows_torch).

_cross_entropy_rows reads the label's logit, then walks its row in tiles of BV columns, all in fp32: the online max
and sum of exp (the logsumexp) and, for L2WRAP, the first arg-max (a tile's arg-max replaces the running one only
when strictly larger, so the earliest maximum wins on ties); it stores the row's loss lse - logit[label] (0 for an
ignored row). With WRITE_GRAD a second walk overwrites the row in place with softmax - onehot(label), plus
l2wrap_factor * max at the arg-max (L2WRAP), zero for an ignored row, in the logits' dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cross_entropy_rows(logits, labels, losses, V, l2wrap_factor, ignore_index, BV: tl.constexpr,
                        L2WRAP: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * V
    label = tl.load(labels + row).to(tl.int32)
    keep = label != ignore_index
    # a label outside [0, V) reads nothing (its loss is then lse, not a fault)
    target = tl.load(base + label, mask=keep & (label >= 0) & (label < V), other=0.).to(tl.float32)
    cols = tl.arange(0, BV)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    where = tl.zeros([], dtype=tl.int32)
    for start in range(0, V, BV):
        c = start + cols
        x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        if L2WRAP:
            tile_top, tile_where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            where = tl.where(tile_top > top, start + tile_where, where)
        else:
            tile_top = tl.max(x, axis=0)
        new_top = tl.maximum(top, tile_top)
        # every tile holds at least one real column, so new_top is finite and no exp sees inf - inf
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    # exp((x - max) - log(sum)) and log(sum) + (max - x): exact near the max, where x - lse would round at lse's scale
    log_sum = tl.log(total)
    tl.store(losses + row, tl.where(keep, log_sum + (top - target), 0.))
    if WRITE_GRAD:
        for start in range(0, V, BV):
            c = start + cols
            x = tl.load(base + c, mask=c < V, other=0.).to(tl.float32)
            grad = tl.exp((x - top) - log_sum) - tl.where(c == label, 1., 0.)
            if L2WRAP:
                grad += tl.where(c == where, l2wrap_factor * top, 0.)
            grad = tl.where(keep, grad, 0.)
            tl.store(base + c, grad.to(logits.dtype.element_ty), mask=c < V)
