"""Optimizer groups: RWKV-7 gets RWKV-LM's (checked against RWKV-LM's rule on RWKV-LM's names), on the wrapped
model the trainer builds too; w0's 2x learning rate holds under the schedule and across a resume; models without
their own groups (Transformer, GSA) keep the default rule; the fused step on FSDP's shards is torch's, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from flame.config import LRSchedulerConfig, OptimizerConfig
from flame.models import build_model, model_args_class
from flame.optim import AdamW, ParamGroup, build_lr_scheduler, build_optimizer, clean_name
from flame.parallel import local_tensor
from tests.helpers import one_rank

OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1)


def tiny_rwkv7(layers=3, seed=0):
    args = model_args_class("rwkv7")(name="rwkv7", vocab_size=300, hidden_size=128, num_layers=layers)
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    return model


def rwkv_lm_names(name: str, p: torch.Tensor) -> list[tuple[str, tuple[int, ...]]]:
    """Our parameter -> the RWKV-LM parameter(s) it is, with RWKV-LM's shapes."""
    C = p.shape[-1]
    top = {"embed.weight": "emb.weight", "embed_norm.weight": "blocks.0.ln0.weight",
           "embed_norm.bias": "blocks.0.ln0.bias", "norm.weight": "ln_out.weight", "norm.bias": "ln_out.bias",
           "lm_head.weight": "head.weight"}
    if name in top:
        return [(top[name], tuple(p.shape))]
    _, i, rest = name.split(".", 2)
    renamed = {"attn_norm": "ln1", "ffn_norm": "ln2", "attn.r_proj": "att.receptance", "attn.k_proj": "att.key",
               "attn.v_proj": "att.value", "attn.o_proj": "att.output", "attn.ln_x": "att.ln_x"}
    for ours, theirs in renamed.items():
        if rest.startswith(ours + "."):
            return [(f"blocks.{i}.{theirs}{rest[len(ours):]}", tuple(p.shape))]
    if rest == "attn.lerp":
        return [(f"blocks.{i}.att.x_{c}", (1, 1, C)) for c in "rwkvag"]
    if rest.startswith("ffn."):
        return [(f"blocks.{i}.{rest}", (1, 1, C) if rest == "ffn.x_k" else tuple(p.shape))]
    field = rest.removeprefix("attn.")
    if field in ("w0", "a0", "v0", "k_k", "k_a"):
        return [(f"blocks.{i}.att.{field}", (1, 1, C))]
    assert field in ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2", "r_k"), name
    return [(f"blocks.{i}.att.{field}", tuple(p.shape))]


def rwkv_lm_group(name: str, shape: tuple[int, ...], weight_decay: float) -> str:
    """RWKV-LM's configure_optimizers, on its own names."""
    if "att.w0" in name:
        return "2x"
    if len(torch.empty(shape).squeeze().shape) >= 2 and weight_decay > 0 and ".weight" in name:
        return "decay"
    return "1x"


def group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def test_rwkv7_groups_are_rwkv_lm_groups():
    model = tiny_rwkv7()
    opt = build_optimizer(model, OPT)
    groups = group_of(opt)
    seen = {"2x": 0, "decay": 0, "1x": 0}
    for name, p in model.named_parameters():
        expected = {rwkv_lm_group(n, s, OPT.weight_decay) for n, s in rwkv_lm_names(name, p)}
        assert len(expected) == 1, (name, expected)
        expected = expected.pop()
        seen[expected] += 1
        g = groups[id(p)]
        lr, wd = {"2x": (2 * OPT.lr, 0.0), "decay": (OPT.lr, OPT.weight_decay), "1x": (OPT.lr, 0.0)}[expected]
        assert (g["lr"], g["weight_decay"]) == (lr, wd), (name, expected, g["name"])
    assert seen["2x"] == 3 and seen["decay"] == 2 + 6 * 3 and seen["1x"] > 0   # w0 per layer; emb, head, 6 per layer
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert opt.param_groups[0]["lr_scale"] == 1.0   # the trainer logs group 0's lr


def test_groups_by_clean_names_on_the_parallelized_model(monkeypatch):
    """FSDP2 (DTensor parameters) around activation-checkpoint wrappers, and a torch.compile wrapper: the same
    groups as on the plain model."""
    from flame.parallel import parallelize

    def names(model, opt):
        return {g["name"]: sorted(clean_name(n) for n, p in model.named_parameters()
                                  if id(p) in {id(q) for q in g["params"]}) for g in opt.param_groups}

    plain = tiny_rwkv7(layers=2)
    plain_opt = build_optimizer(plain, OPT)
    expected = {g["name"]: g["lr"] for g in plain_opt.param_groups}
    expected_names = names(plain, plain_opt)
    assert all(expected_names.values())

    compiled = torch.compile(tiny_rwkv7(layers=2))
    assert any("_orig_mod" in n for n, _ in compiled.named_parameters())
    opt = build_optimizer(compiled, OPT)
    assert names(compiled, opt) == expected_names

    with one_rank(monkeypatch) as d:
        model = parallelize(tiny_rwkv7(layers=2), d, param_dtype="float32", reduce_dtype="float32",
                            activation_checkpoint="full", compile=False)
        assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
        assert all(isinstance(p, DTensor) for p in model.parameters())
        opt = build_optimizer(model, OPT)
        assert {g["name"]: g["lr"] for g in opt.param_groups} == expected
        assert names(model, opt) == expected_names


def test_fused_step_on_local_shards_is_torchs_bit_for_bit(monkeypatch):
    """FSDP's DTensor parameters: our AdamW's step (the fused kernel on the local tensors) leaves parameters, moments
    and step counts exactly as torch's AdamW does over four steps in RWKV-7's three groups (two lrs, decay and
    none), one of them skipped through found_inf; the kernel sees plain tensors, never a DTensor."""
    from flame.parallel import parallelize

    seen = []
    fused = torch._fused_adamw_

    def spy(params, *args, **kwargs):
        seen.append({type(p) for p in params})
        return fused(params, *args, **kwargs)

    with one_rank(monkeypatch) as d:
        models = [parallelize(tiny_rwkv7(layers=2), d, param_dtype="float32", reduce_dtype="float32",
                              activation_checkpoint="none", compile=False) for _ in range(2)]
        ours = build_optimizer(models[0], OPT)
        theirs = torch.optim.AdamW([dict(g, params=[dict(models[1].named_parameters())[n]
                                                    for n, p in models[0].named_parameters()
                                                    if any(p is q for q in g["params"])])
                                    for g in ours.param_groups], fused=True)
        assert type(ours) is AdamW and len({(g["lr"], g["weight_decay"]) for g in ours.param_groups}) == 3
        for step, skip in enumerate([0.0, 0.0, 1.0, 0.0]):
            gen = torch.Generator().manual_seed(step)
            for p, q in zip(models[0].parameters(), models[1].parameters()):
                g = torch.randn(p.to_local().shape, generator=gen).mul(1e-2)
                p.grad = DTensor.from_local(g, p.device_mesh, p.placements)
                q.grad = DTensor.from_local(g.clone(), q.device_mesh, q.placements)
            for opt in (ours, theirs):
                opt.found_inf = torch.tensor(skip)
                with monkeypatch.context() as m:
                    m.setattr(torch, "_fused_adamw_", spy if opt is ours else fused)
                    opt.step()
        assert len(seen) == 4 * 3 and all(types == {torch.Tensor} for types in seen), seen
        for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p.to_local(), q.to_local()), n
            for key in ("exp_avg", "exp_avg_sq", "step"):
                a, b = ours.state[p][key], theirs.state[q][key]
                assert torch.equal(local_tensor(a), local_tensor(b)), (n, key)
            assert ours.state[p]["step"].item() == 3


def test_w0_lr_is_twice_the_schedule_at_every_step_and_after_resume(tmp_path):
    schedule, steps = LRSchedulerConfig(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1), 10
    reference = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=OPT.lr)
    reference_scheduler = build_lr_scheduler(reference, schedule, steps)
    scheduled = []
    for _ in range(steps):
        scheduled.append(reference.param_groups[0]["lr"])
        reference.step()
        reference_scheduler.step()
    assert len(set(scheduled)) == steps - 1   # warmup and decay: the lr moves at every step but one (the peak)

    def make():
        model = tiny_rwkv7(layers=2)
        opt = build_optimizer(model, OPT)
        return model, opt, build_lr_scheduler(opt, schedule, steps)

    def train(model, opt, scheduler, first, last, seen):
        for step in range(first, last):
            seen.append({g["name"]: g["lr"] for g in opt.param_groups})
            gen = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            opt.step()
            scheduler.step()

    model, opt, scheduler = make()
    straight = []
    train(model, opt, scheduler, 0, steps, straight)
    straight_params = dict(model.named_parameters())
    for lrs, lr in zip(straight, scheduled):
        assert lrs == pytest.approx({"decay": lr, "lr_1x": lr, "lr_2x": 2 * lr}, rel=1e-12)

    model, opt, scheduler = make()
    resumed = []
    train(model, opt, scheduler, 0, 4, resumed)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd, "lr_scheduler": scheduler.state_dict()},
             checkpoint_id=str(tmp_path))
    model, opt, scheduler = make()   # fresh, as a relaunch builds it
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])
    train(model, opt, scheduler, 4, steps, resumed)
    assert resumed == straight
    for n, p in model.named_parameters():   # Adam's moments came back to the right parameters and groups
        assert torch.equal(p, straight_params[n]), n


def default_rule(model: nn.Module, decay_embeddings: bool) -> dict[str, bool]:
    """Weight decay on matrices, never on an nn.Embedding's table unless asked."""
    tables = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, nn.Embedding)}
    return {n: sum(s > 1 for s in p.shape) >= 2 and (decay_embeddings or n not in tables)
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,extra", [
    ("transformer", dict(hidden_size=64, num_layers=2, num_heads=4)),
    ("gsa", dict(hidden_size=64, num_layers=2, num_heads=2, num_slots=16)),
])
@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_models_without_their_own_groups_keep_the_default_rule(name, extra, decay_embeddings):
    model = build_model(model_args_class(name)(name=name, vocab_size=128, **extra))
    assert not hasattr(model, "optimizer_groups")
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, decay_embeddings=decay_embeddings)
    groups = group_of(build_optimizer(model, cfg))
    rule = default_rule(model, decay_embeddings)
    assert rule["embed.weight"] == decay_embeddings and any(rule.values()) and not all(rule.values())
    for n, p in model.named_parameters():
        assert groups[id(p)]["weight_decay"] == (0.1 if rule[n] else 0.0), n
        assert groups[id(p)]["lr"] == 1e-3, n


class Declares(nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.groups = groups

    def optimizer_groups(self):
        return self.groups


@pytest.mark.parametrize("groups,message", [
    ([ParamGroup("g", ["a.weight", "a.bias", "b.weight"], True)], "in no optimizer group (1): ['b.bias']"),
    ([ParamGroup("g", ["a.weight", "a.bias", "b.weight", "b.bias"], True), ParamGroup("h", ["a.bias"], False)],
     "parameter a.bias is in optimizer groups 'g' and 'h'"),
    ([ParamGroup("g", ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"], True)],
     "optimizer group 'g' names parameters the model does not train: ['c.weight']"),
])
def test_a_parameter_in_no_group_or_two_is_an_error(groups, message):
    with pytest.raises(ValueError) as e:
        build_optimizer(Declares(groups), OPT)
    assert message in str(e.value)
