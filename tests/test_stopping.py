"""Stopping a run the way a user expects, through scripts/launch.sh on CPU: Ctrl-C saves and exits 0 (no traceback)
and the run resumes from there; killing the launcher's process group with SIGKILL leaves no trainer or data worker;
one run per run folder (a second launch stops with exit 2 naming the holder; a lock left by a dead run is taken)."""

import os
import signal
import socket
import subprocess
import time

import pytest

from flame.config import RunError
from flame.run_lock import LOCK_NAME, lock_run_folder
from tests.helpers import REPO, SMALL_VOCAB, env, last_step, run_processes, run_train, wait_for_step, write_config

# the tiny default config on the bundled sample text (512-token vocabulary): one rank with its 2 data workers, a step
# every moment
ARGS = [*SMALL_VOCAB, "--training.seq_len=32", "--training.batch_size=2", "--validation.enable=false", "--metrics.log_freq=1",
        "--checkpoint.interval=1000", "--checkpoint.keep_latest_k=0", "--lr_scheduler.warmup_steps=0",
        "--training.steps=100000"]


def launch(dump, started, *overrides):
    """scripts/launch.sh in a session of its own, added to `started` (the launches fixture's list)."""
    cmd = ["bash", "scripts/launch.sh", "configs/transformer_tiny.toml", f"--job.dump_folder={dump}", *ARGS,
           *overrides]
    started.append(subprocess.Popen(cmd, cwd=REPO, env=env(extra=dict(NPROC="1")), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True))
    return started[-1]


@pytest.fixture
def launches():
    """The launches a test starts; any still running when it ends (an assertion failed half-way) is killed with its
    process group, so that a 100000-step run never outlives its test."""
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_ctrl_c_saves_resumes_one_run_per_folder_sigkill_leaves_nothing(tmp_path, capsys, launches):
    dump = tmp_path / "run"
    first = launch(dump, launches)
    wait_for_step(dump, first, 2)

    # a second launch on the folder in use stops at once: exit 2, one line naming the holder (rank 0 of the first)
    host, pid = (dump / LOCK_NAME).read_text().split()
    assert host == socket.gethostname() and int(pid) in run_processes(dump)
    second = launch(dump, launches)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, err[-3000:]
    assert err.strip().splitlines() == [err.strip()] and f"host {host}, pid {pid}" in err and "in use" in err
    step = last_step(dump)
    wait_for_step(dump, first, step + 1)  # the first run goes on undisturbed

    # Ctrl-C in a terminal: SIGINT to the launcher's whole process group
    os.killpg(first.pid, signal.SIGINT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err
    stopped = [line for line in out.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and "on signal SIGINT" in stopped[0]
    saved = last_step(dump)
    assert f"stopped at step {saved} " in stopped[0]
    assert [p.name for p in (dump / "checkpoint").iterdir()] == [f"step-{saved}"]
    assert (dump / LOCK_NAME).read_text() == ""  # released

    # launched again, it resumes from the checkpoint; then SIGKILL of its process group ends every process of it
    resumed = launch(dump, launches)
    wait_for_step(dump, resumed, saved + 1)
    assert len(run_processes(dump)) >= 5  # launcher, torchrun, rank, 2 data workers
    os.killpg(resumed.pid, signal.SIGKILL)
    out, _ = resumed.communicate(timeout=60)
    assert f"resumed from step {saved}" in out or f"resuming run {dump} from step {saved}" in out
    assert "took over" not in out  # the lock was released cleanly
    start = time.time()
    while left := run_processes(dump):
        assert time.time() - start < 20, f"still running after the launcher was killed: {sorted(left)}"
        time.sleep(0.1)

    # the killed run's lock file names a dead process: the launcher's check lets a new run in, which takes it over
    dead_pid = (dump / LOCK_NAME).read_text().split()[1]
    check = subprocess.run(["python3", "-m", "flame.run_lock", str(dump)], cwd=REPO, env=env(), capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    capsys.readouterr()
    lock = lock_run_folder(dump, rank=0)
    assert f"took over the lock left by host {host}, pid {dead_pid}" in capsys.readouterr().out
    assert (dump / LOCK_NAME).read_text().split() == [socket.gethostname(), str(os.getpid())]
    lock.release()


def test_run_lock_held_by_another_process_stops_every_rank_with_its_name(tmp_path):
    path, dump = write_config(tmp_path)
    hold = ("import sys, time; from pathlib import Path; from flame.run_lock import lock_run_folder; "
            "lock = lock_run_folder(Path(sys.argv[1]), 0); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen(["python3", "-c", hold, str(dump)], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match=f"in use by another run \\(host {socket.gethostname()}, pid {holder.pid}"):
            lock_run_folder(dump, rank=0)
        check = subprocess.run(["python3", "-m", "flame.run_lock", str(dump)], cwd=REPO, env=env(),
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 2 and check.stderr.count("\n") == 1 and f"pid {holder.pid}" in check.stderr
        # two ranks started past the launcher's check: rank 0 cannot take the lock, both stop (no hang)
        proc = run_train(path, nproc=2, timeout=120)
        assert proc.returncode != 0 and f"pid {holder.pid}" in proc.stderr
        assert not (dump / "checkpoint").exists()
    finally:
        holder.kill()
        holder.wait()
    lock = lock_run_folder(dump, rank=0)  # the holder is gone: the lock is free again
    lock.release()


ENDING_HOLDER = """
import os, sys, time
from pathlib import Path
from flame.run_lock import RunLock
lock = RunLock(Path(sys.argv[1]))
assert lock.acquire()[0]
lock.write_holder()
if os.fork() == 0:       # a data worker: it inherits the lock's file and outlives the rank by a moment
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1), os.dup2(null, 2)   # (not the test's pipes, which it would hold open as long)
    time.sleep(float(sys.argv[2]))
    os._exit(0)
print("held", flush=True)
os._exit(0)              # the rank (the named holder) is gone at once
"""


def test_a_lock_held_only_by_an_ending_run_is_waited_for_not_reported(tmp_path):
    # A run killed a moment ago: its rank (named in the lock file) is gone, a forked worker still holds the lock's
    # file while it exits. The launcher's check waits for it instead of calling the folder in use.
    proc = subprocess.run(["python3", "-c", ENDING_HOLDER, str(tmp_path), "1.5"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "held", proc.stderr
    start = time.monotonic()
    check = subprocess.run(["python3", "-m", "flame.run_lock", str(tmp_path)], cwd=REPO, env=env(),
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert time.monotonic() - start < 10   # the worker's 1.5 s, not the whole wait
