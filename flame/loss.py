"""Cross entropy as a *sum* over target tokens, computed chunk by chunk so full logits never sit in memory.

The trainer divides the sum by the number of target tokens of the whole global batch (all micro-batches, all ranks);
that division lives in flame/train.py and nowhere else.

L2Wrap (RWKV-LM): the loss value is unchanged, but in backward each target position's largest logit m gets an extra
gradient L2WRAP_FACTOR * m times the upstream gradient; under the trainer's 1 / N that is 1e-4 * m / N, RWKV-LM's
factor for a mean over N tokens. It keeps logits from drifting upward, where bf16 loses their differences.
"""

from __future__ import annotations

import torch

from kernels.cross_entropy import linear_cross_entropy_sum

IGNORE_INDEX = -100
L2WRAP_FACTOR = 1e-4


def output_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_size: int = 4096, l2wrap: bool = False) -> torch.Tensor:
    """sum_t CE(hidden_t @ weight^T, labels_t) over labels != IGNORE_INDEX, in fp32; l2wrap adds L2Wrap's gradient
    (module docstring; the arg-max is the first one on ties, as RWKV-LM's max) without changing the value.

    hidden [..., D], weight [V, D], labels [...]. Logits exist one chunk of chunk_size rows at a time, in the
    matmul's dtype: kernels/cross_entropy computes each chunk's gradients already in forward (when a gradient is
    wanted), so nothing is recomputed in backward and no fp32 copy of the logits is made.
    """
    return linear_cross_entropy_sum(hidden, weight, labels, chunk_size, L2WRAP_FACTOR if l2wrap else 0.0,
                                    IGNORE_INDEX)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
