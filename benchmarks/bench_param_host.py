"""Host time of a training step's work per parameter, as the trainer runs it over FSDP (DTensor parameters): the
gradient clip, the optimizer step, and over one shard the gathered parameters' upkeep; for a config's parameter
structure (its layers and parameters, at a small width and a few tokens, so the device's own work is small: what is
timed is the host's dispatch). RWKV-7 has 28 parameters a block, the Transformer 9.

    python benchmarks/bench_param_host.py configs/rwkv7_0.6B.toml [--hidden-size 128] [--calls 20]

Rows: torch's fused AdamW (DTensors all the way down) against flame's (flame.optim.AdamW: the same kernel on the local
tensors); torchtitan's clip_grad_norm_ against flame's (flame.grad_clip); and whole steps (forward and backward of
16 tokens, clip, AdamW) as FSDP, torch and torchtitan run them against flame's (those two and, over one shard,
flame.parallel.keep_gathered_parameters). One process (gloo on CPU, NCCL on a GPU), median of --calls, the device
synchronized around each.
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
    from torchtitan.distributed.utils import clip_grad_norm_ as clip_torchtitan

    from flame.config import ConfigError, load_config
    from flame.grad_clip import clip_grad_norm_ as clip_flame
    from flame.models import build_model
    from flame.optim import build_optimizer
    from flame.parallel import init_distributed, keep_gathered_parameters, parallelize

    try:   # two heads where the model counts heads, so that any width divides
        heads = ["--model.num_heads=2"] if hasattr(load_config(a.config, []).model, "num_heads") else []
        cfg = load_config(a.config, [f"--model.hidden_size={a.hidden_size}", "--model.vocab_size=256", *heads])
    except ConfigError as e:
        print(f"bench_param_host: {e}", file=sys.stderr)
        sys.exit(2)
    d = init_distributed(cfg.parallelism)

    def sharded():
        torch.manual_seed(0)
        model = build_model(cfg.model).to(d.device)
        model.init_weights()
        return parallelize(model, d, param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="none",
                           compile=False)

    def timed(fn) -> float:
        for _ in range(2):   # (lazy state, first gathers)
            fn()
        times = []
        for _ in range(a.calls):
            sync(d.device)
            start = time.perf_counter()
            fn()
            sync(d.device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    found_inf = torch.zeros((), device=d.device)

    def update(opt):
        opt.found_inf = found_inf
        opt.step()

    # the step's end alone, on random gradients
    model = sharded()
    params = list(model.parameters())
    for q in params:
        q.grad = DTensor.from_local(torch.randn_like(q.to_local()).mul(1e-3), q.device_mesh, q.placements)
    ours = build_optimizer(model, cfg.optimizer)
    theirs = torch.optim.AdamW([dict(g) for g in ours.param_groups], fused=True)   # the same groups, torch's step
    rows = [("clip: torchtitan's clip_grad_norm_ (on DTensors)", timed(lambda: clip_torchtitan(params, 1.0))),
            ("clip: flame.grad_clip (on the local tensors)", timed(lambda: clip_flame(params, 1.0))),
            ("AdamW: torch's fused step (on DTensors)", timed(lambda: update(theirs))),
            ("AdamW: flame.optim.AdamW (on the local tensors)", timed(lambda: update(ours)))]

    # whole steps
    ids = torch.randint(0, 256, (1, 16), device=d.device)
    for name, flame_parts in (("step: FSDP's upkeep, torchtitan's clip, torch's AdamW", False),
                              ("step: flame's (kept gathered parameters, its clip and AdamW)", True)):
        model = sharded()
        opt = build_optimizer(model, cfg.optimizer)
        if flame_parts:
            kept = keep_gathered_parameters(model, d, opt)
            name += "" if kept else " (several shards: FSDP's upkeep)"
        else:
            opt = torch.optim.AdamW([dict(g) for g in opt.param_groups], fused=True)
        shards = [q for g in opt.param_groups for q in g["params"]]
        clip = clip_flame if flame_parts else clip_torchtitan

        def step():
            model(ids, labels=ids).backward()
            clip(shards, 1.0)
            update(opt)
            opt.zero_grad(set_to_none=True)
        rows.append((name, timed(step)))

    where = torch.cuda.get_device_name() if d.device.type == "cuda" else "CPU"
    print(f"{cfg.model.name}, {cfg.model.num_layers} layers at width {a.hidden_size}: {len(params)} parameters; "
          f"{where}, median of {a.calls} calls")
    print("| per-parameter work | host ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
