"""AdamW with parameter groups, and the LR schedule (torchtitan's warmup + linear/cosine/sqrt decay, WSD)."""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from flame.config import LRSchedulerConfig, OptimizerConfig


def decays(model: nn.Module, name: str, p: torch.Tensor, decay_embeddings: bool) -> bool:
    """Weight decay for matrices only: not norms, biases, per-channel vectors, nor (by default) embeddings."""
    if sum(s > 1 for s in p.shape) < 2:
        return False
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return decay_embeddings or not isinstance(owner, nn.Embedding)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, on_gpu: bool) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(model, name, p, cfg.decay_embeddings) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = on_gpu if cfg.fused is None else cfg.fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused,
                             foreach=None if fused else True)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, steps: int) -> LRSchedulersContainer:
    schedule = LRSchedulersContainer.Config(warmup_steps=cfg.warmup_steps, decay_type=cfg.decay_type,
                                            decay_ratio=cfg.decay_ratio, min_lr_factor=cfg.min_lr_factor)
    return schedule.build(optimizers=[optimizer], training_steps=steps)
