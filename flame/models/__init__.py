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

from torch import nn

MODELS: dict[str, tuple[type[nn.Module], type]] = {}
# Imported on first use, so reading a config never imports every model (and its Triton kernels).
_MODULES = {
    "transformer": "flame.models.transformer",
    "rwkv7": "flame.models.rwkv7",
    "rwkv6": "flame.models.rwkv6",
    "gsa": "flame.models.gsa",
}


def register(name: str, args_cls: type):
    def wrap(model_cls):
        MODELS[name] = (model_cls, args_cls)
        return model_cls

    return wrap


def _lookup(name: str):
    if name not in MODELS and name in _MODULES:
        importlib.import_module(_MODULES[name])
    return MODELS.get(name)


def known_models() -> list[str]:
    return sorted(set(MODELS) | set(_MODULES))


def model_args_class(name: str) -> type | None:
    entry = _lookup(name)
    return entry[1] if entry else None


def build_model(args) -> nn.Module:
    entry = _lookup(args.name)
    if entry is None:
        raise KeyError(f"unknown model {args.name!r}; known: {known_models()}")
    return entry[0](args)
