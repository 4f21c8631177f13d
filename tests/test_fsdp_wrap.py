"""parallelism.fsdp_wrap: "blocks" makes each block of model.layers an FSDP unit beside the root, "model" the root
alone (one all-gather and one reduce-scatter per step); both hold every parameter as a DTensor shard; "auto" (the
default) is "model" with context parallelism and "blocks" without. Training with either is checked against one process
in tests/test_context_parallel_train.py (cp 2: the chain with the default, the gather with "blocks")."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from flame.config import ParallelismConfig
from flame.parallel import init_distributed, parallelize
from tests.tiny_models import tiny_model

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("wrap", ["blocks", "model"])
def test_fsdp_units(monkeypatch, wrap):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    d = init_distributed(ParallelismConfig())
    try:
        model = tiny_model("rwkv7", vocab_size=64, hidden_size=32, num_layers=2, head_dim=16)
        model = parallelize(model, d, param_dtype="float32", reduce_dtype="float32", activation_checkpoint="none",
                            compile=False, fsdp_wrap=wrap)
        assert isinstance(model, FSDPModule)
        assert [isinstance(b, FSDPModule) for b in model.layers] == [wrap == "blocks"] * 2
        assert all(isinstance(p, DTensor) for p in model.parameters())
    finally:
        dist.destroy_process_group()
        for k in ENV:
            os.environ.pop(k, None)


@pytest.mark.parametrize("wrap, cp, units", [("auto", 1, "blocks"), ("auto", 2, "model"), ("auto", 4, "model"),
                                            ("blocks", 2, "blocks"), ("model", 1, "model")])
def test_auto_is_one_unit_with_context_parallelism(wrap, cp, units):
    assert ParallelismConfig(fsdp_wrap=wrap, context_parallel_degree=cp).fsdp_units() == units
