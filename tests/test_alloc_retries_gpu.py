"""The metrics row counts the CUDA allocator's retries (each one waits for the GPU) and warns once when there are any."""

import json

import pytest
import torch

from flame.config import load_config
from flame.metrics import MetricsLogger

pytestmark = pytest.mark.gpu


def fill_then_ask_for_more(device):
    """Cache blocks up to a small memory cap, free them (still cached), then ask for one block larger than any cached
    one: the allocator must release its cache and try again."""
    free = torch.cuda.mem_get_info(device)[0]
    cap = torch.cuda.memory_allocated(device) + (1 << 30)
    torch.cuda.set_per_process_memory_fraction(min(cap / torch.cuda.get_device_properties(device).total_memory, 1.0),
                                               device)
    assert free > (1 << 30)
    try:
        blocks = [torch.empty(96 << 20, dtype=torch.uint8, device=device) for _ in range(8)]
        del blocks
        big = torch.empty(800 << 20, dtype=torch.uint8, device=device)
        del big
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def test_retries_are_counted_and_warned_once(tmp_path, capsys):
    device = torch.device("cuda", 0)
    cfg = load_config("configs/transformer_tiny.toml", ["--metrics.enable_wandb=false"])
    metrics = MetricsLogger(cfg, tmp_path, rank=0, world_size=1, device=device, flops_per_token=1.0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    metrics.count(1)
    metrics.log(1, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3})
    fill_then_ask_for_more(device)
    after = torch.cuda.memory_stats(device)["num_alloc_retries"]
    assert after > before
    for step in (2, 3):
        metrics.count(1)
        metrics.log(step, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["alloc_retries"] for r in rows] == [before, after, after]
    assert capsys.readouterr().out.count("the CUDA allocator freed its cache and retried") == 1
