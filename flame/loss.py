"""Cross entropy as a *sum* over target tokens, computed chunk by chunk so full logits never sit in memory.

The trainer divides the sum by the number of target tokens of the whole global batch (all micro-batches, all ranks);
that division lives in flame/train.py and nowhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # fp32 log-softmax: bf16 logits lose the loss' low bits
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def output_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_size: int = 4096) -> torch.Tensor:
    """sum_t CE(hidden_t @ weight^T, labels_t) over labels != IGNORE_INDEX, in fp32.

    hidden [..., D], weight [V, D], labels [...]. Each chunk's logits are recomputed in backward (checkpoint),
    so memory holds one chunk of logits instead of all of them.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss_sum, h, weight, y, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, weight, y)
    return total


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
