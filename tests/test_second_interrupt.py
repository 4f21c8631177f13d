"""The second Ctrl-C through scripts/launch.sh on CPU: the first asks the run to stop after its step with a checkpoint,
a second one before that step ends stops at once: exit 130, no complete checkpoint, no process of the run left."""

import os
import signal
import subprocess
import time
from pathlib import Path

from flame.checkpoint import complete_steps
from tests.helpers import REPO, env, read_metrics, run_processes, wait_for_step

# transformer_tiny on the bundled sample text, one rank with its 2 data workers, with steps long enough (about 1 s on
# a free core, 2-3 s on this shared 2-core machine: the head over a 50k vocabulary on 2048 tokens) that the second
# Ctrl-C lands inside the step that the first one asked to finish
ARGS = ["--training.seq_len=512", "--training.batch_size=4", "--validation.enable=false", "--metrics.log_freq=1",
        "--checkpoint.interval=1000", "--checkpoint.keep_latest_k=0", "--lr_scheduler.warmup_steps=0",
        "--training.steps=1000"]


def launcher_state(proc, out):
    """What a failure shows: the run's stdout tail and the launcher's state and signal masks (/proc: a SIGINT that
    bash ignores, blocks or has pending)."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        keys = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        masks = [line for line in status if line.startswith(keys)]
    except OSError:
        masks = ["(launcher gone)"]
    return f"stdout: {out.read_text()[-1500:]}\nlauncher: {masks}"


def wait_for_line(path, text, proc, out, timeout=30):
    start = time.time()
    while text not in path.read_text():
        assert proc.poll() is None and time.time() - start < timeout, (
            f"stderr: {path.read_text()[-1500:]}\n{launcher_state(proc, out)}")
        time.sleep(0.02)


def test_second_ctrl_c_stops_at_once_saving_nothing(tmp_path):
    dump, out, err = tmp_path / "run", tmp_path / "stdout", tmp_path / "stderr"
    cmd = ["bash", "scripts/launch.sh", "configs/transformer_tiny.toml", f"--job.dump_folder={dump}", *ARGS]
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(extra=dict(NPROC="1")), stdout=stdout, stderr=stderr,
                                start_new_session=True)
    try:
        wait_for_step(dump, proc, 1)   # step 1 logged: step 2 has just begun
        os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C in a terminal: the launcher's whole process group
        wait_for_line(err, "stopping after the steps under way, with a checkpoint", proc, out)
        time.sleep(0.3)   # the launcher has forwarded it to the rank, whose step 2 is still running
        assert proc.poll() is None and len(run_processes(dump)) >= 5   # launcher, torchrun, rank, 2 data workers
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert "launch: stopped at once, nothing saved" in err.read_text()
    assert "stopped at step" not in out.read_text()   # the rank never reached its orderly stop
    assert "Traceback" not in out.read_text() + err.read_text()
    assert max(r["step"] for r in read_metrics(dump)) == 1   # the second Ctrl-C came before step 2 ended
    # no complete checkpoint: a step-N.tmp of a save cut short may be left, which resuming never loads
    folder = dump / "checkpoint"
    assert complete_steps(folder) == []
    assert all(p.name.endswith(".tmp") for p in folder.iterdir()) if folder.exists() else True
    # torchrun, the rank and its data workers end with the launcher (flame.lifeline)
    start = time.time()
    while left := run_processes(dump):
        assert time.time() - start < 20, f"still running after the launcher exited: {sorted(left)}"
        time.sleep(0.1)
