"""A damaged checkpoint (truncated shard file, garbled .metadata): resume = auto names the file, falls back to the
previous complete checkpoint, says so, and continues exactly as the uninterrupted run; the damaged folder is left as
it is, and kept aside when the run saves that step again; an explicit load_step of it stops with one line, exit 2."""

import shutil

import pytest

from flame.checkpoint import unreadable_file
from tests.helpers import read_checkpoint, read_metrics, run_train, write_config

ARGS = ["--training.steps=4", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0",
        "--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_factor=1.0"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 4-step run, saving at steps 2 and 4."""
    path, dump = write_config(tmp_path_factory.mktemp("straight"))
    proc = run_train(path, *ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump


def damaged_copy(tmp_path, straight, damage):
    """A copy of the straight run with its step-4 damaged; returns (config path, run folder, the damaged file)."""
    path, dump = write_config(tmp_path)
    shutil.copytree(straight, dump)
    step4 = dump / "checkpoint" / "step-4"
    if damage == "truncated shard":
        (file,) = step4.glob("*.distcp")
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    else:
        file = step4 / ".metadata"
        data = bytearray(file.read_bytes())
        data[: len(data) // 2] = b"\x07" * (len(data) // 2)
        file.write_bytes(bytes(data))
    return path, dump, file


@pytest.mark.parametrize("damage", ["truncated shard", "garbled metadata"])
def test_auto_resume_falls_back_to_the_previous_checkpoint(tmp_path, straight, damage):
    path, dump, file = damaged_copy(tmp_path, straight, damage)
    damaged_bytes = file.read_bytes()
    assert unreadable_file(dump / "checkpoint" / "step-2") is None
    assert unreadable_file(dump / "checkpoint" / "step-4").startswith(f"{file}: ")

    proc = run_train(path, *ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if "cannot be loaded" in line]
    assert line.startswith(f"checkpoint {dump}/checkpoint/step-4 cannot be loaded (left as it is): {file}: ")
    assert line.endswith("; resuming from step-2 instead")
    assert f"resuming run {dump} from step 2" in proc.stdout and "Traceback" not in proc.stderr

    expected = {r["step"]: r["loss"] for r in read_metrics(straight)}
    got = read_metrics(dump)
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # steps 3 and 4 logged again, once, by the resumed run
    assert {r["step"]: r["loss"] for r in got} == expected  # bit for bit

    # the new step-4 is whole and holds the straight run's weights; the damaged one is kept aside, unchanged
    assert "kept as step-4.unreadable" in proc.stdout
    assert (dump / "checkpoint" / "step-4.unreadable" / file.name).read_bytes() == damaged_bytes
    a, b = read_checkpoint(dump, 4)["model"], read_checkpoint(straight, 4)["model"]
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_explicit_load_step_of_a_damaged_checkpoint_stops(tmp_path, straight):
    path, dump, file = damaged_copy(tmp_path, straight, "truncated shard")
    proc = run_train(path, *ARGS, "--checkpoint.load_step=4")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint.load_step=4: checkpoint {dump}/checkpoint/step-4 cannot be loaded: "
                           f"{file}: truncated")
    assert (dump / "checkpoint" / "step-4" / file.name).stat().st_size == len(file.read_bytes())  # untouched

    # with every checkpoint damaged, resume = auto names each and stops
    (dump / "checkpoint" / "step-2" / ".metadata").unlink()
    proc = run_train(path, *ARGS)
    assert proc.returncode == 2
    assert "step-4 cannot be loaded (left as it is)" in proc.stdout and "trying step-2 instead" in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint {dump}/checkpoint/step-2 cannot be loaded (left as it is): "
                           f"{dump}/checkpoint/step-2/.metadata: ")
    assert "no complete checkpoint" in line
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-4"]
