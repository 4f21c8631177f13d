"""Before its first logged step a run says what it is doing, with the time, and keeps saying so while a stage lasts."""

import re
import time

from flame.startup import StartupReport
from tests.helpers import run_train, write_config

CLOCK = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def test_a_long_stage_is_reported_until_done():
    lines = []
    report = StartupReport(time.perf_counter(), say=lines.append, every=0.05)
    report.stage("compiling")
    time.sleep(0.3)
    report.stage("loading")
    report.done()
    n = len(lines)
    time.sleep(0.2)
    assert len(lines) == n  # nothing after done()
    assert re.fullmatch(CLOCK + r" start-up: compiling \(0 s since launch\)", lines[0])
    still = [line for line in lines if "still compiling" in line]
    assert len(still) >= 2 and all(re.fullmatch(CLOCK + r" start-up: still compiling, 0 s so far \(0 s since "
                                                r"launch\)", line) for line in still)
    assert lines[-1].endswith("start-up: loading (0 s since launch)")


def test_quiet_ranks_say_nothing():
    report = StartupReport(time.perf_counter(), say=None, every=0.01)
    report.stage("compiling")
    report.done()
    assert report.ticker is None


def test_a_run_names_its_start_up_stages(tmp_path):
    path, _ = write_config(tmp_path)
    proc = run_train(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = [re.sub(r" \(\d+ s since launch\)$", "", line.split("start-up: ", 1)[1])
              for line in proc.stdout.splitlines() if "start-up: " in line]
    assert stages == ["building the model (transformer) on cpu", "building the optimizer and the data loader",
                      "the first step"]
