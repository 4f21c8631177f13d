"""A damaged checkpoint (truncated shard file, garbled .metadata, random bytes over a model tensor, an optimizer
moment or the .metadata, NaN written into a moment): resume = auto names the file, falls back to the previous complete
checkpoint, says so, and continues exactly as the uninterrupted run; the damaged folder is left as it is, and kept
aside when the run saves that step again; an explicit load_step of it stops with one line, exit 2. A checkpoint
written without checksums (an older flame) still resumes, and one holding NaN stops with one line."""

import io
import random
import shutil
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flame.checkpoint import CHECKSUMS, unreadable_file
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


def largest_tensor(step_dir, fqn_test):
    """(file, offset, length) of the raw values of the largest stored tensor whose name passes fqn_test: inside the
    item DCP wrote with torch.save, so that bytes written there still load."""
    storage = dcp.FileSystemReader(str(step_dir)).read_metadata().storage_data
    index, info = max(((i, s) for i, s in storage.items() if fqn_test(i.fqn)), key=lambda kv: kv[1].length)
    file = step_dir / info.relative_path
    item = file.read_bytes()[info.offset:info.offset + info.length]
    values = torch.load(io.BytesIO(item)).numpy().tobytes()
    return file, info.offset + item.index(values), len(values)


def overwrite(file, offset, data):
    """Bytes over part of a file, its size unchanged (so it still loads)."""
    content = bytearray(file.read_bytes())
    content[offset:offset + len(data)] = data
    file.write_bytes(bytes(content))


def damage_checkpoint(step_dir, damage):
    """Damage a checkpoint folder as named; returns the file damaged."""
    noise = random.Random(damage).randbytes(8192)
    if damage == "truncated shard":
        (file,) = step_dir.glob("*.distcp")
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    elif damage == "garbled metadata":
        file = step_dir / ".metadata"
        data = bytearray(file.read_bytes())
        data[: len(data) // 2] = b"\x07" * (len(data) // 2)
        file.write_bytes(bytes(data))
    elif damage == "random bytes in the metadata":
        file = step_dir / ".metadata"
        overwrite(file, file.stat().st_size // 3, noise[: file.stat().st_size // 3])
    elif damage == "random bytes in a model tensor":
        file, offset, length = largest_tensor(step_dir, lambda fqn: fqn.startswith("model."))
        overwrite(file, offset, noise[:length])
    elif damage == "random bytes in an optimizer moment":
        file, offset, length = largest_tensor(step_dir, lambda fqn: fqn.endswith("exp_avg_sq"))
        overwrite(file, offset, noise[:length])
    else:  # NaN in a moment: finite before, the optimizer's first step would turn the weights into NaN
        file, offset, length = largest_tensor(step_dir, lambda fqn: fqn.endswith(".exp_avg"))
        overwrite(file, offset, struct.pack("<f", float("nan")) * min(64, length // 4))
    return file


def damaged_copy(tmp_path, straight, damage):
    """A copy of the straight run with its step-4 damaged; returns (config path, run folder, the damaged file)."""
    path, dump = write_config(tmp_path)
    shutil.copytree(straight, dump)
    return path, dump, damage_checkpoint(dump / "checkpoint" / "step-4", damage)


@pytest.mark.parametrize("damage", ["random bytes in the metadata", "random bytes in a model tensor",
                                    "random bytes in an optimizer moment"])
def test_checksums_name_the_damaged_file(tmp_path, straight, damage):
    shutil.copytree(straight / "checkpoint" / "step-4", tmp_path / "step-4")
    file = damage_checkpoint(tmp_path / "step-4", damage)
    problem = unreadable_file(tmp_path / "step-4")
    assert problem.startswith(f"{file}: checksum mismatch (xxh3 "), problem
    # the shard files are shared out between ranks: the damaged one is found by the rank whose share holds it
    if file.name != ".metadata":
        assert [unreadable_file(tmp_path / "step-4", share=(rank, 2)) is None for rank in (0, 1)] == [False, True]


@pytest.mark.parametrize("damage", ["truncated shard", "garbled metadata", "NaN in a moment"])
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
    assert unreadable_file(dump / "checkpoint" / "step-4") is None  # its checksums match
    assert all(t.isfinite().all() for step in (2, 4) for part in ("model", "optimizer")
               for t in tensors(read_checkpoint(dump, step)[part]))


def tensors(tree):
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) and tree.is_floating_point() else []


def without_checksums(tmp_path, straight, damage=None):
    """A copy of the straight run as an older flame wrote it (no checksums.json), its step-4 damaged if asked."""
    path, dump = write_config(tmp_path)
    shutil.copytree(straight, dump)
    for step in (2, 4):
        (dump / "checkpoint" / f"step-{step}" / CHECKSUMS).unlink()
    if damage:
        damage_checkpoint(dump / "checkpoint" / "step-4", damage)
    return path, dump


def test_checkpoint_without_checksums_resumes(tmp_path, straight):
    path, dump = without_checksums(tmp_path, straight)
    proc = run_train(path, *ARGS[:-3], "--training.steps=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint step-4: written without checksums (an older flame)" in proc.stdout
    assert f"resuming run {dump} from step 4" in proc.stdout
    assert unreadable_file(dump / "checkpoint" / "step-5") is None and (dump / "checkpoint" / "step-5" / CHECKSUMS).is_file()


def test_nan_in_a_checkpoint_without_checksums_stops_with_one_line(tmp_path, straight):
    path, dump = without_checksums(tmp_path, straight, "NaN in a moment")
    before = sorted(p.name for p in (dump / "checkpoint").iterdir())
    proc = run_train(path, *ARGS[:-3], "--training.steps=6")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint {dump}/checkpoint/step-4 holds non-finite values (optimizer.state.")
    assert line.endswith("left as it is; resume from an earlier one with --checkpoint.load_step=2 (complete: step-2)")
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == before  # nothing saved, nothing pruned
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]  # not a step trained

    proc = run_train(path, *ARGS[:-3], "--training.steps=6", "--checkpoint.load_step=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(dump)][-2:] == [5, 6]


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


@pytest.mark.gpu
def test_async_saves_from_the_gpu_record_checksums_that_catch_damage(tmp_path):
    """The GPU path: async saves staged through the pinned CPU copy hash their files in the background thread."""
    path, dump = write_config(tmp_path)
    proc = run_train(path, *ARGS, "--checkpoint.async_mode=async")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 ranks on cuda" in proc.stdout and "(async, written in the background)" in proc.stdout
    for step in (2, 4):
        assert (dump / "checkpoint" / f"step-{step}" / CHECKSUMS).is_file()
        assert unreadable_file(dump / "checkpoint" / f"step-{step}") is None
    file = damage_checkpoint(dump / "checkpoint" / "step-4", "NaN in a moment")
    proc = run_train(path, *ARGS, "--checkpoint.async_mode=async")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{file}: checksum mismatch" in proc.stdout and "resuming from step-2 instead" in proc.stdout
    assert unreadable_file(dump / "checkpoint" / "step-4") is None
