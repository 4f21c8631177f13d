"""Training throughput: tokens/s per device, MFU and peak memory of whole training steps, as a table.

    python scripts/bench_train.py configs/transformer_0.6B.toml --steps 30 --variants base,compile,ac [--section.key=value ...]

Each variant runs `flame.train` in a fresh process on the synthetic token stream (no data loading cost, no
checkpoints). The first half of the steps warms up (compilation, autotuning, allocator); the figures come from the
metrics of the second half only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "base": [],
    "compile": ["--training.compile=true"],
    "nocompile": ["--training.compile=false"],
    "ac": ["--training.activation_checkpoint=full"],
    "compile+ac": ["--training.compile=true", "--training.activation_checkpoint=full"],
}


def run(config: str, steps: int, extra: list[str], nproc: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--config", config, f"--job.dump_folder={tmp}/run", "--data.synthetic=true",
                f"--training.steps={steps}", f"--metrics.log_freq={steps // 2}", "--checkpoint.enable=false",
                "--metrics.enable_wandb=false", "--lr_scheduler.warmup_steps=1", *extra]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "flame.train", *args]
        else:
            cmd = [sys.executable, "-m", "flame.train", *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=Path(__file__).resolve().parents[1], env=dict(os.environ))
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout}s"}
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return {"error": tail[:120]}
        records = [json.loads(l) for l in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        return records[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="base")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600)
    a, overrides = p.parse_known_args()  # anything else: --section.key=value overrides for every variant
    a.overrides = [o for o in overrides if o != "--"]
    rows = []
    for name in a.variants.split(","):
        r = run(a.config, a.steps, VARIANTS[name] + a.overrides, a.nproc, a.timeout)
        rows.append((name, r))
        print(name, json.dumps(r), flush=True)
    print(f"\n{a.config}  ({a.nproc} process(es), steps {a.steps}, second half measured)")
    print(f"{'variant':<12} {'tok/s/device':>13} {'MFU %':>7} {'peak GiB':>9} {'loss':>8}")
    for name, r in rows:
        if "error" in r:
            print(f"{name:<12} {'failed: ' + r['error']}")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1f}"
        print(f"{name:<12} {r['tokens_per_sec_per_device']:>13,.0f} {mfu:>7} {r['memory_gib']:>9.1f} "
              f"{r['loss']:>8.3f}")


if __name__ == "__main__":
    main()
