"""A non-finite loss or gradient norm skips the optimizer step, zeroes the gradients, is counted and logged, and
training continues; too many in a row stop the run with a message."""

import math
import os

import pytest
import torch

import flame.models.layers as layers
from flame.config import load_config
from flame.train import Trainer
from tests.helpers import read_metrics, write_config

DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single_process(monkeypatch):
    """An in-process job of one rank; the env variables it sets are removed afterwards."""
    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    for k in DIST_ENV:
        os.environ.pop(k, None)


def inject_nan_on_calls(monkeypatch, calls: set[int] | None):
    """Make the model's loss NaN on the given forward calls (1-based); None = every call."""
    real, count = layers.output_loss_sum, [0]  # the models' shared forward tail calls it

    def loss_sum(*args, **kwargs):
        count[0] += 1
        out = real(*args, **kwargs)
        return out * math.nan if calls is None or count[0] in calls else out

    monkeypatch.setattr(layers, "output_loss_sum", loss_sum)


def local_params(trainer):
    return {n: p.to_local().detach().clone() for n, p in trainer.model.named_parameters()}


def adam_moments(trainer):
    return [s[k].to_local().clone() for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("fused", [True, False])  # the update skips itself on the device / the host checks first
def test_nan_step_leaves_parameters_and_optimizer_untouched(tmp_path, monkeypatch, single_process, fused):
    path, _ = write_config(tmp_path)
    trainer = Trainer(load_config(path, ["--training.steps=5", "--checkpoint.enable=false",
                                         f"--optimizer.fused={str(fused).lower()}"]))
    try:
        batch = lambda: [trainer.to_device(next(trainer.loader))]  # noqa: E731
        assert not trainer.train_step(batch()).skipped
        before, moments = local_params(trainer), adam_moments(trainer)
        inject_nan_on_calls(monkeypatch, None)
        result = trainer.train_step(batch())
        assert result.skipped and math.isnan(result.loss)
        after = local_params(trainer)
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert all(torch.equal(a, b) for a, b in zip(moments, adam_moments(trainer)))
        assert all(p.grad is None for p in trainer.model.parameters())
        assert all(int(s["step"]) == 1 for s in trainer.optimizer.state.values())  # Adam's count did not move
        monkeypatch.undo()
        result = trainer.train_step(batch())
        assert not result.skipped and math.isfinite(result.loss)
        assert any(not torch.equal(before[n], p) for n, p in local_params(trainer).items())
    finally:
        trainer.close()


def test_loop_counts_skip_and_continues(tmp_path, monkeypatch, single_process):
    path, dump = write_config(tmp_path)
    inject_nan_on_calls(monkeypatch, {3})
    trainer = Trainer(load_config(path, ["--training.steps=6", "--checkpoint.enable=false",
                                         "--metrics.log_freq=2"]))
    try:
        trainer.train()
    finally:
        trainer.close()
    records = {r["step"]: r for r in read_metrics(dump)}
    assert sorted(records) == [2, 3, 4, 6]  # the skipped step is logged even off the log frequency
    assert math.isnan(records[3]["loss"]) and records[3]["skipped_steps"] == 1
    assert records[6]["skipped_steps"] == 1 and math.isfinite(records[6]["loss"])


def test_consecutive_skips_stop_the_run(tmp_path, monkeypatch, single_process):
    path, _ = write_config(tmp_path)
    inject_nan_on_calls(monkeypatch, None)
    trainer = Trainer(load_config(path, ["--training.steps=6", "--checkpoint.enable=false",
                                         "--training.max_consecutive_skips=2"]))
    try:
        with pytest.raises(RuntimeError, match="2 consecutive steps had a non-finite loss"):
            trainer.train()
        assert trainer.step == 2
    finally:
        trainer.close()
