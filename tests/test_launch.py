"""scripts/launch.sh runs the tiny default config for real: 2 CPU processes under torchrun/gloo on the bundled
sample text (at the sample tokenizer's 512 tokens: the 50k head adds nothing the launcher does), metrics, eval,
checkpoints and per-rank logs in the run folder."""

import math
import subprocess

from tests.helpers import REPO, SMALL_VOCAB, env, read_metrics

REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "tokens_seen"}


def test_launch_two_cpu_processes(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run(
        ["bash", "scripts/launch.sh", "configs/transformer_tiny.toml", "--training.steps", "4",
         f"--job.dump_folder={dump}", "--metrics.log_freq=2", "--checkpoint.interval=2",
         "--training.seq_len=64", "--lr_scheduler.warmup_steps=1", *SMALL_VOCAB],
        cwd=REPO, env=env(extra=dict(NPROC="2")), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_metrics(dump)
    evals = read_metrics(dump, "eval_loss")
    assert [r["step"] for r in records] == [2, 4]
    assert [r["step"] for r in evals] == [4] and math.isfinite(evals[0]["eval_loss"])  # validation at the end
    for r in records:
        assert REQUIRED <= r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_sec"] > 0 and r["mfu"] is None  # no MFU on CPU
    assert records[-1]["tokens_seen"] == 4 * 2 * 4 * 64  # steps x ranks x micro batch x seq_len
    assert "FIRST LOSS" not in proc.stderr  # a fresh model starts near ln(vocab)
    assert (dump / "config.toml").is_file()
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-4"]
    logs = list((dump / "logs").rglob("stdout.log"))
    assert len(logs) == 2  # one per rank


def test_layout_that_does_not_fit_the_processes_stops_before_any_starts(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run(
        ["bash", "scripts/launch.sh", "configs/transformer_tiny.toml", f"--job.dump_folder={dump}",
         "--parallelism.dp_shard=2"],
        cwd=REPO, env=env(extra=dict(NPROC="3")), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("config error: configs/transformer_tiny.toml: parallelism: expected dp_replicate * "
                                   "dp_shard = number of processes (3), got '1 * 2'")
    assert proc.stdout == "" and not dump.exists()  # no process started, no run folder made
