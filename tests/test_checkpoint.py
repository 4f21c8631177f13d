"""Checkpoints: exact resume after SIGKILL, incomplete saves ignored, SIGTERM saves and exits 0, resharding from 2
ranks to 1, clear errors for incompatible runs, export round trip and init_from."""

import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from flame.export import load_exported, main as export
from tests.helpers import REPO, SMALL_VOCAB, launch_sh, read_checkpoint, read_metrics, run_train, write_config

# the tiny default config on the bundled sample text (2 data workers per rank) at a 512-token vocabulary, made short
TEXT = [*SMALL_VOCAB, "--training.seq_len=64", "--training.batch_size=2", "--validation.enable=false", "--metrics.log_freq=1", "--checkpoint.keep_latest_k=0",
        "--lr_scheduler.warmup_steps=2"]
CONSTANT_LR = ["--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_factor=1.0"]


def launch(dump, *overrides, nproc=2, wait=True):
    """The run through scripts/launch.sh: for what the launcher and torchrun take part in (a signal to the job, the
    ranks' tagged lines)."""
    return launch_sh("configs/transformer_tiny.toml", f"--job.dump_folder={dump}", *TEXT, *overrides, nproc=nproc,
                     wait=wait)


def train(dump, *overrides, nproc=2):
    """The same run as forked ranks (helpers.run_train): the training itself, without the launcher's start-up."""
    return run_train(REPO / "configs/transformer_tiny.toml", f"--job.dump_folder={dump}", *TEXT, *overrides,
                     nproc=nproc)


def wait_for(path, proc, timeout=240):
    start = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - start < timeout, f"{path} never appeared"
        time.sleep(0.02)


def last_loss_per_step(dump):
    return {r["step"]: r["loss"] for r in read_metrics(dump)}  # a resumed run's line wins over the killed run's


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 8-step run on 2 ranks."""
    dump = tmp_path_factory.mktemp("straight") / "run"
    proc = train(dump, "--training.steps=8", "--checkpoint.interval=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump


def test_sigkill_after_checkpoint_then_resume_is_exact(tmp_path, straight):
    dump = tmp_path / "run"
    proc = launch(dump, "--training.steps=8", "--checkpoint.interval=4", wait=False)
    wait_for(dump / "checkpoint" / "step-4", proc)
    # every process of the job at once: launcher, torchrun, both ranks (torchrun starts them in sessions of their
    # own) and their data workers, all of which carry the run folder on their command line
    subprocess.run(["pkill", "-KILL", "-f", f"job.dump_folder={dump}"], check=True)
    proc.wait()
    time.sleep(0.5)
    assert not (dump / "checkpoint" / "step-8").exists()  # it really died mid-run

    # a save killed half-way leaves a .tmp folder: it must be ignored (and cleared), never loaded
    partial = dump / "checkpoint" / "step-6.tmp"
    shutil.copytree(dump / "checkpoint" / "step-4", partial)
    (partial / ".metadata").unlink()

    resumed = train(dump, "--training.steps=8", "--checkpoint.interval=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stdout and "removed step-6.tmp" in resumed.stdout
    assert not partial.exists()
    expected, got = last_loss_per_step(straight), last_loss_per_step(dump)
    assert [got[s] for s in range(5, 9)] == [expected[s] for s in range(5, 9)]  # bit for bit


def test_text_checkpoint_on_other_rank_count_stops_with_advice(tmp_path, straight):
    dump = tmp_path / "run"
    shutil.copytree(straight, dump)
    config = (dump / "config.toml").read_text()
    proc = launch(dump, "--training.steps=12", nproc=1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (dump / "config.toml").read_text() == config  # stopped before the run folder changed
    # the rank's own output (torchrun adds a report of its own): one line, every way out named, no traceback
    rank_lines = [line for line in proc.stderr.splitlines() if line.startswith("[default0]:")]
    (line,) = [line for line in rank_lines if "error" in line]
    assert line.startswith("[default0]:error: checkpoint ") and "written by 2 data-parallel ranks" in line
    for way in ("the checkpoint's layout", "--checkpoint.data_state=restart", "--job.dump_folder",
                "--checkpoint.resume=never"):
        assert way in line
    assert not any("Traceback" in line for line in rank_lines)
    # nothing after the rank's line: no torchrun failure report, and no lock left for the next launch to take over
    assert "failed (exitcode" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert (dump / ".lock").read_text() == ""

    # restarting the data streams on 1 rank halves the global batch: said with the other changes applied
    proc = train(dump, "--training.steps=9", "--checkpoint.data_state=restart", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "took over the lock" not in proc.stdout
    assert "global batch changed since step 8 (applied): 4 sequences in the checkpoint (2 x 2 x 1 ranks x " \
           "batch_size x accumulation), 2 now (1 x 2 x 1)" in proc.stdout


def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path):
    dump = tmp_path / "run"
    proc = launch(dump, "--training.steps=1000", "--checkpoint.interval=1000", *CONSTANT_LR, wait=False)
    start = time.time()
    while not (dump / "metrics.jsonl").exists() or len(read_metrics(dump)) < 3:
        assert proc.poll() is None and time.time() - start < 240
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher, as a scheduler's preemption notice would
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "on signal SIGTERM" in out
    (saved,) = [int(p.name.split("-")[1]) for p in (dump / "checkpoint").iterdir()]
    assert saved == read_metrics(dump)[-1]["step"] < 1000

    resumed = train(dump, f"--training.steps={saved + 2}", *CONSTANT_LR)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {saved}" in resumed.stdout
    assert [r["step"] for r in read_metrics(dump)][-2:] == [saved + 1, saved + 2]


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    """Model and optimizer reshard (DCP); the synthetic stream's position is global, so the run continues exactly
    the 2-rank run's global batches: the losses agree up to summation order."""
    args = ["--training.batch_size=2", *CONSTANT_LR, "--checkpoint.interval=2"]
    path, dump2 = write_config(tmp_path, "two")
    saved = run_train(path, "--training.steps=4", "--checkpoint.async_mode=async", *args, nproc=2)
    assert saved.returncode == 0, saved.stderr[-3000:]
    for step in (2, 4):  # each async save reports when it is complete on disk: the earlier one at the next save
        assert f"checkpoint step-{step}: complete on disk" in saved.stdout
    path, dump = write_config(tmp_path, "resharded")
    assert run_train(path, "--training.steps=2", *args, nproc=2).returncode == 0
    proc = run_train(path, "--training.steps=4", "--training.batch_size=4", *CONSTANT_LR)  # 1 rank, same batch
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 2 (loaded in" in proc.stdout
    expected, got = last_loss_per_step(dump2), last_loss_per_step(dump)
    assert got[3] == pytest.approx(expected[3], rel=1e-6) and got[4] == pytest.approx(expected[4], rel=1e-6)
    # the async run's checkpoints are complete and hold the same weights as the sync ones at step 2
    a, b = read_checkpoint(dump2, 2)["model"], read_checkpoint(dump, 2)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)

    # a changed model shape is named, not a stack trace about tensors
    proc = run_train(path, "--training.steps=6", "--model.hidden_size=32")
    assert proc.returncode != 0
    assert "model.hidden_size: 64 in the checkpoint, 32 now" in proc.stderr


def test_export_round_trip_and_init_from(tmp_path):
    path, dump = write_config(tmp_path)
    assert run_train(path, "--training.steps=3").returncode == 0
    out = tmp_path / "exported"
    export([str(dump), str(out)])  # (its command line: tests/test_export_cli.py)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    model = load_exported(out)
    weights = read_checkpoint(dump, 3)["model"]
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
    x = torch.randint(0, 512, (2, 16))
    reference = load_exported(out)
    assert torch.equal(model(x), reference(x))

    # a new run starting from the export: with a vanishing lr its first step leaves the weights as exported
    path2, dump2 = write_config(tmp_path, "child")
    proc = run_train(path2, "--training.steps=1", f"--checkpoint.init_from={out}", "--optimizer.lr=1e-30")
    assert proc.returncode == 0 and "initialized from" in proc.stdout
    child = read_checkpoint(dump2, 1)["model"]
    assert all(torch.equal(child[k], weights[k]) for k in weights)
