"""Training throughput: tokens/s per device, MFU, peak memory and time to first step of whole training steps, as a
table over models and variants, with FLA's own models beside ours.

    python benchmarks/bench_train.py configs/rwkv7_0.6B.toml configs/gsa_0.6B.toml configs/transformer_0.6B.toml \
        --steps 30 --variants compile+ac,compile+sac
    python benchmarks/bench_train.py configs/rwkv7_0.6B.toml --steps 10 --nproc 1,8 --variants nocompile,hsdp --no-fla
    python benchmarks/bench_train.py configs/rwkv7_0.6B.toml --steps 10 --nproc 1,2,4 --variants cp --no-fla \
        --training.batch_size=1 --training.seq_len=32768 --training.gradient_accumulation_steps=1

Each config and variant runs `scripts/launch.sh` (torchrun, each count of --nproc processes) in a fresh process on the
synthetic token stream (no data loading cost, no checkpoints); "hsdp" replicates over 2 groups and shards within
each; "cp" splits every row over all the processes (context parallelism) at the sequence length times their count,
so that each process holds the single process's tokens and its scaling is the goal's "per GPU at a quarter of the
context"; "cp-gather" is "cp" with parallelism.context_parallel_exchange = "gather" (the default is the chain).
The first half of the steps warms up (compilation, autotuning, allocator); the figures come from the metrics
of the second half only, one line per step: the median step's tokens/s and MFU, the peak memory. Time to first step:
from the start of a rank's process to the end of its first step (imports, building, compiling, autotuning).

For an RWKV-7 or GSA config, FLA's RWKV7ForCausalLM / GSAForCausalLM of the same shape run too, on one GPU at their
best setting (benchmarks/bench_fla_train.py: bf16 autocast, fused AdamW; FLA's activation checkpointing only where
they do not fit without), in a fresh process under --timeout. Their MFU counts our model's FLOPs per token. Their rows
are left out, with a note, when fla is not installed, there is no GPU, or they fail or time out; a note gives the time
of their first step alone (FLA's autotuning, which Triton's cache keeps, so that a second run, even after a timeout,
starts further on).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Each variant but "base" and "hsdp" sets both compile and activation checkpointing, whatever the config's defaults.
NO_AC, AC, SAC = ("--training.activation_checkpoint=none", "--training.activation_checkpoint=full",
                  "--training.activation_checkpoint=selective")
VARIANTS = {
    "base": [],
    "compile": ["--training.compile=true", NO_AC],
    "nocompile": ["--training.compile=false", NO_AC],
    "ac": ["--training.compile=false", AC],
    "sac": ["--training.compile=false", SAC],
    "compile+ac": ["--training.compile=true", AC],
    "compile+sac": ["--training.compile=true", SAC],
    # selective, and training.recompute's parts (chunk_tensors: RWKV-7 alone)
    "compile+sac+mlp": ["--training.compile=true", SAC, '--training.recompute=["mlp_hidden"]'],
    "compile+sac+mlp+chunk": ["--training.compile=true", SAC, '--training.recompute=["mlp_hidden","chunk_tensors"]'],
    "compile+sac+lowrank": ["--training.compile=true", SAC, '--training.recompute=["low_rank"]'],
    "compile+sac+lowrank+mlp": ["--training.compile=true", SAC, '--training.recompute=["low_rank","mlp_hidden"]'],
    "hsdp": ["--parallelism.dp_replicate=2"],
    "cp": [],  # context_parallel_degree and seq_len from the process count: cp_args
    "cp-gather": ["--parallelism.context_parallel_exchange=gather"],  # "cp" through the all-gathers
}
FLA_MODELS = ("rwkv7", "gsa")
"""flame models with an FLA counterpart (flame/convert_fla.py)."""


def common_overrides(dump: str, steps: int) -> list[str]:
    return [f"--job.dump_folder={dump}", "--data.synthetic=true", f"--training.steps={steps}",
            "--metrics.log_freq=1", "--checkpoint.enable=false", "--metrics.enable_wandb=false",
            "--validation.enable=false", "--lr_scheduler.warmup_steps=1"]


def last_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines() or ["?"]
    errors = [l for l in lines if "Error" in l or "error:" in l]  # the cause, not torchrun's summary
    return (errors or lines)[-1][-160:]


def run_flame(config: str, steps: int, extra: list[str], nproc: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["bash", "scripts/launch.sh", config, *common_overrides(f"{tmp}/run", steps), *extra]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                                  env=dict(os.environ, NPROC=str(nproc), PYTHON=sys.executable))
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout}s"}
        if proc.returncode != 0:
            return {"error": last_error_line(proc.stderr)}
        records = [json.loads(l) for l in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        first = next((r["time_to_first_step_sec"] for r in records if "time_to_first_step_sec" in r), None)
        return dict(steady(records, steps), time_to_first_step_sec=first)


def steady(records: list[dict], steps: int) -> dict:
    """The second half's steps (one metrics line each): the median step's tokens/s and MFU, the peak memory, the
    last loss. A median, since a one-off stall (a kernel variant a new batch layout compiles, once a run) in a few
    measured steps would move a mean far from what a long run sustains."""
    measured = [r for r in records if "tokens_per_sec_per_device" in r and r["step"] > steps // 2]
    median = lambda key: statistics.median(r[key] for r in measured)  # noqa: E731
    return dict(measured[-1], tokens_per_sec_per_device=median("tokens_per_sec_per_device"),
                mfu=None if measured[-1].get("mfu") is None else median("mfu"),
                memory_gib=max(r["memory_gib"] for r in measured))


def run_fla(config: str, steps: int, overrides: list[str], activation_checkpoint: bool, timeout: int) -> dict:
    cmd = [sys.executable, "benchmarks/bench_fla_train.py", config, f"--steps={steps}", *overrides]
    if activation_checkpoint:
        cmd.append("--activation-checkpoint")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": last_error_line(proc.stderr)}


def fla_rows(config: str, a) -> tuple[list, str | None]:
    """FLA's rows for `config` (none, and a note saying why, where they cannot run)."""
    if importlib.util.find_spec("fla") is None:
        return [], "fla is not installed (pip install flash-linear-attention)"
    r = run_fla(config, a.steps, a.overrides, False, a.timeout)
    variant = "fla"
    if r.get("error") == "out of memory":
        r, variant = run_fla(config, a.steps, a.overrides, True, a.timeout), "fla+ac"
    if "error" in r:
        return [], f"FLA: {r['error']}"
    return [(Path(config).stem, 1, variant, r)], None


def model_name(config: str) -> str:
    from flame.config import load_config

    return load_config(config).model.name


def cp_args(variant: str, config: str, nproc: int, overrides: list[str]) -> list[str]:
    """The "cp" variants' overrides (after the user's, so its sequence length wins)."""
    if not variant.startswith("cp"):
        return []
    from flame.config import load_config

    seq_len = load_config(config, overrides).training.seq_len
    return [f"--parallelism.context_parallel_degree={nproc}", f"--training.seq_len={seq_len * nproc}"]


def usage_error(line: str) -> None:
    print(f"bench_train: {line}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="one or more run configs (.toml)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default="base", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--nproc", default="1", help="process counts, e.g. 1,4: scaling is against the first")
    p.add_argument("--timeout", type=int, default=600, help="seconds for each run")
    p.add_argument("--no-fla", action="store_true", help="leave FLA's models out")
    a, overrides = p.parse_known_args()  # anything else: --section.key=value overrides for every run
    a.overrides = [o for o in overrides if o != "--"]
    counts = [int(n) for n in a.nproc.split(",")]
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    missing = [c for c in a.configs if not Path(c).is_file()]
    if unknown:
        usage_error(f"--variants: unknown variant {unknown[0]!r} (one of: {', '.join(VARIANTS)})")
    if a.steps < 2:
        usage_error(f"--steps must be at least 2 (the second half is measured), got {a.steps}")
    if missing:
        usage_error(f"no config file {missing[0]}")
    rows, notes = [], []
    for config in a.configs:
        name, config = Path(config).stem, str(Path(config).resolve())  # the runs start in the repository
        for n in counts:
            for variant in variants:
                if variant == "hsdp" and (n < 2 or n % 2):
                    continue  # 2 replicas need an even number of ranks
                extra = VARIANTS[variant] + a.overrides + cp_args(variant, config, n, a.overrides)
                r = run_flame(config, a.steps, extra, n, a.timeout)
                rows.append((name, n, variant, r))
                print(name, n, variant, json.dumps(r), flush=True)
        if not a.no_fla and model_name(config) in FLA_MODELS:
            fla, note = fla_rows(config, a)
            rows += fla
            for row in fla:
                print(*row[:3], json.dumps(row[3]), flush=True)
            if note:
                notes.append(f"{name}: FLA rows skipped: {note}")
    print_table(rows, notes, a.steps, counts)


def print_table(rows: list, notes: list[str], steps: int, counts: list[int]) -> None:
    def baseline(model: str, variant: str) -> float | None:
        """tok/s/device of this model and variant at the first process count (HSDP: of the model's first row)."""
        same = [r for m, n, v, r in rows if m == model and n == counts[0] and (v == variant or variant == "hsdp")]
        return same[0].get("tokens_per_sec_per_device") if same else None

    print(f"\nsteps {steps}, median step of the second half; scaling: tok/s/device against {counts[0]} process(es)")
    print(f"{'model':<18} {'procs':>5} {'variant':<22} {'tok/s/device':>13} {'scaling':>8} {'MFU %':>7} "
          f"{'peak GiB':>9} {'1st step s':>10} {'loss':>8}")
    for model, n, variant, r in rows:
        if "error" in r:
            print(f"{model:<18} {n:>5} {variant:<22} failed: {r['error']}")
            continue
        tps, ref = r["tokens_per_sec_per_device"], baseline(model, variant)
        scaling = f"{tps / ref:.3f}" if ref else "n/a"
        mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1f}"
        first = "n/a" if r.get("time_to_first_step_sec") is None else f"{r['time_to_first_step_sec']:.1f}"
        print(f"{model:<18} {n:>5} {variant:<22} {tps:>13,.0f} {scaling:>8} {mfu:>7} {r['memory_gib']:>9.1f} "
              f"{first:>10} {r['loss']:>8.3f}")
        if r.get("first_step_sec") is not None:  # FLA's rows
            notes.append(f"{model} {variant}: step 1 alone took {r['first_step_sec']:.1f} s (FLA's Triton autotuning "
                         "and kernel compiles; the autotuning is cached for later runs)")
    for note in notes:
        print(note)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
