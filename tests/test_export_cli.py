"""python -m flame.export as a user meets it: --help explains the arguments, the step written is printed, and the
exported files get the mode the umask gives every other file of the run folder (safetensors alone wrote 0600)."""

from __future__ import annotations

import stat
import subprocess
import sys

from tests.helpers import REPO, env, run_script, write_config

UMASK = 0o027  # group may read, others nothing: a shared project folder's usual setting

# `python -m flame.train ARGS` / `python -m flame.export ARGS` under the umask, as processes forked from one that has
# imported flame (helpers.run_script): main() is what the module runs as __main__
TRAIN = f"import os, sys; os.umask({UMASK}); from flame.train import main; main(sys.argv[1:])"
EXPORT = f"import os; os.umask({UMASK}); from flame.export import main; main()"


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def flame_export(*args: str) -> subprocess.CompletedProcess:
    return run_script(EXPORT, *args, timeout=120)


def test_help_explains_every_argument():
    # the module's command line itself, in a fresh process
    proc = subprocess.run([sys.executable, "-m", "flame.export", "--help"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for words in ("RUN_DIR", "OUT_DIR", "--step N", "newest complete checkpoint", "must not exist",
                  "model.safetensors", "tokenizer"):
        assert words in text, (words, proc.stdout)


def test_export_prints_its_step_and_files_follow_the_umask(tmp_path):
    path, dump = write_config(tmp_path)
    train = run_script(TRAIN, "--config", str(path), "--training.steps=2", "--checkpoint.interval=1")
    assert train.returncode == 0, train.stderr[-3000:]
    run_files = [dump / "metrics.jsonl", dump / "config.toml"]
    assert {mode(p) for p in run_files} == {0o666 & ~UMASK}   # what the umask gives the run's own files

    out = tmp_path / "exported"
    proc = flame_export(str(dump), str(out), "--step", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"exported step 1 of {dump} to {out}"), proc.stdout
    newest = flame_export(str(dump), str(tmp_path / "newest"))
    assert f"exported step 2 of {dump}" in newest.stdout, newest.stdout

    files = {p.name: mode(p) for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= set(files)
    assert set(files.values()) == {0o666 & ~UMASK}, files
    assert mode(out) == 0o777 & ~UMASK


    # a checkpoint whose bytes changed on disk is not exported: one line naming the file by its checksum
    (shard,) = (dump / "checkpoint" / "step-2").glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = flame_export(str(dump), str(tmp_path / "damaged"))
    assert damaged.returncode == 2 and not (tmp_path / "damaged").exists()
    (line,) = damaged.stderr.strip().splitlines()
    assert f"{shard}: checksum mismatch" in line, line
