"""Host time of a training step's end: the gradient clip and the optimizer step over FSDP's parameters (DTensors), as
the trainer runs them, for a config's parameter structure (its layers and parameters, at a small width so the
device's own work is negligible: what is timed is the host's dispatch). While the host works through these, the GPU,
done with the backward, has nothing queued.

    python benchmarks/bench_step_end.py configs/rwkv7_0.6B.toml [--hidden-size 128] [--calls 20]

Rows: torch's fused AdamW (DTensors all the way down) and flame's (flame.optim.AdamW: the same kernel on the local
tensors); torchtitan's clip_grad_norm_ and flame's (flame.grad_clip: the same on the local tensors). One process
(gloo on CPU, NCCL on a GPU), median of --calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args()
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.utils import clip_grad_norm_

    from flame.config import ConfigError, load_config
    from flame.grad_clip import clip_grad_norm_ as clip_local
    from flame.models import build_model
    from flame.optim import build_optimizer
    from flame.parallel import init_distributed, parallelize

    try:   # two heads where the model counts heads, so that any width divides
        heads = ["--model.num_heads=2"] if hasattr(load_config(a.config, []).model, "num_heads") else []
        cfg = load_config(a.config, [f"--model.hidden_size={a.hidden_size}", "--model.vocab_size=256", *heads])
    except ConfigError as e:
        print(f"bench_step_end: {e}", file=sys.stderr)
        sys.exit(2)
    d = init_distributed(cfg.parallelism)
    model = build_model(cfg.model).to(d.device)
    model.init_weights()
    model = parallelize(model, d, param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="none",
                        compile=False)
    params = list(model.parameters())
    for q in params:
        q.grad = DTensor.from_local(torch.randn_like(q.to_local()).mul(1e-3), q.device_mesh, q.placements)
    found_inf = torch.zeros((), device=d.device)
    ours = build_optimizer(model, cfg.optimizer)
    theirs = torch.optim.AdamW([dict(g) for g in ours.param_groups], fused=True)   # the same groups, torch's step

    def timed(fn) -> float:
        fn()   # (lazy state)
        times = []
        for _ in range(a.calls):
            sync(d.device)
            start = time.perf_counter()
            fn()
            sync(d.device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def step(opt):
        opt.found_inf = found_inf
        opt.step()

    rows = [("torch.optim.AdamW (fused, on DTensors)", timed(lambda: step(theirs))),
            ("flame.optim.AdamW (fused, on the local tensors)", timed(lambda: step(ours))),
            ("torchtitan clip_grad_norm_ (on DTensors)", timed(lambda: clip_grad_norm_(params, 1.0))),
            ("flame.grad_clip.clip_grad_norm_ (on the local tensors)", timed(lambda: clip_local(params, 1.0)))]
    where = torch.cuda.get_device_name() if d.device.type == "cuda" else "CPU"
    print(f"{cfg.model.name}, {cfg.model.num_layers} layers at width {a.hidden_size}: {len(params)} parameters; "
          f"{where}, median of {a.calls} calls, the device synchronized around each")
    print("| step end | host ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
