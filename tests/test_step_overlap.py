"""The host reads a step's loss, gradient norm and the ranks' stop flag while the device runs the next step, except
for the launch's first step and the steps that evaluate, save or end the run, whose weights the host reads before the
next update is queued. A stop signal is then seen one step later: the run finishes the step queued behind it, saves
that one, and resumes from it as if never stopped."""

import signal

from flame import stop_signals
from flame.config import load_config
from flame.train import QueuedStep, Trainer
from tests.helpers import REPO, SMALL_VOCAB, read_metrics, single_process, write_config  # noqa: F401 (a fixture)


def record_queue_and_read(trainer, monkeypatch) -> list[tuple]:
    """("queued", n, step) as step n's work is queued, ("read", n) as its results are read, in the order they
    happen."""
    events, queue, read = [], trainer.train_step, QueuedStep.read

    def train_step(micro_batches):
        queued = queue(micro_batches)
        events.append(("queued", queued.number, queued))
        return queued

    def read_step(self):
        events.append(("read", self.number))
        return read(self)

    monkeypatch.setattr(trainer, "train_step", train_step)
    monkeypatch.setattr(QueuedStep, "read", read_step)
    return events


def test_each_step_is_read_while_the_next_one_runs(tmp_path, monkeypatch, single_process):
    monkeypatch.chdir(REPO)
    dump = tmp_path / "run"
    trainer = Trainer(load_config("configs/transformer_tiny.toml", [
        *SMALL_VOCAB, f"--job.dump_folder={dump}", "--training.seq_len=32", "--training.steps=9",
        "--checkpoint.interval=4", "--checkpoint.keep_latest_k=0", "--validation.freq=6", "--validation.steps=1", "--metrics.log_freq=1",
        "--data.num_workers=0"]))
    try:
        events = record_queue_and_read(trainer, monkeypatch)
        trainer.train()
    finally:
        trainer.close()
    steps = {e[1]: e[2] for e in events if e[0] == "queued"}
    events = [e[:2] for e in events]
    read_at_once = {1, 4, 6, 8, 9}  # the first, the saves (4, 8), the evaluation (6), the last
    expected = []
    for n in range(1, 10):
        expected.append(("queued", n))
        if n > 1 and n - 1 not in read_at_once:
            expected.append(("read", n - 1))
        if n in read_at_once:
            expected.append(("read", n))
    assert events == expected
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 10))
    # a line's tokens/s: over the time from the end of the step before to the end of its own (the device's clock
    # on a GPU), whether the host read it at once or after queuing the next
    for r in rows[1:]:
        seconds = steps[r["step"]].seconds_since(steps[r["step"] - 1])
        assert abs(r["tokens_per_sec"] * seconds / (4 * 32) - 1) < 1e-9
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-4", "step-8", "step-9"]


def test_a_stop_signal_finishes_the_step_queued_behind_it(tmp_path, monkeypatch, capsys, single_process):
    path, dump = write_config(tmp_path)
    monkeypatch.setattr(stop_signals, "received", 0)
    trainer = Trainer(load_config(path, ["--training.steps=6"]))
    try:
        update = trainer.scheduler.step

        def update_then_signal():  # a signal that comes while step 3's work is being queued, after its update
            update()
            if trainer.next_step == 3:
                stop_signals.received = signal.SIGTERM

        monkeypatch.setattr(trainer.scheduler, "step", update_then_signal)
        trainer.train()  # step 3's flag carries it; step 3 is read once step 4 is queued
    finally:
        trainer.close()
    assert "stopped at step 4 on signal SIGTERM" in capsys.readouterr().out
    assert [p.name for p in (dump / "checkpoint").iterdir()] == ["step-4"]
    monkeypatch.undo()  # the trainer's read, and no signal
    monkeypatch.setattr(stop_signals, "received", 0)
    trainer = Trainer(load_config(path, ["--training.steps=6"]))
    try:
        assert trainer.step == 4
        trainer.train()
    finally:
        trainer.close()
    straight_path, straight_dump = write_config(tmp_path, "straight")
    trainer = Trainer(load_config(straight_path, ["--training.steps=6"]))
    try:
        trainer.train()
    finally:
        trainer.close()
    losses = lambda d: [(r["step"], r["loss"]) for r in read_metrics(d) if r["step"] > 4]  # noqa: E731
    assert losses(dump) == losses(straight_dump) and len(losses(dump)) == 2
