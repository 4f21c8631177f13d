"""parallelism.fsdp_wrap: "blocks" makes each block of model.layers an FSDP unit beside the root, "model" the root
alone (one all-gather and one reduce-scatter per step); both hold every parameter as a DTensor shard; "auto" (the
default) is "model" with context parallelism and "blocks" without. Training with either is checked against one process
in tests/test_context_parallel_train.py (cp 2: the chain with the default, the gather with "blocks")."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from flame.config import ParallelismConfig
from flame.parallel import parallelize
from tests.helpers import one_rank
from tests.tiny_models import tiny_model


@pytest.mark.parametrize("wrap", ["blocks", "model"])
def test_fsdp_units(monkeypatch, wrap):
    with one_rank(monkeypatch) as d:
        model = tiny_model("rwkv7", vocab_size=64, hidden_size=32, num_layers=2, head_dim=16)
        model = parallelize(model, d, param_dtype="float32", reduce_dtype="float32", activation_checkpoint="none",
                            compile=False, fsdp_wrap=wrap)
        assert isinstance(model, FSDPModule)
        assert [isinstance(b, FSDPModule) for b in model.layers] == [wrap == "blocks"] * 2
        assert all(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("wrap, cp, units", [("auto", 1, "blocks"), ("auto", 2, "model"), ("auto", 4, "model"),
                                            ("blocks", 2, "blocks"), ("model", 1, "model")])
def test_auto_is_one_unit_with_context_parallelism(wrap, cp, units):
    assert ParallelismConfig(fsdp_wrap=wrap, context_parallel_degree=cp).fsdp_units() == units
