"""A non-finite loss or gradient norm skips the optimizer step, zeroes the gradients, is counted and logged, and
training continues; too many in a row stop the run with a message."""

import math

import pytest
import torch

import flame.models.layers as layers
from flame.config import load_config
from flame.train import Trainer
from tests.helpers import read_metrics, single_process, write_config  # noqa: F401 (a fixture)


def inject_nan_on_calls(monkeypatch, calls: set[int] | None):
    """Make the model's loss NaN on the given forward calls (1-based); None = every call."""
    real, count = layers.output_loss_sum, [0]  # the models' shared forward tail calls it

    def loss_sum(*args, **kwargs):
        count[0] += 1
        out = real(*args, **kwargs)
        return out * math.nan if calls is None or count[0] in calls else out

    monkeypatch.setattr(layers, "output_loss_sum", loss_sum)


def local_params(trainer):
    """The weights' shards (the state dict's: between steps one rank's modules hold the gathered copies)."""
    return {n: p.to_local().detach().clone() for n, p in trainer.model.state_dict().items()}


def adam_moments(trainer):
    return [s[k].to_local().clone() for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("fused", [True, False])  # the update skips itself on the device / the host checks first
def test_nan_step_leaves_parameters_and_optimizer_untouched(tmp_path, monkeypatch, single_process, fused):
    path, _ = write_config(tmp_path)
    trainer = Trainer(load_config(path, ["--training.steps=5", "--checkpoint.enable=false",
                                         f"--optimizer.fused={str(fused).lower()}"]))
    try:
        batch = lambda: [trainer.to_device(next(trainer.loader))]  # noqa: E731
        assert not trainer.train_step(batch()).read().skipped
        before, moments = local_params(trainer), adam_moments(trainer)
        inject_nan_on_calls(monkeypatch, None)
        result = trainer.train_step(batch()).read()
        assert result.skipped and math.isnan(result.loss)
        after = local_params(trainer)
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert all(torch.equal(a, b) for a, b in zip(moments, adam_moments(trainer)))
        assert all(p.grad is None for group in trainer.optimizer.param_groups for p in group["params"])
        assert all(int(s["step"]) == 1 for s in trainer.optimizer.state.values())  # Adam's count did not move
        monkeypatch.undo()
        result = trainer.train_step(batch()).read()
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


def test_nonfinite_state_is_never_saved(tmp_path, single_process):
    """A NaN in an optimizer moment (however it got there) stops the save with one line naming the tensor and the last
    good checkpoint; nothing of the step is written and the good checkpoint stays."""
    path, dump = write_config(tmp_path)
    trainer = Trainer(load_config(path, ["--training.steps=4", "--checkpoint.interval=2",
                                         "--checkpoint.keep_latest_k=1"]))
    try:
        for _ in range(2):
            trainer.train_step([trainer.to_device(next(trainer.loader))])
            trainer.step += 1
        trainer.save_checkpoint()
        trainer.train_step([trainer.to_device(next(trainer.loader))])
        trainer.step += 1
        trainer.model.state_dict()   # (reshards: the modules hold the optimizer's shards again, not gathered copies)
        name, param = next(iter(trainer.model.named_parameters()))
        trainer.optimizer.state[param]["exp_avg"].to_local().view(-1)[0] = math.nan
        with pytest.raises(RuntimeError) as raised:
            trainer.save_checkpoint()
        message = str(raised.value)
        assert "\n" not in message and message.startswith(f"step 3: not saved: non-finite values in optimizer.state.{name}"
                                                          ".exp_avg; ")
        assert f"last good checkpoint: {dump}/checkpoint/step-2;" in message
        assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    finally:
        trainer.close()


@pytest.mark.parametrize("skips", [1, 2])  # the last step's loss is NaN / two in a row reach max_consecutive_skips
def test_nonfinite_end_names_the_last_good_checkpoint(tmp_path, monkeypatch, single_process, skips):
    path, dump = write_config(tmp_path)
    inject_nan_on_calls(monkeypatch, {4} if skips == 1 else {3, 4})
    trainer = Trainer(load_config(path, ["--training.steps=4", "--checkpoint.interval=2",
                                         "--training.max_consecutive_skips=2"]))
    try:
        with pytest.raises(RuntimeError) as raised:
            trainer.train()
    finally:
        trainer.close()
    message = str(raised.value)
    assert "\n" not in message
    if skips == 1:  # step 4's update was skipped: its checkpoint holds step 3's finite weights
        assert message.startswith("the run ended on a non-finite loss (nan) at step 4, its update skipped; ")
        assert message.endswith(f"last good checkpoint: {dump}/checkpoint/step-4")
    else:
        assert message.startswith("stopping: 2 consecutive steps had a non-finite loss")
        assert f"last good checkpoint: {dump}/checkpoint/step-2;" in message
