"""Entry point: `python -m flame.train --config FILE [--section.key=value ...]` (under torchrun for several ranks).

Builds everything in Trainer.__init__, then runs a plain loop. The training step (Trainer.train_step) is the one
place where the loss is normalized: sum of token losses / number of target tokens in the whole global batch.
"""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STARTED = time.perf_counter()
"""When this process began running flame.train, before torch is imported: the origin of time_to_first_step_sec."""

if __name__ == "__main__":  # a rank starting up: before the slow imports, end with the launcher, keep stop signals
    from flame import lifeline, stop_signals

    lifeline.die_with_launcher()
    stop_signals.install()

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flame import stop_signals
from flame.checkpoint import (DATA_BOUND, WAYS_OUT, Checkpointer, check_compatible, check_resume_config,
                              complete_steps, flat_config, nonfinite_tensors, rng_state, set_rng_state, some_of)
from flame.config import Config, ConfigError, RunError, load_config, parse_config_args, resolve_dp_degrees, to_toml
from flame.context_parallel import enable as enable_context_parallel
from flame.context_parallel import split_batch
from flame.data import NoDocumentError, build_train_loader, check_sources
from flame.convert import load_init_weights
from flame.export import ConvertError
from flame.grad_clip import clip_grad_norm_
from flame.heartbeat import Heartbeat, RankMissing, is_collective_failure
from flame.loss import count_targets
from flame.metrics import MetricsLogger, warn
from flame.models import build_model
from flame.optim import build_lr_scheduler, build_optimizer, restore_lr_schedule
from flame.parallel import all_reduce_sum, init_distributed, keep_gathered_parameters, parallelize
from flame.profiling import StepProfiler
from flame.run_lock import lock_run_folder
from flame.startup import StartupReport


@dataclass
class StepResult:
    loss: float
    """Mean loss over every target token of the global batch."""
    grad_norm: float
    target_tokens: int
    """Target (non-ignored) tokens in the global batch."""
    skipped: bool
    stop_signal: int
    """The first stop signal any rank had received by the end of the step's queuing (0: none)."""


class QueuedStep:
    """A step whose work is queued on the device: its loss, gradient norm, target count and the ranks' stop flag
    travel to the host behind that work, so the host can queue the next step before reading them (a read right away
    would leave the device idle while the host loads and launches the next step)."""

    def __init__(self, number: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor, n_global: torch.Tensor,
                 stop_flag: torch.Tensor):
        self.number, self.lr = number, lr
        values = torch.stack([loss.double(), grad_norm.double(), n_global.double(), stop_flag.double()])
        self.values = values.to("cpu", non_blocking=True)  # pinned memory, filled once the device gets there
        self.done, self.done_at = None, time.perf_counter()  # on the CPU the step's work ends here
        if values.is_cuda:
            self.done = torch.cuda.Event(enable_timing=True)
            self.done.record()

    def seconds_since(self, earlier: QueuedStep) -> float:
        """From the end of an earlier step's work to the end of this one's, both read: on the device's clock where
        there is one, since the host reads a step late or at once depending on the step."""
        if self.done is not None:
            return earlier.done.elapsed_time(self.done) / 1e3
        return self.done_at - earlier.done_at

    def read(self) -> StepResult:
        """Waits for the step's work (only) to finish."""
        if self.done is not None:
            self.done.synchronize()
        loss, norm, n_global, stop = self.values.tolist()
        return StepResult(loss, norm, int(n_global), skipped=not (math.isfinite(loss) and math.isfinite(norm)),
                          stop_signal=int(stop))


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_lock = None
        try:
            self.init_process()
            self.startup = StartupReport(STARTED, say=self.print if self.rank == 0 else None)
            resume_step = self.open_run()
            self.build_and_shard_model(resume_step)
            self.build_optimizer_and_data()
            self.step = self.tokens_seen = self.skipped_steps = self.consecutive_skips = self.last_saved = 0
            self.last_loss: float | None = None  # for the closing line
            self.stop_signal = 0
            self.unread: QueuedStep | None = None  # a step queued and not read yet (the loop reads it a step later)
            self.first_step_logged = False  # time_to_first_step_sec, once per launch
            self.last_logged: QueuedStep | None = None  # where the next metrics line's time window begins
            self.staging_ready = False
            stop_signals.install()  # Ctrl-C and preemption notices: save, then exit cleanly (kept if already received)
            load_seconds = self.resume_and_start_metrics(resume_step)
            self.global_batch = cfg.training.batch_size * cfg.training.gradient_accumulation_steps * self.d.dp_world
            self.print_start(resume_step, load_seconds)
            self.profiler = StepProfiler(cfg.profiling, self.run_dir, self.rank, self.device, next_step=self.step + 1,
                                         last_step=cfg.training.steps, say=self.print)
        except BaseException:
            if self.run_lock is not None:  # a run that never started leaves no lock for the next launch to take over
                self.run_lock.release()
            raise

    def init_process(self) -> None:
        """The process group, the seeds, and this run's folder, locked (one run per folder: RunError if in use)."""
        t = self.cfg.training
        self.d = init_distributed(self.cfg.parallelism)
        self.rank, self.device = self.d.rank, self.d.device
        self.cp = self.d.context_parallel(self.cfg.parallelism.context_parallel_exchange)  # None unless cp > 1
        self.heartbeat = Heartbeat(self.cfg.parallelism.collective_timeout_sec)
        random.seed(t.seed)
        torch.manual_seed(t.seed)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.run_dir = Path(self.cfg.job.dump_folder)
        self.run_lock = lock_run_folder(self.run_dir, self.rank)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()

    def open_run(self) -> int | None:
        """The checkpointer and the step to resume from (None: a fresh run), checked and recorded by start_run."""
        c = self.cfg.checkpoint
        use_async = c.async_mode == "async" or (c.async_mode == "auto" and self.d.on_gpu)
        self.checkpointer = Checkpointer(c, self.run_dir, self.rank, use_async=use_async)
        resume_step = self.checkpointer.step_to_resume() if c.enable else None
        self.start_run(resume_step)
        for name in self.checkpointer.remove_incomplete():
            self.print(f"removed {name}: a save that never finished")
        return resume_step

    def build_and_shard_model(self, resume_step: int | None) -> None:
        """Built on the meta device, materialized and initialized whole on every rank with the same seed (so the
        weights do not depend on the number of ranks; they do on the device type, whose random numbers differ), then
        sharded."""
        cfg, t, c = self.cfg, self.cfg.training, self.cfg.checkpoint
        self.startup.stage(f"building the model ({cfg.model.name}) on {self.device.type}")
        with torch.device("meta"):
            model = build_model(cfg.model)
        model.to_empty(device=self.device)
        torch.manual_seed(t.seed)
        model.init_weights()
        if c.init_from and resume_step is None:
            try:
                load_init_weights(model, c.init_from)
            except (ConvertError, ValueError) as e:
                raise RunError(f"checkpoint.init_from = {c.init_from!r}: {one_line(str(e))}") from None
            self.print(f"initialized from {c.init_from}")
        self.num_params = model.num_params()
        self.flops_per_token = model.flops_per_token(t.seq_len)
        if self.cp is not None:
            enable_context_parallel(model, self.cp)  # each rank runs its piece of every row
        self.model = parallelize(model, self.d, param_dtype=t.mixed_precision_param,
                                 reduce_dtype=t.mixed_precision_reduce,
                                 activation_checkpoint=t.activation_checkpoint, compile=t.compile,
                                 fsdp_wrap=self.cfg.parallelism.fsdp_units(), recompute=t.recompute)

    def build_optimizer_and_data(self) -> None:
        """Optimizer, learning-rate schedule and the training data, whose tokenizer must fit model.vocab_size."""
        cfg, t = self.cfg, self.cfg.training
        self.startup.stage("building the optimizer and the data loader")
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        keep_gathered_parameters(self.model, self.d, self.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.loader = build_train_loader(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size,
                                         grad_accum=t.gradient_accumulation_steps, dp_rank=self.d.dp_rank,
                                         dp_world=self.d.dp_world, seed=t.seed, vocab_size=cfg.model.vocab_size)
        tokenizer_vocab = getattr(self.loader, "vocab_size", cfg.model.vocab_size)
        if tokenizer_vocab > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size", f"at least the tokenizer's vocabulary ({tokenizer_vocab})",
                              cfg.model.vocab_size)

    def resume_and_start_metrics(self, resume_step: int | None) -> float | None:
        """Load the checkpoint to resume from, if any (returns the seconds it took), then start the metrics logger
        with the run's wandb id."""
        wandb_id = None
        load_seconds = None
        if resume_step is not None:
            self.startup.stage(f"loading checkpoint step-{resume_step}")
            start = time.perf_counter()
            wandb_id = self.load_checkpoint(resume_step)
            load_seconds = time.perf_counter() - start
        self.metrics = MetricsLogger(self.cfg, self.run_dir, rank=self.rank, world_size=self.d.world_size,
                                     device=self.device, flops_per_token=self.flops_per_token, wandb_id=wandb_id,
                                     start_step=resume_step or 0)
        ids = [self.metrics.wandb_id]  # only rank 0 talks to wandb; every rank saves the same train state
        dist.broadcast_object_list(ids, src=0)
        self.metrics.wandb_id = ids[0]
        return load_seconds

    def print_start(self, resume_step: int | None, load_seconds: float | None) -> None:
        """The start-up line: model size and FLOPs, ranks, global batch, run folder, and the resume if any."""
        cfg, t = self.cfg, self.cfg.training
        self.print(f"model {cfg.model.name}: {self.num_params / 1e6:.1f}M parameters, "
                   f"{self.flops_per_token / 1e9:.2f} GFLOP/token | {self.d.world_size} ranks on {self.device.type} "
                   f"(replicate x shard = {tuple(self.d.mesh.shape)}"
                   + (f", each row cut into {self.d.cp_size} pieces: context_parallel_degree = {self.d.cp_size}"
                      if self.cp is not None else "")
                   + f") | global batch {self.global_batch} x "
                   f"{t.seq_len} tokens | run folder {self.run_dir}"
                   + (f" | resumed from step {resume_step} (loaded in {load_seconds:.1f} s)"
                      if resume_step is not None else ""))

    def print(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def start_run(self, resume_step: int | None) -> None:
        """Say whether the run resumes or starts fresh. On resume, compare the checkpoint's config with this one:
        a change it cannot take stops (RunError), the others are listed and applied. Then write config.toml."""
        current = to_toml(self.cfg)
        self.data_bound_changed = False
        """Text data: a key the saved data streams depend on changed (allowed by data_state = restart)."""
        if resume_step is None:
            never = self.cfg.checkpoint.resume == "never" and bool(complete_steps(self.checkpointer.folder))
            self.print(f"starting fresh in {self.run_dir}"
                       + (" (checkpoint.resume = never: its checkpoints are not loaded)" if never else ""))
        else:
            self.print(f"resuming run {self.run_dir} from step {resume_step}")
            ts = {"config": "", "dp_world": 0, "data_workers": 0}
            self.checkpointer.load(resume_step, {"train_state": ts})
            changes = check_resume_config(ts["config"], self.cfg, current,
                                          f"checkpoint {self.checkpointer.path(resume_step)}")
            now = (self.d.dp_world, self.cfg.data.num_workers)
            if (ts["dp_world"], ts["data_workers"]) != now and not self.cfg.data.synthetic \
                    and self.cfg.checkpoint.data_state == "strict":  # before config.toml changes
                raise layout_error(self.checkpointer.path(resume_step), (ts["dp_world"], ts["data_workers"]), now)
            if changes:
                self.print(f"config changed since step {resume_step} (applied): " + "; ".join(changes))
            if ts["config"] and (line := global_batch_change(ts["config"], ts["dp_world"], self.cfg,
                                                               self.d.dp_world)):
                self.print(f"global batch changed since step {resume_step} (applied): {line}")
            self.checkpointer.say_verified(resume_step)
            self.data_bound_changed = not self.cfg.data.synthetic and any(c.startswith(DATA_BOUND) for c in changes)
        if self.rank == 0:
            kept = write_config_toml(self.run_dir, current, resume_step or 0)
            if kept is not None:
                self.print(f"the previous config.toml differs: kept as {kept}")
        dist.barrier()

    # ---------------------------------------------------------------------------------------------------- the step
    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's arguments for a micro-batch of whole rows: under context parallelism, this rank's piece of
        every row (its labels, so each target is counted and scored on one rank of the cp group only)."""
        if self.cp is not None:
            return split_batch(batch, self.cp)
        return {"input_ids": batch["input_ids"], "labels": batch["labels"], "cu_seqlens": batch.get("cu_seqlens")}

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> QueuedStep:
        """Queue step `next_step`; the host waits for the device only with the non-fused optimizer, which checks the
        loss and gradient norm before it updates."""
        number, lr = self.next_step, self.optimizer.param_groups[0]["lr"]
        # Normalize by the target tokens of the whole global batch (all micro-batches, all ranks), counted first.
        pieces = [self.model_inputs(mb) for mb in micro_batches]
        n_local = sum(count_targets(p["labels"]) for p in pieces)
        n_global = all_reduce_sum(n_local.to(self.device)).float()  # summed exactly as int64
        loss_sum = torch.zeros((), device=self.device)
        for i, piece in enumerate(pieces):
            self.model.set_requires_gradient_sync(i == len(pieces) - 1)  # reduce gradients once per step
            token_loss_sum = self.model(**piece)
            (token_loss_sum / n_global).backward()  # FSDP sums gradients over ranks without dividing again
            loss_sum += token_loss_sum.detach()
        loss = all_reduce_sum(loss_sum) / n_global
        # the optimizer's parameters: the shards, which hold the gradients (between steps the modules may hold the
        # gathered copies: parallel.keep_gathered_parameters)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm or math.inf)
        not_finite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.optimizer.defaults["fused"]:
            # the fused kernel skips its own update where found_inf is 1 (weights, moments and step count as they
            # were): the host need not wait for the backward to finish before it queues the update
            self.optimizer.found_inf = not_finite.float()
            self.optimizer.step()
        elif not not_finite.item():
            self.optimizer.step()
        self.scheduler.step()  # the schedule follows the step count, skipped steps included
        self.optimizer.zero_grad(set_to_none=True)
        # any rank that got a signal by now stops every rank (a signal may reach only some ranks)
        stop_flag = torch.full((), stop_signals.received, device=self.device)  # (a fill: no copy the host waits for)
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
        return QueuedStep(number, lr, loss, grad_norm, n_global, stop_flag)

    # ---------------------------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        """The loop; a collective that failed because a rank went quiet becomes RankMissing, naming that rank."""
        try:
            self.train_loop()
        except RuntimeError as e:
            if is_collective_failure(e):
                self.heartbeat.explain(self.next_step, e)
            raise

    def train_loop(self) -> None:
        """Each step is read while the next one runs, except where the host must see the weights of that step before
        the next update (a step that evaluates, saves, ends the run, or is this launch's first). A stop signal or a
        non-finite step is thus seen one step later: a stop then finishes the step queued behind it too."""
        t = self.cfg.training
        if self.step >= t.steps:
            self.print(f"nothing to train: the run is at step {self.step} of training.steps = {t.steps}")
        if self.step < t.steps:
            self.startup.stage("the first step" + (": torch.compile and the kernels' autotuning run in it"
                                                   if t.compile or self.d.on_gpu else ""))
        while self.step < t.steps:
            self.profiler.before_step(self.next_step)  # [profiling]: a window opens or closes here
            micro_batches = [self.to_device(next(self.loader)) for _ in range(t.gradient_accumulation_steps)]
            self.heartbeat.arrive(self.next_step)
            queued = self.train_step(micro_batches)
            previous, self.unread = self.unread, queued
            if previous is not None:
                self.finish_step(previous)
            n = queued.number  # read at once: what evaluates, saves or ends reads this step's weights, not the next's
            if self.stop_signal or not self.first_step_logged or n == t.steps or self.evaluates(n) or self.saves(n):
                self.unread = None
                self.finish_step(queued)
            if self.stop_signal:
                if self.cfg.checkpoint.enable and self.last_saved != self.step:
                    self.save_checkpoint()
                self.print(f"stopped at step {self.step} on signal {signal.Signals(self.stop_signal).name}"
                           + ("; launch again to resume" if self.cfg.checkpoint.enable else ""))
                return
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            self.checkpointer.wait()
            raise RunError(f"the run ended on a non-finite loss ({self.last_loss}) at step {self.step}, its update "
                           f"skipped; {self.checkpointer.good_line()}")

    @property
    def next_step(self) -> int:
        """The number of the step to queue next."""
        return self.step + 1 + (self.unread is not None)

    def evaluates(self, step: int) -> bool:
        v = self.cfg.validation
        return v.enable and (step % v.freq == 0 or step == self.cfg.training.steps)

    def saves(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return c.enable and (step % c.interval == 0 or step == self.cfg.training.steps)

    def finish_step(self, queued: QueuedStep) -> None:
        """The bookkeeping of a step once its results reach the host: counts, metrics, skips, evaluation, saves."""
        t = self.cfg.training
        result = queued.read()
        self.step += 1
        self.tokens_seen += self.global_batch * t.seq_len
        self.metrics.count(self.global_batch * t.seq_len)
        if not self.first_step_logged:  # start-up, compilation and autotuning included; once per launch
            self.first_step_logged = True
            self.startup.done()
            self.metrics.log_extra(self.step, {"time_to_first_step_sec": time.perf_counter() - STARTED})
        if self.step == 1:
            self.sanity_check_first_loss(result.loss)
        if self.cfg.checkpoint.enable and not self.staging_ready:
            # after a real optimizer step: DCP would otherwise create Adam's moments with a fake step
            self.staging_ready = True
            seconds = self.checkpointer.prepare(self.state_dict())
            if seconds:
                self.print(f"prepared the CPU buffer for async checkpoints in {seconds:.1f} s (once per run)")
        self.stop_signal = self.stop_signal or result.stop_signal
        self.handle_skip(result)
        self.last_loss = result.loss
        if self.step % self.cfg.metrics.log_freq == 0 or self.step == t.steps or result.skipped:
            self.metrics.log(self.step, {"loss": result.loss, "grad_norm": result.grad_norm, "lr": queued.lr,
                                         "tokens_seen": self.tokens_seen, "target_tokens": result.target_tokens,
                                         "skipped_steps": self.skipped_steps, **self.loader.metrics()},
                             seconds=None if self.last_logged is None else queued.seconds_since(self.last_logged))
            self.last_logged = queued
        if self.evaluates(self.step):
            self.evaluate()
        if self.saves(self.step):
            self.save_checkpoint()

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def sanity_check_first_loss(self, loss: float) -> None:
        expected = math.log(self.cfg.model.vocab_size)
        if not math.isfinite(loss) or abs(loss / expected - 1) > 0.25:
            warn(f"FIRST LOSS {loss:.4f} IS FAR FROM ln(vocab_size) = {expected:.4f} (ratio {loss / expected:.2f}).\n"
                 "A freshly initialized model should start near ln(vocab). Usual causes: the loss is not divided by "
                 "the global target-token count\n(inflated by batch x accumulation steps), a bad initialization "
                 "(init std too large, output layer not scaled), or labels not shifted against the inputs.")

    def handle_skip(self, result: StepResult) -> None:
        if not result.skipped:
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.print(f"step {self.step}: non-finite loss ({result.loss}) or grad norm ({result.grad_norm}): "
                   f"optimizer step skipped ({self.consecutive_skips} in a row, {self.skipped_steps} in all)")
        if self.consecutive_skips >= self.cfg.training.max_consecutive_skips:
            self.checkpointer.wait()  # a save in flight is of finite weights: let it complete
            raise RunError(f"stopping: {self.consecutive_skips} consecutive steps had a non-finite loss or "
                           f"gradient norm (training.max_consecutive_skips); {self.checkpointer.good_line()}; lower "
                           "the learning rate or check the data")

    @torch.no_grad()
    def evaluate(self) -> float:
        from flame.data import build_eval_loader

        t = self.cfg.training
        loader = build_eval_loader(self.cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, dp_rank=self.d.dp_rank,
                                   dp_world=self.d.dp_world)
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        n = torch.zeros((), device=self.device)
        for i, batch in enumerate(loader):
            if i == self.cfg.validation.steps:
                break
            piece = self.model_inputs(self.to_device(batch))
            loss_sum += self.model(**piece)
            n += count_targets(piece["labels"])
        self.model.train()
        loss = (all_reduce_sum(loss_sum) / all_reduce_sum(n)).item()
        self.metrics.log_eval(self.step, loss)
        return loss

    # ------------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": self.scheduler.state_dict(),
                "train_state": {"step": self.step, "tokens_seen": self.tokens_seen,
                                "skipped_steps": self.skipped_steps, "wandb_id": self.metrics.wandb_id or "",
                                "dp_world": self.d.dp_world, "data_workers": self.cfg.data.num_workers,
                                "config": to_toml(self.cfg)},
                # each data-parallel rank reads its own stream (the ranks of a cp group the same one: one entry, DCP
                # keeps one copy) and each rank draws its own random numbers
                "dataloader": {f"rank_{self.d.dp_rank}": self.loader.state_dict()},
                "rng": {f"rank_{self.rank}": rng_state()}}

    def save_checkpoint(self) -> None:
        blocked = self.checkpointer.save(self.step, self.state_dict())  # completes the previous save first
        self.last_saved = self.step
        mode = "async, written in the background" if self.checkpointer.use_async else "sync"
        self.print(f"checkpoint step-{self.step}: training blocked {blocked:.2f} s ({mode})")
        self.report_written()
        self.metrics.log_extra(self.step, {"checkpoint_blocked_sec": blocked})

    def report_written(self) -> None:
        """Rank 0: how long the last complete save took to reach the disk (for async saves, said once it is)."""
        if self.checkpointer.written is not None:
            step, seconds = self.checkpointer.written
            self.checkpointer.written = None
            self.print(f"checkpoint step-{step}: complete on disk {seconds:.1f} s after the save began")

    def load_checkpoint(self, step: int) -> str | None:
        ts = {"step": 0, "tokens_seen": 0, "skipped_steps": 0, "wandb_id": "", "dp_world": 0, "data_workers": 0,
              "config": ""}
        self.checkpointer.load(step, {"train_state": ts})
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        check_compatible(self.checkpointer.saved_shapes(step), model_sd, self.checkpointer.path(step))
        # the data streams continue where the data-parallel layout is the same (another cp degree changes only how
        # each row is cut); each rank's random numbers where the ranks are the same ones too
        same_layout = (ts["dp_world"], ts["data_workers"]) == (self.d.dp_world, self.cfg.data.num_workers)
        same_ranks = same_layout and saved_cp_degree(ts["config"]) == self.d.cp_size
        state = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": self.scheduler.state_dict()}
        data_key = None
        if (same_layout and not self.data_bound_changed) or getattr(self.loader, "state_is_global", False):
            data_key = f"rank_{self.d.dp_rank}" if same_layout else "rank_0"
            state["dataloader"] = {data_key: self.loader.state_dict()}
        elif self.cfg.checkpoint.data_state == "strict":
            raise layout_error(self.checkpointer.path(step), (ts["dp_world"], ts["data_workers"]),
                               (self.d.dp_world, self.cfg.data.num_workers))
        if same_ranks:
            state["rng"] = {f"rank_{self.rank}": rng_state()}
        self.checkpointer.load(step, state)
        if bad := nonfinite_tensors({"model": state["model"], "optimizer": state["optimizer"]}):
            earlier = [s for s in complete_steps(self.checkpointer.folder) if s < step]
            raise RunError(f"checkpoint {self.checkpointer.path(step)} holds non-finite values ({some_of(bad)}): "
                           "left as it is; "
                           + (f"resume from an earlier one with --checkpoint.load_step={earlier[-1]} (complete: "
                              f"{', '.join(f'step-{s}' for s in earlier)})" if earlier else
                              "no earlier checkpoint: start a new run (--checkpoint.resume=never)"))
        self.checkpointer.good = step
        # this run's optimizer settings (lr, betas, eps, weight decay) win over the saved param_groups' copies
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        restore_lr_schedule(self.scheduler, self.optimizer, int(state["lr_scheduler"]["last_epoch"]))
        if data_key is not None:
            self.loader.load_state_dict(state["dataloader"][data_key])
        else:
            self.print("WARNING: data streams restart from the beginning (checkpoint.data_state = restart)")
        if same_ranks:
            set_rng_state(state["rng"][f"rank_{self.rank}"])
        self.step, self.tokens_seen, self.skipped_steps = ts["step"], ts["tokens_seen"], ts["skipped_steps"]
        self.last_saved = self.step
        return ts["wandb_id"] or None

    def closing_line(self) -> str:
        """What the run did and where its results are (rank 0 prints it once everything is written)."""
        t = self.cfg.training
        loss = "n/a" if self.last_loss is None else f"{self.last_loss:.4f}"
        saved = f", {self.cfg.checkpoint.folder}/step-{self.last_saved}" if self.cfg.checkpoint.enable \
            and self.last_saved else ""
        return (f"{'done' if self.step >= t.steps else 'stopped'}: step {self.step} of {t.steps} | loss {loss} | "
                f"{self.tokens_seen:,} tokens | run folder {self.run_dir} (config.toml, metrics.jsonl{saved})")

    def close(self, clean: bool = True) -> None:
        """clean: every rank got here together (an async save in flight is completed). After an error, skip all
        waiting on other ranks: one of them may be gone."""
        self.startup.done()
        self.profiler.close(write=clean)  # [profiling]: a window that the end of training or a stop signal cut short
        if clean:
            self.checkpointer.close()
            self.report_written()
        self.loader.close()
        self.metrics.close()
        if clean:
            dist.barrier()  # no rank tears its process group down while another still talks to it
        dist.destroy_process_group()
        if self.run_lock is not None:
            self.run_lock.release()


def layout_error(path: Path, saved: tuple[int, int], now: tuple[int, int]) -> RunError:
    """(data-parallel ranks, data workers per rank) differ from the checkpoint's under checkpoint.data_state=strict.
    Data-parallel ranks = processes / context_parallel_degree: the ranks of one cp group read one stream."""
    return RunError(f"checkpoint {path} was written by {saved[0]} data-parallel ranks with {saved[1]} data workers "
                    f"each, this run has {now[0]} and {now[1]}: model and optimizer reshard, the data streams' "
                    f"positions do not; {WAYS_OUT.replace('settings', 'layout', 1)}")


def saved_cp_degree(saved_toml: str) -> int:
    """The checkpoint's parallelism.context_parallel_degree (1 for a checkpoint without its config or the key)."""
    return int(flat_config(saved_toml).get("parallelism.context_parallel_degree", 1)) if saved_toml else 1


def global_batch_change(saved_toml: str, saved_ranks: int, cfg: Config, ranks: int) -> str | None:
    """The global batch of the checkpoint and of this run (data-parallel ranks x batch_size x accumulation steps)
    where they differ: another number of ranks changes it without any key changing."""
    saved = flat_config(saved_toml)
    before = (saved_ranks, saved.get("training.batch_size"), saved.get("training.gradient_accumulation_steps"))
    now = (ranks, cfg.training.batch_size, cfg.training.gradient_accumulation_steps)
    if None in before or before == now:
        return None
    return (f"{math.prod(before)} sequences in the checkpoint ({' x '.join(map(str, before))} ranks x batch_size x "
            f"accumulation), {math.prod(now)} now ({' x '.join(map(str, now))})")


def write_config_toml(run_dir: Path, text: str, step: int) -> str | None:
    """Write the run's config.toml. A previous one that differs is kept beside it as config.step-N.toml (N: the step
    this launch starts from; .2, .3, ... if that name is taken); returns that name, or None."""
    path, kept = run_dir / "config.toml", None
    if path.is_file() and path.read_text() != text:
        kept, n = run_dir / f"config.step-{step}.toml", 2
        while kept.exists():
            kept, n = run_dir / f"config.step-{step}.{n}.toml", n + 1
        path.rename(kept)
    path.write_text(text)
    return None if kept is None else kept.name


def one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def exit_on_startup_error(e: Exception, config_path: str | None, in_run: bool = False) -> None:
    """Print the error's one line and exit 2. Every rank meets a config or resume problem alike: rank 0 says it,
    the others stay quiet (and wait a moment, so that torchrun does not stop rank 0 before it has said it). A data
    reader's problem belongs to its own rank, which says it, and so does a rank that found another missing."""
    if isinstance(e, ConfigError):
        e.file = e.file or config_path
        line = e.line()
    elif isinstance(e, NoDocumentError):
        line = "data error: " + NoDocumentError.message_of(e)
    else:
        line = f"error: {one_line(str(e))}"
    started = in_run or dist.is_initialized()  # (a closed trainer has left its process group already)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 or isinstance(e, (NoDocumentError, RankMissing)):
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(3)
    if not started:
        sys.exit(2)
    sys.stdout.flush()
    os._exit(2)  # the process group may be half set up: skip its teardown


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides = parse_config_args(argv)
        cfg = load_config(path, overrides)
        resolve_dp_degrees(cfg.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
        if not cfg.data.synthetic:
            check_sources(cfg.data)  # globs, files, formats, tokenizer: fail here, not mid-run
    except ConfigError as e:
        exit_on_startup_error(e, argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None)
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except (ConfigError, RunError, NoDocumentError) as e:  # foreseeable: one line, no traceback
        if trainer is not None:
            trainer.close(clean=False)
        exit_on_startup_error(e, path, in_run=True)
    except BaseException:
        if trainer is not None:
            trainer.close(clean=False)
        raise
    trainer.close()
    trainer.print(trainer.closing_line())
    # Everything is written and closed. Skip the interpreter's teardown: on CPU, gloo's threads have now and then
    # aborted it (SIGABRT, "terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
