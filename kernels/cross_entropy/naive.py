"""Cross entropy of a chunk of logit rows in plain PyTorch: the CPU path of linear_cross_entropy_sum and the math the
Triton kernel (rows.py) implements, row for row.

    cross_entropy_rows_torch(logits [n, V], labels [n], losses [n] fp32, l2wrap_factor, ignore_index, write_grad)

losses[i] = logsumexp(logits[i]) - logits[i, labels[i]], 0 where labels[i] == ignore_index. With write_grad the
logits are overwritten by d sum(losses) / d logits = softmax - onehot(label), plus l2wrap_factor * m at the row's
first arg-max m (L2Wrap), zero on ignored rows. Everything is computed in fp32, the gradient stored back in the
logits' dtype.
"""

from __future__ import annotations

import torch


def cross_entropy_rows_torch(logits: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor, l2wrap_factor: float,
                             ignore_index: int, write_grad: bool) -> None:
    x = logits.float()   # fp32 whatever the logits' dtype, as the Triton kernel
    keep = labels != ignore_index
    target = labels.where(keep, 0)[:, None]
    log_p = torch.log_softmax(x, dim=-1)
    losses.copy_(torch.where(keep, -log_p.gather(1, target)[:, 0], 0.0))
    if not write_grad:
        return
    grad = log_p.exp_()
    grad.scatter_add_(1, target, grad.new_full(target.shape, -1.0))
    if l2wrap_factor:
        top, where = x.max(dim=-1, keepdim=True)   # the first arg-max on ties
        grad.scatter_add_(1, where, l2wrap_factor * top)
    logits.copy_(grad * keep[:, None])
