"""flame.parallel.keep_gathered_parameters: over one shard the gathered (compute-dtype) parameters stay from step to
step and are brought up to date after each optimizer step, instead of FSDP casting and copying each parameter in
every pre-forward. Against FSDP's own path, bit for bit: the losses of every micro-batch and the weights after steps
with gradient accumulation, an evaluation forward between steps, a skipped update (found_inf), and a resume into a
fresh model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from flame.config import OptimizerConfig
from flame.models import build_model, model_args_class
from flame.optim import build_optimizer
from flame.parallel import keep_gathered_parameters
from tests.helpers import one_rank


@pytest.fixture
def rank(monkeypatch):
    with one_rank(monkeypatch) as d:
        yield d


def sharded_rwkv7(d, param_dtype):
    """RWKV-7 wrapped as flame.parallel.parallelize wraps it over one shard, in a chosen compute dtype (parallelize
    takes fp32 on the CPU; bf16, as on a GPU, makes the kept copies casts)."""
    args = model_args_class("rwkv7")(name="rwkv7", vocab_size=300, hidden_size=128, num_layers=3)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=d.fsdp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=d.fsdp_mesh, mp_policy=mp)
    return model


def train(model, optimizer, steps, first=0):
    """Steps of two micro-batches (gradients reduced on the last), an evaluation forward after each; the second step's
    update skipped through found_inf. Returns every loss seen."""
    losses = []
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        batches = [torch.randint(0, 300, (2, 32), generator=gen) for _ in range(2)]
        for i, ids in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = model(ids, labels=ids)
            loss.backward()
            losses.append(loss.detach())
        optimizer.found_inf = torch.tensor(1.0 if step == 1 else 0.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            losses.append(model(batches[0], labels=batches[0]))
    return losses


def weights(model) -> dict:
    """The fp32 shards (the state dict's: outside a step the modules may hold the gathered copies)."""
    return {n: p.to_local().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_kept_parameters_train_as_fsdps_own_path(rank, param_dtype):
    results = []
    for keep in (False, True):
        model = sharded_rwkv7(rank, param_dtype)
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
        assert keep_gathered_parameters(model, rank, optimizer) if keep else True
        losses = train(model, optimizer, 4)
        if keep:   # the gathered copies outlived the step: the next pre-forward has nothing to cast or copy
            states = {p.sharded_state.name for m in model.modules() if hasattr(m, "_get_fsdp_state")
                      for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None for p in g.fsdp_params}
            assert states == {"UNSHARDED"}
        results.append((losses, weights(model)))   # (a state dict reshards: the next forward gathers again)
    (plain_losses, plain_weights), (kept_losses, kept_weights) = results
    assert len(plain_losses) == 12 and all(torch.equal(a, b) for a, b in zip(plain_losses, kept_losses))
    assert plain_weights.keys() == kept_weights.keys()
    for name, w in plain_weights.items():
        assert torch.equal(w, kept_weights[name]), name
    assert not torch.equal(plain_losses[-1], plain_losses[2])   # the weights did move


def test_resume_into_a_fresh_model_keeps_training_the_same(rank, tmp_path):
    """A checkpoint of a kept run holds the fp32 shards; loaded into a fresh model before its first forward, the run
    goes on as the uninterrupted one."""
    def make():
        model = sharded_rwkv7(rank, torch.bfloat16)
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
        assert keep_gathered_parameters(model, rank, optimizer)
        return model, optimizer

    model, optimizer = make()
    straight = train(model, optimizer, 4)
    straight_weights = weights(model)

    model, optimizer = make()
    resumed = train(model, optimizer, 2)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    assert all(v.dtype == torch.float32 for v in model_sd.values())   # the shards, not the bf16 copies
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path))
    model, optimizer = make()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    resumed += train(model, optimizer, 2, first=2)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for name, w in weights(model).items():
        assert torch.equal(w, straight_weights[name]), name
