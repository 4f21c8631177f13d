"""Wall-clock time in what a run logs: every metrics.jsonl row carries `time` (Unix seconds) and `elapsed_sec` (the
run's training time, summed over launches), console step lines begin with the local date and time, and
scripts/plot_metrics.py --x time plots a real run folder against it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime

from tests.helpers import REPO, read_metrics, run_train, write_config

CLOCK = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) step +(\d+) \| (loss|eval loss) ")


def test_rows_carry_time_and_a_resume_continues_the_elapsed_clock(tmp_path):
    path, dump = write_config(tmp_path)
    before = time.time()
    first = run_train(path, "--training.steps=3")
    between = time.time()
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_metrics(dump, "time")
    assert len(rows) == len(read_metrics(dump, "step"))   # every row: training steps, checkpoint and start-up lines
    assert {"loss", "checkpoint_blocked_sec", "time_to_first_step_sec"} <= {k for r in rows for k in r}
    assert all(before <= r["time"] <= between for r in rows)
    train = read_metrics(dump)
    assert [r["step"] for r in train] == [1, 2, 3]
    elapsed = [r["elapsed_sec"] for r in train]
    assert 0 < elapsed[0] <= elapsed[1] <= elapsed[2] < between - before  # (a step's row may follow the last at once)
    # each step's elapsed grows by the wall time between its row and the one before
    for a, b in zip(train, train[1:]):
        assert abs((b["elapsed_sec"] - a["elapsed_sec"]) - (b["time"] - a["time"])) < 0.05

    lines = [m for m in map(CLOCK.match, first.stdout.splitlines()) if m]
    assert [int(m.group(2)) for m in lines if m.group(3) == "loss"] == [1, 2, 3], first.stdout
    for m in lines:
        shown = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        assert before - 1 <= shown <= between + 1

    time.sleep(2)   # time between launches: not training time
    last_kept = max(r["elapsed_sec"] for r in read_metrics(dump, "elapsed_sec"))
    second = run_train(path, "--training.steps=5")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = [r for r in read_metrics(dump) if r["step"] > 3]
    assert [r["step"] for r in resumed] == [4, 5]
    assert last_kept < resumed[0]["elapsed_sec"] < resumed[1]["elapsed_sec"]
    step3 = next(r for r in read_metrics(dump) if r["step"] == 3)
    gap = resumed[0]["elapsed_sec"] - step3["elapsed_sec"]
    assert gap < resumed[0]["time"] - step3["time"] - 2   # the pause and the second start-up are left out

    out = tmp_path / "time.png"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(dump), "-o", str(out),
                           "--x", "time"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
