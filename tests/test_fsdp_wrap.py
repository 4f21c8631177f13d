"""parallelism.fsdp_wrap: "blocks" makes each block of model.layers an FSDP unit beside the root, "model" the root
alone (one all-gather and one reduce-scatter per step); both hold every parameter as a DTensor shard. Training with
"model" is checked against one process in tests/test_context_parallel_train.py (the chain at cp 2)."""

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
