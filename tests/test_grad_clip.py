"""flame.grad_clip.clip_grad_norm_ (on the local shards) against torchtitan's clip over DTensors, which the trainer ran
before: the same norm and the same clipped gradients, bit for bit, on FSDP's parameters over one rank, two shards,
and two replicas (HSDP). tests/test_loss_normalization.py checks the trainer's logged norm against plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from flame.grad_clip import clip_grad_norm_
from tests.helpers import one_rank, run_script

SCRIPT = """
import sys
import torch
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import clip_grad_norm_ as torchtitan_clip
import flame.grad_clip
from flame.config import ParallelismConfig
from flame.models import build_model, model_args_class
from flame.parallel import init_distributed, parallelize

replicate, max_norm = int(sys.argv[1]), float(sys.argv[2])
d = init_distributed(ParallelismConfig(dp_replicate=replicate))

def sharded_rwkv7():
    args = model_args_class("rwkv7")(name="rwkv7", vocab_size=300, hidden_size=128, num_layers=2)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return parallelize(model, d, param_dtype="float32", reduce_dtype="float32", activation_checkpoint="none",
                       compile=False)

ours, theirs = sharded_rwkv7(), sharded_rwkv7()
# each shard its own gradients; replicas of a shard the same (HSDP reduced them over the replicas)
gen = torch.Generator().manual_seed(1 + d.mesh["dp_shard_cp"].get_local_rank())
for p, q in zip(ours.parameters(), theirs.parameters()):
    g = torch.randn(p.to_local().shape, generator=gen).mul(0.05)
    p.grad = DTensor.from_local(g, p.device_mesh, p.placements)
    q.grad = DTensor.from_local(g.clone(), q.device_mesh, q.placements)
flame.grad_clip.clip_dtensors = None   # FSDP's gradients never take the fallback
norm = flame.grad_clip.clip_grad_norm_(ours.parameters(), max_norm)
expected = torchtitan_clip(list(theirs.parameters()), max_norm)
assert not isinstance(norm, DTensor) and torch.equal(norm, expected), (norm.item(), expected.item())
for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
    assert torch.equal(p.grad.to_local(), q.grad.to_local()), n
print(f"norm {norm.item()!r} placements {p.grad.placements}")
"""


@pytest.mark.parametrize("nproc,replicate", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("max_norm", [0.5, float("inf")])   # clipped; no limit (the gradients multiplied by 1)
def test_clip_on_local_shards_is_torchtitans_bit_for_bit(nproc, replicate, max_norm):
    proc = run_script(SCRIPT, str(replicate), str(max_norm), nproc=nproc, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    norms = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("norm ")]
    assert len(norms) == nproc and len(set(norms)) == 1 and norms[0] > 0.5   # every rank the one global norm
    assert ("Replicate()" in proc.stdout) == (replicate > 1)


def test_plain_gradients_take_torchtitans_clip(monkeypatch):
    """Gradients that are not DTensors (a model outside FSDP) are clipped as before."""
    with one_rank(monkeypatch):
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
        for p in params:
            p.grad = torch.full((3,), 2.0)
        norm = clip_grad_norm_(params, 1.0)
    assert norm.item() == pytest.approx(24 ** 0.5)
    assert sum(p.grad.square().sum() for p in params).sqrt().item() == pytest.approx(1.0, rel=1e-5)
