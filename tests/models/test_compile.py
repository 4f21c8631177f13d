"""torch.compile of each block, as training.compile does it: a model compiles a bounded number of variants of its
block, whatever its depth. An int attribute read in forward (a layer index) is a constant to Dynamo: it recompiled the
block once per layer, and past the recompile limit (8) the deeper layers silently ran eager."""

from __future__ import annotations

import pytest
import torch

from flame.config import load_config
from flame.models import build_model


@pytest.mark.parametrize("config", ["transformer_tiny", "rwkv7_tiny", "gsa_tiny"])
def test_blocks_compile_once_whatever_the_depth(config):
    import torch._dynamo as dynamo

    cfg = load_config(f"configs/{config}.toml", ["--model.num_layers=10"])
    model = build_model(cfg.model)
    model.init_weights()
    ids = torch.randint(0, cfg.model.vocab_size, (1, 32))
    eager_loss = model(ids, labels=ids)
    dynamo.reset()
    dynamo.utils.counters.clear()
    for block in model.layers:
        block.compile(backend="eager")   # Dynamo's graph capture and guards only: no code generation needed
    loss = model(ids, labels=ids)
    loss.backward()
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    # RWKV-7's first layer differs (it supplies v_first): two variants; the others one
    assert 1 <= graphs <= 2, f"{config}: {graphs} compiled graphs for {len(model.layers)} blocks"
    torch.testing.assert_close(loss, eager_loss)
