"""A launch says whether it resumes, lists the config changes it applies, refuses those it cannot take in one line,
keeps the previous config.toml, logs each step once in metrics.jsonl, and closes with a line naming its results."""

import pytest

from flame.checkpoint import check_resume_config
from flame.config import RunError, load_config, to_toml
from tests.helpers import TINY, read_metrics, run_train, write_config


def test_resume_lists_and_applies_changes_and_keeps_each_step_once(tmp_path):
    path, dump = write_config(tmp_path, "resumed")
    first = run_train(path, "--training.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.splitlines()[0] == f"starting fresh in {dump}"
    row = read_metrics(dump)[-1]
    assert first.stdout.splitlines()[-1] == (f"done: step 2 of 2 | loss {row['loss']:.4f} | {row['tokens_seen']:,} "
                                             f"tokens | run folder {dump} (config.toml, metrics.jsonl, "
                                             "checkpoint/step-2)")

    changed = ["--training.steps=4", "--optimizer.lr=2e-3"]
    proc = run_train(path, *changed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"resuming run {dump} from step 2"
    assert lines[1] == ("config changed since step 2 (applied): optimizer.lr: 0.001 in the checkpoint, 0.002 now; "
                        "training.steps: 2 in the checkpoint, 4 now")
    assert "get_last_lr" not in proc.stderr and "Warning" not in proc.stderr
    kept = load_config(dump / "config.step-2.toml")
    assert (kept.optimizer.lr, kept.training.steps) == (1e-3, 2)
    assert load_config(dump / "config.toml").optimizer.lr == 2e-3

    # the new lr and schedule hold from the first resumed step on: as in a run that had them from the start
    ref_path, ref_dump = write_config(tmp_path, "reference")
    assert run_train(ref_path, *changed).returncode == 0
    expected = {r["step"]: r["lr"] for r in read_metrics(ref_dump)}
    assert {r["step"]: r["lr"] for r in read_metrics(dump) if r["step"] > 2} == {3: expected[3], 4: expected[4]}

    # launched again from step 2 (as after a crash past the last checkpoint): steps 3 and 4 are logged once
    again = run_train(path, *changed, "--checkpoint.load_step=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(dump, "checkpoint_blocked_sec")] == [2, 4]

    # the model's shape cannot change: one line, exit 2, the run folder as it was
    before = (dump / "config.toml").read_text()
    bad = run_train(path, *changed, "--training.steps=6", "--model.hidden_size=32")
    assert bad.returncode == 2
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint {dump}/checkpoint/step-4: cannot resume with a changed "
                           "model.hidden_size: 64 in the checkpoint, 32 now")
    assert "--job.dump_folder" in line and "--checkpoint.resume=never" in line
    assert (dump / "config.toml").read_text() == before


def configs(**changes):
    """(saved TOML, this run's Config, its TOML) for the tiny config with `changes` (section__key=value) now."""
    saved = load_config_text(TINY.format(dump="/tmp/run"))
    now = load_config_text(TINY.format(dump="/tmp/run"), [f"--{k.replace('__', '.')}={v}" for k, v in changes.items()])
    return to_toml(saved), now, to_toml(now)


def load_config_text(text, overrides=()):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        return load_config(f.name, list(overrides))


@pytest.mark.parametrize("changes,allowed", [
    ({"optimizer__lr": 0.01, "lr_scheduler__warmup_steps": 3, "training__steps": 9, "metrics__log_freq": 2,
      "checkpoint__interval": 5, "training__max_norm": 0.5}, True),
    ({"training__seq_len": 64}, True),  # synthetic data: its position is global, any shape continues it
    ({"model__num_layers": 3}, False),
    ({"data__eos_token": '"<eos>"'}, False),
])
def test_which_changes_a_resume_takes(changes, allowed):
    saved, cfg, now = configs(**changes)
    if allowed:
        listed = check_resume_config(saved, cfg, now, "ckpt")
        assert sorted(c.split(":")[0] for c in listed) == sorted(k.replace("__", ".") for k in changes)
    else:
        key = next(iter(changes)).replace("__", ".")
        with pytest.raises(RunError, match=f"ckpt: cannot resume with a changed {key}"):
            check_resume_config(saved, cfg, now, "ckpt")


def test_text_data_layout_keys_need_data_state_restart():
    text = ['--data.synthetic=false', '--data.sources=[{path = "data/sample/eval/*.jsonl"}]']
    saved = to_toml(load_config_text(TINY.format(dump="/r"), text))
    for override, stops in (("--training.seq_len=64", True), ("--training.batch_size=2", True),
                            ("--optimizer.lr=0.01", False)):
        for data_state in ("strict", "restart"):
            cfg = load_config_text(TINY.format(dump="/r"), [*text, override, f"--checkpoint.data_state={data_state}"])
            if stops and data_state == "strict":
                with pytest.raises(RunError) as e:
                    check_resume_config(saved, cfg, to_toml(cfg), "ckpt")
                key = override[2:].split("=")[0]
                assert f"depend on {key}" in str(e.value) and "--checkpoint.data_state=restart" in str(e.value)
                assert "--job.dump_folder" in str(e.value) and "--checkpoint.resume=never" in str(e.value)
            else:
                assert check_resume_config(saved, cfg, to_toml(cfg), "ckpt")  # listed, applied


def test_text_run_resumes_with_a_new_seq_len_under_data_state_restart(tmp_path):
    from tests.helpers import REPO, SMALL_VOCAB

    dump = tmp_path / "text"
    args = [f"--job.dump_folder={dump}", *SMALL_VOCAB, "--validation.enable=false", "--data.num_workers=0",
            "--metrics.log_freq=1"]

    def run(*extra):
        return run_train(REPO / "configs/transformer_tiny.toml", *args, *extra)

    assert run("--training.steps=2", "--training.seq_len=64").returncode == 0
    proc = run("--training.steps=3", "--training.seq_len=32", "--checkpoint.data_state=restart")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training.seq_len: 64 in the checkpoint, 32 now" in proc.stdout
    assert "data streams restart from the beginning" in proc.stdout
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["tokens_seen"] - rows[1]["tokens_seen"] == 4 * 32  # the new shape from the first resumed step
