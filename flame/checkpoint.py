"""Sharded checkpoints with torch.distributed.checkpoint (DCP), visible only once complete.

Layout: {dump_folder}/{checkpoint.folder}/step-N/ (DCP files). A save writes step-N.tmp/ and rank 0 renames it to
step-N once DCP has written its metadata, which DCP does only after every rank's files are written; so a folder
named step-N is always complete, and a .tmp folder is a save that never finished (ignored, removed at start-up).
Older checkpoints are pruned only after a newer one is complete.

On GPU the save is asynchronous: training blocks only while the state is copied into a cached CPU buffer; the
files are written by a background thread over a gloo process group of their own.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from flame.config import CheckpointConfig, Config, RunError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_steps(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)))


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, rank: int, use_async: bool):
        self.cfg, self.rank, self.use_async = cfg, rank, use_async
        self.folder = run_dir / cfg.folder
        self.pending: Future | None = None
        self.written: tuple[int, float] | None = None
        """Rank 0: (step, seconds from the start of its save until it was complete on disk) of the last save."""
        if use_async:
            self.pg = dist.new_group(backend="gloo")  # async DCP needs a CPU process group
            # on GPU, reuse one pinned CPU copy across saves; on CPU, DCP's default copy
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True) if torch.cuda.is_available() else None

    def step_to_resume(self) -> int | None:
        """The step to load, following checkpoint.resume and checkpoint.load_step; None starts fresh."""
        steps = complete_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise RunError(f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint "
                               f"{self.folder}/step-{self.cfg.load_step} (complete: {steps or 'none'})")
            return self.cfg.load_step
        if self.cfg.resume == "auto" and steps:
            return steps[-1]
        return None

    def remove_incomplete(self) -> list[str]:
        """Rank 0, at start-up (no save in flight): drop folders of saves that never finished."""
        removed = []
        if self.rank == 0 and self.folder.is_dir():
            for p in self.folder.glob("step-*.tmp"):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def prepare(self, state: dict) -> float:
        """Allocate the pinned CPU copy that every async save reuses, so that no save pays for it (0.6B on an H200:
        about 12 s, once). Call after an optimizer step: the state must hold the optimizer's moments."""
        if not self.use_async or self.stager is None:
            return 0.0
        start = time.perf_counter()
        self.stager.stage(state)
        return time.perf_counter() - start

    def save(self, step: int, state: dict) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was blocked."""
        self.wait()  # one save in flight at a time
        start = time.perf_counter()
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if self.use_async:
            response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg,
                                      async_stager=self.stager)
            self.pending = getattr(response, "upload_completion", response)
            if self.rank == 0:  # rank 0's save returns after DCP wrote the metadata, i.e. after every rank
                self.pending.add_done_callback(lambda f: f.exception() is None and self._finalize(step, start))
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            dist.barrier()
            if self.rank == 0:
                self._finalize(step, start)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete and visible on every rank."""
        if self.pending is None:
            return
        self.pending.result()  # re-raises a failed save
        self.pending = None
        dist.barrier()

    def close(self) -> None:
        self.wait()
        if self.use_async and self.stager is not None:
            self.stager.close()

    def load(self, step: int, state: dict) -> None:
        """Fill `state` (same structure as saved, any number of ranks) in place."""
        dcp.load(state, checkpoint_id=str(self.path(step)))

    def saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """Global shape of every tensor in a checkpoint, from its metadata (reads no tensor data)."""
        meta = dcp.FileSystemReader(str(self.path(step))).read_metadata()
        return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}

    def _finalize(self, step: int, start: float) -> None:
        self.written = (step, time.perf_counter() - start)
        final = self.path(step)
        shutil.rmtree(final, ignore_errors=True)
        (self.folder / f"step-{step}.tmp").rename(final)
        if self.cfg.keep_latest_k > 0:
            for old in complete_steps(self.folder)[: -self.cfg.keep_latest_k]:
                shutil.rmtree(self.path(old), ignore_errors=True)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# On resume, a key of these stays as the checkpoint has it: the weights, and what the tokens mean, depend on them.
FIXED_ON_RESUME = ("model.", "data.tokenizer", "data.add_bos", "data.bos_token", "data.eos_token", "optimizer.name")
# These decide what the saved data streams hold (documents, shuffle, packing): a text run resumes its data exactly
# only with the checkpoint's values; checkpoint.data_state = restart lets them change (the streams start over).
DATA_BOUND = ("data.sources", "data.synthetic", "data.num_workers", "data.shuffle_buffer", "data.varlen",
              "data.max_doc_len", "training.seq_len", "training.batch_size", "training.seed")
WAYS_OUT = ("resume with the checkpoint's settings, or pass --checkpoint.data_state=restart to restart the data "
            "streams (documents already seen are seen again), or start a new run: a new --job.dump_folder or "
            "--checkpoint.resume=never")


def flat_config(toml_text: str) -> dict[str, object]:
    """section.key -> value of a config TOML (lists of source tables compare whole)."""
    return {f"{section}.{key}": value for section, table in tomllib.loads(toml_text).items()
            for key, value in table.items()}


def config_changes(saved_toml: str, current_toml: str) -> list[str]:
    """Every key whose value differs between the checkpoint's config and this run's, as "key: old -> new"."""
    old, new = flat_config(saved_toml), flat_config(current_toml)
    return [f"{k}: {old.get(k, '(unset)')!r} in the checkpoint, {new.get(k, '(unset)')!r} now"
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def check_resume_config(saved_toml: str, cfg: Config, current_toml: str, where: str) -> list[str]:
    """The config changes a resume may apply (returned, for a notice); raise RunError (one line) naming those it
    cannot: FIXED_ON_RESUME always, DATA_BOUND for text data under checkpoint.data_state = strict."""
    if not saved_toml:  # a checkpoint without its config: nothing to compare
        return []
    changes = config_changes(saved_toml, current_toml)
    fixed = [c for c in changes if c.startswith(FIXED_ON_RESUME)]
    if fixed:
        raise RunError(f"{where}: cannot resume with a changed {'; '.join(fixed)}: the model and tokenizer stay as "
                       "the checkpoint's; use the checkpoint's values, or start a new run: a new --job.dump_folder "
                       "or --checkpoint.resume=never (checkpoint.init_from takes weights only, from an export)")
    text_data = not (flat_config(saved_toml).get("data.synthetic") and cfg.data.synthetic)
    bound = [c for c in changes if c.startswith(DATA_BOUND)]
    if bound and text_data and cfg.checkpoint.data_state == "strict":
        raise RunError(f"{where}: the saved data streams depend on {'; '.join(bound)}: {WAYS_OUT}")
    return changes


def check_compatible(saved_shapes: dict, model_sd: dict, path: Path) -> None:
    """Stop (RunError, one line) naming the tensors that do not fit when this model does not fit the checkpoint
    (the config comparison, check_resume_config, names the settings first)."""
    problems = []
    for name, tensor in model_sd.items():
        key = f"model.{name}"
        if key not in saved_shapes:
            problems.append(f"{key} is not in the checkpoint")
        elif tuple(tensor.shape) != saved_shapes[key]:
            problems.append(f"{key} has shape {saved_shapes[key]} in the checkpoint, {tuple(tensor.shape)} here")
    extra = sorted(k for k in saved_shapes if k.startswith("model.") and k[len("model."):] not in model_sd)
    problems += [f"{k} is in the checkpoint but not in this model" for k in extra[:5]]
    if problems:
        raise RunError(f"checkpoint {path} does not fit this model: {'; '.join(problems[:4])}"
                       + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
                       + "; use the checkpoint's model settings, or start a new run: a new --job.dump_folder or "
                       "--checkpoint.resume=never")
