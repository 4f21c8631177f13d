"""Faults on a real job (CPU, gloo), each ending with nothing lost: a rank killed mid-run (torchrun restarts it from
the last checkpoint), a rank that hangs (the job fails naming it within parallelism.collective_timeout_sec), the
whole job killed at random moments of async checkpoint writes (the next launch resumes from the newest complete
checkpoint), and a disk that fills up during a save (one line, the previous checkpoints stay loadable)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flame.checkpoint import complete_steps, unreadable_file
from tests.helpers import REPO, env, last_step, launch_sh, read_metrics, run_train, wait_for_step, write_config

CONSTANT_LR = ["--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_factor=1.0"]
# checkpoints every 2 steps, all kept: a restart resumes from a step before the fault
TWO_RANKS = [*CONSTANT_LR, "--training.steps=12", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"]


RANK_PREFIX = re.compile(r"^\[default\d+\]:")
"""torchrun's tag on a rank's teed line."""


def launch(config: Path, *overrides: str, nproc: int = 2, **extra_env: str) -> subprocess.Popen:
    return launch_sh(config, *overrides, nproc=nproc, wait=False, **extra_env)


def rank_pid(dump: Path, rank: int, attempt: int = 0) -> int:
    """The pid of training rank `rank` of the run in `dump` (torchrun's attempt `attempt`), not of its data workers:
    read from /proc, the way an operator finds it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if (b"flame.train" in cmdline and str(dump).encode() in cmdline and f"RANK={rank}".encode() in environ
                and f"TORCHELASTIC_RESTART_COUNT={attempt}".encode() in environ and b"flame.lifeline" in parent):
            found.append(int(entry.name))
    assert len(found) == 1, f"rank {rank}: processes {found}"
    return found[0]


def losses(dump: Path) -> dict[int, float]:
    records = read_metrics(dump)
    assert [r["step"] for r in records] == sorted({r["step"] for r in records}), "a step logged twice"
    return {r["step"]: r["loss"] for r in records}


def assert_checkpoints_whole(dump: Path) -> list[int]:
    """Every folder named as complete loads (metadata, every shard, every pickled item); no save left half-done
    under a complete name. Returns the complete steps."""
    folder = dump / "checkpoint"
    steps = complete_steps(folder)
    for step in steps:
        assert unreadable_file(folder / f"step-{step}") is None, f"step-{step}"
    return steps


@pytest.fixture(scope="module")
def straight_two_ranks(tmp_path_factory):
    """The uninterrupted 12-step run on 2 ranks: its losses step by step."""
    path, dump = write_config(tmp_path_factory.mktemp("straight2"))
    proc = run_train(path, *TWO_RANKS, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(dump)


def test_rank_killed_mid_run_restarts_from_the_last_checkpoint(tmp_path, straight_two_ranks):
    path, dump = write_config(tmp_path)
    job = launch(path, *TWO_RANKS, MAX_RESTARTS="1")
    try:
        wait_for_step(dump, job, 5)
        os.kill(rank_pid(dump, 1), signal.SIGKILL)
        killed_after = last_step(dump)
        out, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, err[-3000:]
    assert killed_after < 12, "the run ended before the kill"
    resumed = [int(m) for m in re.findall(rf"resuming run {dump} from step (\d+)", out)]
    assert len(resumed) == 1 and 4 <= resumed[0] <= killed_after and resumed[0] % 2 == 0, out[-3000:]
    assert "in use by another run" not in out + err  # the restarted rank 0 takes the run lock over
    assert losses(dump) == straight_two_ranks  # step for step, bit for bit
    assert assert_checkpoints_whole(dump) == [2, 4, 6, 8, 10, 12]


def test_hung_rank_fails_the_job_naming_it_then_resumes(tmp_path):
    path, dump = write_config(tmp_path)
    timeout = 8  # above the skew between a healthy job's ranks on a loaded machine
    job = launch(path, *CONSTANT_LR, "--training.steps=100000", "--checkpoint.interval=2",
                 "--checkpoint.keep_latest_k=0", f"--parallelism.collective_timeout_sec={timeout}")
    hung = None
    try:
        wait_for_step(dump, job, 3)
        hung = rank_pid(dump, 1)
        os.kill(hung, signal.SIGSTOP)  # as a rank stuck in the kernel or a deadlock: alive, silent
        stopped_at = time.monotonic()
        lines = []
        for line in job.stderr:  # rank 0's lines come through torchrun as they are written
            lines.append(line)
            if RANK_PREFIX.sub("", line).startswith("error:"):
                break
        said_after = time.monotonic() - stopped_at
        # Left stopped, rank 1 ignores torchrun's SIGTERM and is killed 30 s later (torchrun's fixed grace; the job
        # then exits 2: measured 37 s after the stop). Woken, it meets its SIGTERM and rank 0's absence at once.
        os.kill(hung, signal.SIGCONT)
        out, rest = job.communicate(timeout=120)
        ended_after = time.monotonic() - stopped_at
        err = "".join(lines) + rest
    finally:
        if hung is not None:
            try:
                os.kill(hung, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 2, err[-3000:]
    # said within the collective's timeout plus one probe of at most 10 s (and slack)
    assert said_after < timeout + 10 + 10, said_after
    assert ended_after < said_after + 15, ended_after
    errors = [RANK_PREFIX.sub("", line) for line in err.splitlines() if RANK_PREFIX.sub("", line).startswith("error:")]
    # rank 0 names rank 1 first; woken, rank 1 may add that rank 0 has gone (it has, by then)
    assert errors and re.search(r"error: rank 1 did not arrive (at|in) step \d+", errors[0]), err[-3000:]
    assert "parallelism.collective_timeout_sec" in errors[0]
    assert all("error: rank 0, or a rank it waits for, did not arrive" in line for line in errors[1:]), errors

    steps = assert_checkpoints_whole(dump)
    assert steps and steps[-1] >= 2
    # relaunched (on one rank, to keep the test short: synthetic data resumes on any number of ranks)
    again = run_train(path, *CONSTANT_LR, f"--training.steps={steps[-1] + 1}", "--checkpoint.interval=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming run {dump} from step {steps[-1]}" in again.stdout


def mount_small_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs of its own (a full disk)")
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_during_a_save_keeps_the_previous_checkpoints(tmp_path, mode):
    small = tmp_path / "small"
    mount_small_tmpfs(small, "6m")  # room for two checkpoints of the tiny model (2.4 MB each), not three
    try:
        path, dump = write_config(small)
        args = [*CONSTANT_LR, "--training.steps=5", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0",
                f"--checkpoint.async_mode={mode}"]
        proc = run_train(path, *args)
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: checkpoint step-3 could not be written to {dump}/checkpoint (0.")
        assert "MiB free on its file system" in line and line.endswith("complete checkpoints kept: step-1, step-2")
        assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1", "step-2"]  # no .tmp left
        assert assert_checkpoints_whole(dump) == [1, 2]
        moved = tmp_path / "moved"  # the disk made larger: the run goes on from step-2
        shutil.copytree(dump, moved)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    if mode == "sync":
        return
    straight = tmp_path / "straight"
    path_s, _ = write_config(tmp_path, "straight")
    assert run_train(path_s, *args).returncode == 0
    (tmp_path / "moved.toml").write_text(path_s.read_text().replace(str(straight), str(moved)))
    proc = run_train(tmp_path / "moved.toml", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming run {moved} from step 2" in proc.stdout
    assert losses(moved) == losses(straight)


class Forks:
    """tests/train_forks.py: training jobs forked from one process that has imported torch already."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.n = tmp_path, 0
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.train_forks"], cwd=REPO, env=env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def start(self, *args: str) -> tuple[int, Path]:
        """Fork a job; returns its pid and the file its stdout goes to."""
        self.n += 1
        out = self.tmp_path / f"job{self.n}.out"
        job = {"args": list(args), "stdout": str(out), "stderr": str(out.with_suffix(".err"))}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline()), out

    def exit_code(self) -> int:
        line = self.proc.stdout.readline()
        assert line.startswith("exit "), line
        return int(line.split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def wait_for_line(path: Path, needle: str, pid: int, timeout: float = 60) -> None:
    start = time.monotonic()
    while needle not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() - start < timeout and Path(f"/proc/{pid}").exists(), f"{needle!r} never came"
        time.sleep(0.005)


def test_job_killed_during_async_saves_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """Ten SIGKILLs of the whole job at random moments while async saves are being written (a save every step):
    after each, every folder named as a complete checkpoint loads and the next launch resumes from the newest; at the
    end the run's losses equal an uninterrupted run's, step for step."""
    path, dump = write_config(tmp_path)
    steps = 60
    args = ["--config", str(path), *CONSTANT_LR, f"--training.steps={steps}", "--checkpoint.interval=1",
            "--checkpoint.keep_latest_k=2", "--checkpoint.async_mode=async"]
    forks = Forks(tmp_path)
    rng = random.Random(0)
    hit_mid_write = 0
    try:
        newest = None
        for trial in range(10):
            pid, out = forks.start(*args)
            # once a first save of this launch is complete (the first one also sets the async writer up), any moment
            # is inside a save: one is written in the background of every step
            wait_for_line(out, "complete on disk", pid)
            time.sleep(rng.uniform(0.0, 0.3))
            os.killpg(pid, signal.SIGKILL)
            assert forks.exit_code() == -signal.SIGKILL, f"trial {trial}: the job ended before the kill"
            text = out.read_text()
            if newest is None:
                assert "starting fresh" in text
            else:
                assert f"resuming run {dump} from step {newest}" in text, text[-2000:]
            hit_mid_write += any(p.name.endswith(".tmp") for p in (dump / "checkpoint").iterdir())
            complete = assert_checkpoints_whole(dump)
            begun = {int(m) for m in re.findall(r"checkpoint step-(\d+): training blocked", text)}
            assert not complete or complete[-1] in begun | {newest}
            assert not newest or (complete and complete[-1] >= newest)  # a complete checkpoint is never lost
            newest = complete[-1] if complete else None
        pid, out = forks.start(*args)
        assert forks.exit_code() == 0, out.with_suffix(".err").read_text()[-3000:]
        assert f"resuming run {dump} from step {newest}" in out.read_text()

        _, straight = write_config(tmp_path, "straight")
        pid, out = forks.start(*args, f"--job.dump_folder={straight}", "--checkpoint.enable=false")
        assert forks.exit_code() == 0, out.with_suffix(".err").read_text()[-3000:]
    finally:
        forks.close()
    assert losses(dump) == losses(straight)
    print(f"{hit_mid_write} of 10 kills left a save half-written; the last one after step {newest}")
    assert hit_mid_write >= 3
