"""AdamW over parameter groups, and the LR schedule (torchtitan's warmup + linear/cosine/sqrt decay, WSD).

A model may declare its own groups with a method `optimizer_groups(self) -> list[ParamGroup]` (RWKV-7 does:
RWKV-LM's lr and weight-decay groups); a model without one gets `default_groups`: decay on matrices only, not on
embeddings unless optimizer.decay_embeddings. Groups name parameters as the unwrapped model does: the trainer builds
the optimizer on the parallelized model, whose names may carry wrapper parts (activation checkpointing's
`_checkpoint_wrapped_module`, torch.compile's `_orig_mod`), and `clean_name` removes them.

A group's lr_scale multiplies optimizer.lr into the group's own lr; torchtitan's LambdaLR scales each group's initial
lr, so the ratio holds at every step, and a resume restores it with the optimizer's param_groups.

The fused update runs on the parameters' local shards (`AdamW`): FSDP's parameters are DTensors, and DTensor's
dispatch of the fused kernel's tensor lists (RWKV-7 0.6B: 675 parameters, four lists) costs the host more than the
kernel costs the GPU, at the end of the step, when the GPU has nothing else queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flame.config import LRSchedulerConfig, OptimizerConfig
from flame.parallel import local_tensor

WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


@dataclass
class ParamGroup:
    """Parameters that share one optimizer setting."""

    name: str
    params: list[str]
    """Parameter names as the unwrapped model's named_parameters() gives them."""
    weight_decay: bool
    """Take optimizer.weight_decay (else none)."""
    lr_scale: float = 1.0
    """This group's learning rate = the scheduled learning rate * lr_scale."""


def clean_name(name: str) -> str:
    """The parameter's name in the unwrapped model: wrapper modules' parts removed."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Clean name -> parameter, for every parameter that requires a gradient."""
    return {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def default_groups(model: nn.Module, decay_embeddings: bool) -> list[ParamGroup]:
    """Decay matrices only (two or more dimensions above 1): not norms, biases, per-channel vectors, nor (unless
    decay_embeddings) embedding tables."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, p in trainable_parameters(model).items():
        matrix = sum(s > 1 for s in p.shape) >= 2
        (decay if matrix and (decay_embeddings or id(p) not in embeddings) else no_decay).append(name)
    return [ParamGroup("decay", decay, weight_decay=True), ParamGroup("no_decay", no_decay, weight_decay=False)]


def model_groups(model: nn.Module, cfg: OptimizerConfig) -> list[tuple[ParamGroup, list[nn.Parameter]]]:
    """The model's groups (or the default ones) with their parameters; every trainable parameter is in exactly one.

    Empty groups are dropped (a distributed optimizer state dict cannot hold a group without parameters). A group of
    lr_scale 1 comes first: the trainer logs the first group's lr as the run's learning rate.
    """
    params = trainable_parameters(model)
    declare = getattr(model, "optimizer_groups", None)
    groups = declare() if declare is not None else default_groups(model, cfg.decay_embeddings)
    owner: dict[str, str] = {}
    for group in groups:
        unknown = [n for n in group.params if n not in params]
        if unknown:
            raise ValueError(f"optimizer group {group.name!r} names parameters the model does not train: {unknown[:5]}")
        for n in group.params:
            if n in owner:
                raise ValueError(f"parameter {n} is in optimizer groups {owner[n]!r} and {group.name!r}")
            owner[n] = group.name
    missing = [n for n in params if n not in owner]
    if missing:
        raise ValueError(f"parameters in no optimizer group ({len(missing)}): {missing[:5]}")
    kept = sorted((g for g in groups if g.params), key=lambda g: g.lr_scale != 1.0)
    return [(g, [params[n] for n in g.params]) for g in kept]


class AdamW(torch.optim.AdamW):
    """torch's AdamW whose fused step hands the kernel the local tensors of DTensor parameters, gradients and moments.
    The update is elementwise, so each shard's update is the whole one's: the same state (the moments as DTensors,
    as checkpoints hold them), the same kernel and arithmetic as torch's fused step (tests/test_optim.py, bit for bit).
    The lists of local tensors are made once (the moments then exist) and again after a load_state_dict; a step
    unwraps only the new gradients. Options the plain fused path does not cover (amsgrad, maximize, capturable,
    differentiable, a closure, a parameter without a gradient, tensors of several devices or dtypes in a group) take
    torch's step."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.local_lists = None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.local_lists = None   # new moment tensors

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not all(g["fused"] and not (g["amsgrad"] or g["maximize"] or g["capturable"]
                                                             or g["differentiable"]) for g in self.param_groups):
            return super().step(closure)
        self.local_lists = self.local_lists or self.make_local_lists()
        if self.local_lists is None or any(p.grad is None for _, params, *_ in self.local_lists for p in params):
            self.local_lists = None
            return super().step()
        found_inf = getattr(self, "found_inf", None)   # set by the trainer: 1.0 skips the update on the device
        for group, dparams, params, exp_avgs, exp_avg_sqs, steps in self.local_lists:
            beta1, beta2 = group["betas"]
            if found_inf is not None:   # the kernel reads it where the parameters are (torch's step moves it too)
                found_inf = found_inf.to(params[0].device, non_blocking=True)
            grads = [local_tensor(p.grad) for p in dparams]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                maximize=False, grad_scale=None, found_inf=found_inf)
            if found_inf is not None:   # a skipped update leaves the step count as it was, as torch's does
                torch._foreach_sub_(steps, [found_inf] * len(steps))

    def make_local_lists(self) -> list | None:
        """Per group with parameters: (group, parameters, their local tensors, exp_avg's, exp_avg_sq's, step
        counts), the state made as torch makes it; None where a parameter has no gradient or the tensors mix devices
        or dtypes."""
        lists = []
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
            if len(params) != len(group["params"]):
                return None
            tensors = [[local_tensor(t) for t in ts] for ts in (params, exp_avgs, exp_avg_sqs)]
            if len({(t.device, t.dtype) for t in [*(local_tensor(g) for g in grads), *sum(tensors, [])]}) > 1:
                return None
            if params:
                lists.append((group, params, *tensors, steps))
        return lists


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> AdamW:
    groups = [{"params": tensors, "name": g.name, "lr": cfg.lr * g.lr_scale, "lr_scale": g.lr_scale,
               "weight_decay": cfg.weight_decay if g.weight_decay else 0.0}
              for g, tensors in model_groups(model, cfg)]
    fused = True if cfg.fused is None else cfg.fused
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused,
                 foreach=None if fused else True)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, steps: int):
    """torchtitan's LRSchedulersContainer: one LambdaLR that scales every group's initial lr by the same factor."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # imported when training

    # a run shorter than its warmup warms up over all of its steps (torchtitan would cap too, with a warning)
    schedule = LRSchedulersContainer.Config(warmup_steps=min(cfg.warmup_steps, steps), decay_type=cfg.decay_type,
                                            decay_ratio=cfg.decay_ratio, min_lr_factor=cfg.min_lr_factor)
    return schedule.build(optimizers=[optimizer], training_steps=steps)


def restore_lr_schedule(scheduler, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Continue the schedule at `step` with this run's settings (lr, warmup, decay, steps), after a checkpoint's
    optimizer state was loaded: the optimizer's param_groups come back with the saved run's lr, and torchtitan's own
    load_state_dict recomputes the lr through LambdaLR.get_lr(), which warns when called outside step()."""
    for sched in scheduler.schedulers:
        sched.last_epoch, sched._step_count = step, step + 1
        lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, base, lr in zip(sched.optimizer.param_groups, sched.base_lrs, lrs):
            group["initial_lr"], group["lr"] = base, lr
        sched._last_lr = lrs
