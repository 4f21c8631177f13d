"""Stopping after a checkpoint and launching again continues the run exactly (model, optimizer, schedule, data)."""

from tests.helpers import read_metrics, run_train, write_config

CONSTANT_LR = ["--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_factor=1.0"]


def test_resume_continues_exactly(tmp_path):
    path, dump = write_config(tmp_path, "straight")
    assert run_train(path, "--training.steps=4", *CONSTANT_LR).returncode == 0
    straight = {r["step"]: r["loss"] for r in read_metrics(dump)}

    path, dump = write_config(tmp_path, "stopped")
    assert run_train(path, "--training.steps=2", *CONSTANT_LR).returncode == 0
    proc = run_train(path, "--training.steps=4", *CONSTANT_LR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 2" in proc.stdout
    resumed = {r["step"]: r["loss"] for r in read_metrics(dump)}
    assert resumed == straight


def test_resumed_run_continues_the_same_wandb_run(tmp_path):
    path, dump = write_config(tmp_path)
    wandb = ["--metrics.enable_wandb=true", "--metrics.wandb_mode=offline"]
    for steps in (1, 2):
        proc = run_train(path, f"--training.steps={steps}", *CONSTANT_LR, *wandb)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.name for p in (dump / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    assert len({name.rsplit("-", 1)[1] for name in runs}) == 1  # both folders carry one run id
