"""Cross entropy as a *sum* over target tokens, computed chunk by chunk so full logits never sit in memory.

The trainer divides the sum by the number of target tokens of the whole global batch (all micro-batches, all ranks);
that division lives in flame/train.py and nowhere else.

L2Wrap (RWKV-LM): the loss value is unchanged, but in backward each target position's largest logit m gets an extra
gradient L2WRAP_FACTOR * m times the upstream gradient; under the trainer's 1 / N that is 1e-4 * m / N, RWKV-LM's
factor for a mean over N tokens. It keeps logits from drifting upward, where bf16 loses their differences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
L2WRAP_FACTOR = 1e-4


def max_logit_pull(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Exactly zero, with gradient L2WRAP_FACTOR * m_t at the largest logit m_t of every position with a label.

    d/dm (f m^2 / 2) = f m, and max() routes that gradient to the arg-max (the first one on ties, as RWKV-LM);
    subtracting the same value detached makes the forward value 0 while keeping that gradient.
    """
    top = logits.max(dim=-1).values.masked_fill(labels == IGNORE_INDEX, 0.0)
    pull = 0.5 * L2WRAP_FACTOR * top.square().sum()
    return pull - pull.detach()


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, l2wrap: bool) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # fp32 log-softmax: bf16 logits lose the loss' low bits
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss + max_logit_pull(logits, labels) if l2wrap else loss


def output_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_size: int = 4096, l2wrap: bool = False) -> torch.Tensor:
    """sum_t CE(hidden_t @ weight^T, labels_t) over labels != IGNORE_INDEX, in fp32; l2wrap adds L2Wrap's gradient
    (module docstring) without changing the value.

    hidden [..., D], weight [V, D], labels [...]. Each chunk's logits are recomputed in backward (checkpoint),
    so memory holds one chunk of logits instead of all of them.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss_sum, h, weight, y, l2wrap, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, weight, y, False)  # no backward: the pull would add only a zero
    return total


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
