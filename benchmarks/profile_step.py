"""Where a training step's GPU time goes: one forward + backward of a config's model on random tokens, bf16 parameters,
under the PyTorch profiler; prints the total, the peak memory, the time by kind (flame.profiling's groups: matmuls, our
Triton kernels, Inductor's, ...) and the kernels taking the most time. Then the wall time of a step unprofiled: where
it exceeds the GPU time, the host (Python, dispatch, launches) bounds the step; at a small --batch the wall time is the
host's cost of a step. No data, no optimizer, no FSDP: the model's own compute only (the micro-batch may be smaller
than the config's, to fit).

    python benchmarks/profile_step.py configs/rwkv7_0.6B.toml --batch 2 [--seq-len 4096] [--top 20] [--compile]
        [--activation-checkpoint none|selective|full] [--recompute mlp_hidden,low_rank,chunk_tensors]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_time import kernel_times  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's training.seq_len")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile each block, as training.compile does")
    p.add_argument("--activation-checkpoint", default="none", choices=["none", "selective", "full"])
    p.add_argument("--recompute", default="", help="training.recompute's parts, comma-separated (with selective)")
    a = p.parse_args()
    from flame.config import ConfigError, load_config
    from flame.models import build_model
    from flame.parallel import prepare_blocks

    recompute = [part for part in a.recompute.split(",") if part]
    try:   # (checks the parts against the model and the checkpointing)
        cfg = load_config(a.config, [f"--training.activation_checkpoint={a.activation_checkpoint}",
                                     f"--training.recompute={recompute}"])
    except ConfigError as e:
        print(f"profile_step: {e}", file=sys.stderr)
        sys.exit(2)
    T = a.seq_len or cfg.training.seq_len
    model = build_model(cfg.model).cuda()
    model.init_weights()
    model.to(torch.bfloat16)
    prepare_blocks(model, a.activation_checkpoint, a.compile, recompute)
    ids = torch.randint(0, cfg.model.vocab_size, (a.batch, T), device="cuda")

    def step():
        model(ids, labels=ids).backward()   # the summed token loss
        model.zero_grad(set_to_none=True)

    step()   # compiles the kernels (and the blocks)
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated() / 2**30
    rows = sorted(kernel_times(step), key=lambda r: -r[1])
    total = sum(ms for _, ms, _ in rows)
    checkpointing = a.activation_checkpoint + "".join(f", {part}" for part in recompute)
    print(f"{cfg.model.name}: one fwd+bwd of {a.batch} x {T} tokens ({checkpointing} checkpointing) on "
          f"{torch.cuda.get_device_name()}: {total:.1f} ms of GPU time in {sum(c for *_, c in rows)} kernel launches, "
          f"peak memory {peak:.2f} GiB")
    wall = wall_ms(step)
    print(f"wall time of a step, unprofiled: {wall:.1f} ms against the GPU's {total:.1f} ms: "
          f"{'the host' if wall > 1.05 * total else 'the GPU'} bounds it")
    print("by kind (flame.profiling's groups): " + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in by_kind(rows)))
    for name, ms, count in rows[:a.top]:
        print(f"  {ms:8.2f} ms {100 * ms / total:5.1f} % {count:5d}x  {name[:100]}")


def wall_ms(step, steps: int = 5) -> float:
    """Median wall time of a step, the device synchronized after each (the host issues a step's work, then waits)."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[steps // 2]


def by_kind(rows) -> list[tuple[str, float]]:
    """(kind, ms) of the kernel rows (name, ms, launches), in flame.profiling.KINDS' order: matmuls, attention, our
    Triton kernels, Inductor's, copies and memsets, the rest."""
    from flame.profiling import KINDS, device_kind

    ms = defaultdict(float)
    for name, t, _ in rows:
        ms[device_kind(name, "gpu_memcpy" if name.startswith(("Memcpy", "Memset")) else "kernel")] += t
    return [(kind, ms[kind]) for kind in KINDS if kind in ms]


if __name__ == "__main__":
    main()
