"""Failures we can foresee at start-up are one line on stderr and exit code 2, never a traceback; check_config checks
any shipped config on any machine (data problems are warnings unless --strict); short runs of the tiny configs."""

import json
import logging
from pathlib import Path

import pytest
import zstandard

from flame.check_config import main as check_config
from flame.config import LRSchedulerConfig
from flame.data.config import SourceConfig
from flame.data.counters import Counters
from flame.data.sources import DocumentStream, plan_source
from tests.helpers import REPO, run_script, run_train, write_config

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def one_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    return line


def test_truncated_only_file_and_bad_init_from_are_one_line(tmp_path):
    docs = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(40)).encode()
    packed = zstandard.ZstdCompressor().compress(docs)
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(packed[: len(packed) // 2])
    proc = run_train(REPO / "configs/transformer_tiny.toml", f"--job.dump_folder={tmp_path / 'run'}",
                     "--validation.enable=false", "--training.seq_len=64", f'--data.sources=[{{path = "{cut}"}}]')
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors and all(line.startswith("data error: data.sources[0] (") and "found no usable document" in line
                          for line in errors)
    assert f"skipped (truncated_file) at {cut}" in proc.stderr  # the cause, said before

    path, dump = write_config(tmp_path)
    line = one_line(run_train(path, f"--checkpoint.init_from={tmp_path / 'missing'}"))
    missing = tmp_path / "missing"
    assert line == f"error: checkpoint.init_from = '{missing}': {missing}: no such file or folder"


def test_export_of_a_missing_folder_is_one_line(tmp_path):
    # flame.export's main as `python -m flame.export` runs it, in a process forked from the train_forks server
    proc = run_script("from flame.export import main; main()", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert one_line(proc) == f"error: {tmp_path / 'nothing'}: no such run folder"
    assert not (tmp_path / "out").exists()


def test_more_ranks_a_node_than_gpus_is_one_line(tmp_path):
    # torchrun's environment for rank 0 of two on a node whose one GPU the script makes torch report: without the
    # check, the second rank's torch.cuda.set_device fails with CUDA's "invalid device ordinal"
    script = ("import sys, torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; "
              "from flame.train import main; main(sys.argv[1:])")
    proc = run_script(script, "--config", str(REPO / "configs/transformer_tiny.toml"),
                      f"--job.dump_folder={tmp_path / 'run'}", extra=dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                                                                        LOCAL_WORLD_SIZE="2", CUDA_VISIBLE_DEVICES=""))
    assert one_line(proc) == ("error: 2 processes a node but 1 GPU(s) on this one: start one process a GPU (NGPU or "
                              "NPROC for scripts/launch.sh, --nproc-per-node for torchrun)")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_checks_on_this_machine(config, capsys):
    check_config(["--config", str(config)])  # returns: exit code 0
    out, err = capsys.readouterr()
    assert out.startswith("[job]")
    for line in err.splitlines():  # only data the machine lacks, as warnings
        assert line.startswith(f"warning: {config}: data.") and "--strict" in line


def test_check_config_strict_help_and_get(tmp_path, capsys):
    text = (REPO / "configs" / "transformer_tiny.toml").read_text()
    elsewhere = tmp_path / "cluster.toml"
    elsewhere.write_text(text.replace("data/sample/pile/*.jsonl.zst", str(tmp_path / "nowhere" / "*.jsonl.zst")))
    check_config(["--config", str(elsewhere), "--get", "training.steps"])
    out, err = capsys.readouterr()
    assert out == "60\n" and err.startswith(f"warning: {elsewhere}: data.sources[0].path: expected a glob")
    with pytest.raises(SystemExit) as e:
        check_config(["--config", str(elsewhere), "--strict"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith(f"config error: {elsewhere}: data.sources[0].path") and len(err.splitlines()) == 1
    check_config(["--config", str(elsewhere), "--no-data-check"])
    assert capsys.readouterr().err == ""
    check_config(["--help"])
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m flame.check_config --config FILE") and "--strict" in out and err == ""


def test_short_run_warms_up_over_its_steps(capsys):
    """warmup_steps above training.steps: the config is valid, and the schedule is the one of warmup = steps."""
    import torch
    from flame.optim import build_lr_scheduler

    check_config(["--config", "configs/rwkv7_tiny.toml", "--training.steps=3", "--get", "lr_scheduler.warmup_steps"])
    assert capsys.readouterr().out == "5\n"

    def lrs(warmup, steps):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = build_lr_scheduler(opt, LRSchedulerConfig(warmup_steps=warmup), steps)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    assert lrs(5, 3) == lrs(3, 3) and lrs(3, 3) != lrs(2, 3)


def test_a_bad_line_is_warned_about_once_then_counted(tmp_path, caplog):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "good one"}\n{"text": "unterminated\n{"text": "good two"}\n')
    plan = plan_source(SourceConfig(path=str(path)), "data.sources[0]", 0)
    counters = Counters()
    stream = DocumentStream(plan, reader=0, n_readers=1, seed=0, counters=counters)
    with caplog.at_level(logging.WARNING, logger="flame.data"):
        texts = [stream.next() for _ in range(8)]  # four passes over the file
    assert texts == ["good one", "good two"] * 4
    assert counters.values["skipped_bad_json"] == 4
    assert caplog.text.count(f"{path}:2") == 1
