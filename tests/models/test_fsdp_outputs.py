"""Blocks under FSDP2: none returns a view. FSDP2 warns at every run when one does ("can cause backward to fail or
produce wrong gradients"), which is noise when nothing writes into it, and hides a real warning when something does."""

from __future__ import annotations

import pytest


FSDP_VIEW_SCRIPT = r"""
import sys, torch, warnings
warnings.filterwarnings("error", "FSDP2-wrapped module", UserWarning)   # (python -W error:...)
from flame import parallel
from flame.config import load_config
from flame.models import build_model

cfg = load_config(f"configs/{sys.argv[1]}.toml", ["--model.num_layers=3"])
d = parallel.init_distributed(cfg.parallelism)
model = build_model(cfg.model)
model.init_weights()
model = parallel.parallelize(model, d, param_dtype="float32", reduce_dtype="float32", activation_checkpoint="none",
                             compile=False)
ids = torch.randint(0, cfg.model.vocab_size, (2, 32))
model(ids, labels=ids, cu_seqlens=torch.tensor([0, 20, 64], dtype=torch.int32)).backward()
print("ok")
"""


@pytest.mark.parametrize("config", ["rwkv7_tiny", "gsa_tiny", "transformer_tiny"])
def test_sharded_blocks_return_no_views(config):
    # FSDP2 warns at every run when a block returns a view ("can cause backward to fail or produce wrong
    # gradients"): RWKV-7's later layers handed their v_first input back out, which FSDP's hooks had made a view.
    from tests.helpers import run_script

    proc = run_script(FSDP_VIEW_SCRIPT, config)   # (a process of its own: it joins a process group of one)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
