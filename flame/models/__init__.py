"""Model registry: `model.name` in the config selects a class and its Args dataclass.

Every model follows one contract, so the trainer, FSDP, activation checkpointing and MFU work for all of them:
  - `Model(args)` builds the module (the trainer builds it on the meta device, then calls `init_weights()`);
  - `model.layers`: an nn.ModuleList of blocks (the unit of FSDP sharding, checkpointing and compile);
  - `model(input_ids, labels=None, cu_seqlens=None)`: logits [B, T, V] without labels, else the fp32 *sum* of
    token losses over labels != IGNORE_INDEX (the trainer divides by the global token count);
  - `model.num_params(exclude_embedding=False)` and `model.flops_per_token(seq_len)` (training FLOPs, fwd + bwd).

flame.models.layers.LanguageModel, the models' base class, holds the shared part: the forward tail after the blocks
(final norm, then logits or the loss sum), `num_params` and the matmul parameter count behind `flops_per_token`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from flame.models.args import GSAArgs, RWKV6Args, RWKV7Args, TransformerArgs

if TYPE_CHECKING:
    from torch import nn

ARGS: dict[str, type] = {"transformer": TransformerArgs, "rwkv7": RWKV7Args, "rwkv6": RWKV6Args, "gsa": GSAArgs}
"""model.name -> its Args dataclass: reading a config needs no model module (no torch, no Triton kernels)."""
_MODULES = {name: f"flame.models.{name}" for name in ARGS}
"""Imported on first use, by build_model: only the model a run builds (and its kernels) is imported."""
MODELS: dict[str, type[nn.Module]] = {}


def register(name: str):
    def wrap(model_cls):
        MODELS[name] = model_cls
        return model_cls

    return wrap


def known_models() -> list[str]:
    return sorted(ARGS)


def model_args_class(name: str) -> type | None:
    return ARGS.get(name)


def build_model(args) -> nn.Module:
    if args.name not in ARGS:
        raise KeyError(f"unknown model {args.name!r}; known: {known_models()}")
    if args.name not in MODELS:
        importlib.import_module(_MODULES[args.name])
    return MODELS[args.name](args)
