"""scripts/plot_metrics.py: the curves it reads from metrics.jsonl, and the PNG it writes."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from plot_metrics import read_run, time_unit  # noqa: E402


def write_metrics(path, lines):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def train_line(step, loss, tokens_per_step=1024, sec_per_step=10.0):
    return dict(step=step, loss=loss, lr=1e-3 * step, grad_norm=1.0 / step, tokens_per_sec=5000.0 + step,
                tokens_seen=step * tokens_per_step, elapsed_sec=sec_per_step * step)


def test_read_run_keeps_the_last_line_of_a_step_and_scales_x_to_tokens(tmp_path):
    lines = [train_line(1, 5.0), train_line(2, 4.0), dict(step=2, eval_loss=4.5), train_line(3, 9.9),
             train_line(3, 3.0), train_line(4, 2.5)]   # step 3 logged twice: a resumed run, the later line wins
    run = write_metrics(tmp_path / "run", lines)
    curves, val = read_run(run, "tokens")
    assert curves["loss"] == [(1024, 5.0), (2048, 4.0), (3072, 3.0), (4096, 2.5)]
    assert curves["lr"] == [(1024 * s, 1e-3 * s) for s in (1, 2, 3, 4)]
    assert val == [(2048, 4.5)]
    curves, val = read_run(run, "step")
    assert [x for x, _ in curves["grad_norm"]] == [1, 2, 3, 4] and val == [(2, 4.5)]


def test_plots_several_runs_into_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_metrics(tmp_path / "a", [train_line(s, 5.0 / s) for s in range(1, 8)] + [dict(step=7, eval_loss=1.0)])
    b = write_metrics(tmp_path / "b", [train_line(s, 6.0 / s, 2048) for s in range(1, 5)])
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(a), f"other={b}", "-o",
                           str(out), "--x", "step"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_run_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(tmp_path / "nope"), "-o",
                           str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no metrics.jsonl" in proc.stderr


def test_x_time_is_each_line_s_elapsed_seconds(tmp_path):
    lines = [train_line(1, 5.0), train_line(2, 4.0), dict(step=2, eval_loss=4.5, elapsed_sec=23.5),
             train_line(3, 3.0, sec_per_step=11.0)]
    curves, val = read_run(write_metrics(tmp_path / "run", lines), "time")
    assert curves["loss"] == [(10.0, 5.0), (20.0, 4.0), (33.0, 3.0)]
    assert val == [(23.5, 4.5)]   # the validation line's own time, not its step's


def test_time_unit_follows_the_longest_run():
    assert time_unit(90.0) == (1.0, "seconds")
    assert time_unit(600.0) == (60.0, "minutes")
    assert time_unit(3 * 3600.0) == (3600.0, "hours")


def test_x_time_without_elapsed_is_one_line_and_exit_2(tmp_path):
    old = write_metrics(tmp_path / "old", [{k: v for k, v in train_line(s, 1.0).items() if k != "elapsed_sec"}
                                           for s in (1, 2)])
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(old), "-o",
                           str(tmp_path / "x.png"), "--x", "time"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "elapsed_sec" in proc.stderr and "--x tokens" in proc.stderr
