"""Gradient clipping by the global norm on the gradients' local shards.

torchtitan's clip_grad_norm_ (torch.nn.utils' norm over DTensors) dispatches a foreach norm and a foreach multiply of
every gradient through DTensor: for RWKV-7 0.6B's 675 parameters that is host time at the end of the step, while the
GPU has nothing queued. Here the same ops run on the local tensors, and each parameter's norm is reduced as DTensor
reduces a norm partial before the norms are stacked (per sharded mesh dimension: squared, summed over the ranks in
one all-reduce of all of them, square-rooted), so the norm and the clipped gradients are torchtitan's bit for bit
(tests/test_grad_clip.py: one rank, two shards, two replicas).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import clip_grad_norm_ as clip_dtensors

from flame.parallel import local_tensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Scale the gradients so their global 2-norm is at most max_norm; returns that norm before clipping (a plain
    tensor on the gradients' device). Gradients that are not all DTensors of one mesh (FSDP gives each module an
    equal mesh object of its own), placements and dtype take torchtitan's clip."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    first = grads[0] if grads else None
    mesh = first.device_mesh if isinstance(first, DTensor) else None
    if mesh is None or any(not isinstance(g, DTensor) or not (g.device_mesh is mesh or g.device_mesh == mesh)
                           or g.placements != first.placements or g.dtype != first.dtype for g in grads):
        return clip_dtensors(parameters, max_norm)
    local = [local_tensor(g) for g in grads]
    norms = torch.stack(torch._foreach_norm(local, 2.0))
    for dim, placement in enumerate(first.placements):
        if placement.is_shard():
            norms = norms ** 2.0
            dist.all_reduce(norms, group=mesh.get_group(dim))
            norms = norms ** 0.5
    total = torch.linalg.vector_norm(norms, 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(local, coef)
    return total
