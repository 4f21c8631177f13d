"""Tiny random flame models for the tests: built from their ModelArgs and initialized as training does, and the RWKV
branches that start at zero given small random weights so that every branch shows in the outputs."""

from __future__ import annotations

import torch

from flame.models import build_model, model_args_class


def tiny_model(name: str, seed: int = 0, **fields):
    """A `name` model of ModelArgs(name=name, **fields), checked, and initialized under torch.manual_seed(seed)."""
    args = model_args_class(name)(name=name, **fields)
    args.validate()
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    return model


def wake_branches(model, std: float):
    """Normal(0, std) for the weights RWKV's init sets to zero: each block's output projection and channel-mix value,
    and RWKV-6's channel-mix gate and low-rank mix and decay paths (so a test sees every branch)."""
    for block in model.layers:
        weights = [block.attn.o_proj.weight, block.ffn.value.weight]
        if model.args.name == "rwkv6":
            weights += [block.ffn.receptance.weight, block.attn.maa_w1, block.attn.decay_w1]
        for w in weights:
            w.data.normal_(std=std)
    return model
