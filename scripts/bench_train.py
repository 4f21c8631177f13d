"""Training throughput: tokens/s per device, MFU and peak memory of whole training steps, as a table.

    python scripts/bench_train.py configs/transformer_0.6B.toml --steps 30 --variants base,compile,ac [--section.key=value ...]
    python scripts/bench_train.py configs/rwkv7_0.6B.toml --steps 10 --nproc 1,8 --variants nocompile,hsdp

Each variant runs `scripts/launch.sh` (torchrun, each count of --nproc processes) in a fresh process on the
synthetic token stream (no data loading cost, no checkpoints); "hsdp" replicates over 2 groups and shards within
each. The first half of the steps warms up (compilation, autotuning, allocator); the figures come from the metrics
of the second half only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Each variant but "base" and "hsdp" sets both compile and activation checkpointing, whatever the config's defaults.
NO_AC, AC = "--training.activation_checkpoint=none", "--training.activation_checkpoint=full"
VARIANTS = {
    "base": [],
    "compile": ["--training.compile=true", NO_AC],
    "nocompile": ["--training.compile=false", NO_AC],
    "ac": ["--training.compile=false", AC],
    "compile+ac": ["--training.compile=true", AC],
    "hsdp": ["--parallelism.dp_replicate=2"],
}


def run(config: str, steps: int, extra: list[str], nproc: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [f"--job.dump_folder={tmp}/run", "--data.synthetic=true",
                f"--training.steps={steps}", f"--metrics.log_freq={steps // 2}", "--checkpoint.enable=false",
                "--metrics.enable_wandb=false", "--validation.enable=false", "--lr_scheduler.warmup_steps=1", *extra]
        cmd = ["bash", "scripts/launch.sh", config, *args]  # the users' own launcher, same environment
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=Path(__file__).resolve().parents[1],
                                  env=dict(os.environ, NPROC=str(nproc), PYTHON=sys.executable))
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout}s"}
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["?"]
            errors = [l for l in lines if "Error" in l or "error:" in l]  # the cause, not torchrun's summary
            return {"error": (errors or lines)[-1][-160:]}
        records = [json.loads(l) for l in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        return [r for r in records if "tokens_per_sec_per_device" in r][-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="base")
    p.add_argument("--nproc", default="1", help="process counts, e.g. 1,4: scaling is against the first")
    p.add_argument("--timeout", type=int, default=600)
    a, overrides = p.parse_known_args()  # anything else: --section.key=value overrides for every variant
    a.overrides = [o for o in overrides if o != "--"]
    counts = [int(n) for n in a.nproc.split(",")]
    variants = a.variants.split(",")
    rows = []
    for n in counts:
        for name in variants:
            if name == "hsdp" and (n < 2 or n % 2):
                continue  # 2 replicas need an even number of ranks
            r = run(a.config, a.steps, VARIANTS[name] + a.overrides, n, a.timeout)
            rows.append((n, name, r))
            print(n, name, json.dumps(r), flush=True)

    def baseline(name: str) -> float | None:
        """tok/s/device of this variant at the first process count (HSDP: of the first variant there)."""
        ref = variants[0] if name == "hsdp" else name
        r = next((r for n, v, r in rows if n == counts[0] and v == ref), {})
        return r.get("tokens_per_sec_per_device")

    print(f"\n{a.config}  (steps {a.steps}, second half measured; scaling: tok/s/device against {counts[0]} "
          f"process(es))")
    print(f"{'procs':>5} {'variant':<12} {'tok/s/device':>13} {'scaling':>8} {'MFU %':>7} {'peak GiB':>9} "
          f"{'loss':>8}")
    for n, name, r in rows:
        if "error" in r:
            print(f"{n:>5} {name:<12} failed: {r['error']}")
            continue
        tps, ref = r["tokens_per_sec_per_device"], baseline(name)
        scaling = f"{tps / ref:.3f}" if ref else "n/a"
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1f}"
        print(f"{n:>5} {name:<12} {tps:>13,.0f} {scaling:>8} {mfu:>7} {r['memory_gib']:>9.1f} {r['loss']:>8.3f}")


if __name__ == "__main__":
    main()
