"""Sharded checkpoints with torch.distributed.checkpoint (DCP), visible only once complete, checksummed and finite.

Layout: {dump_folder}/{checkpoint.folder}/step-N/ (DCP files, checksums.json). A save writes step-N.tmp/ and rank 0
renames it to step-N once DCP has written its metadata, which DCP does only after every rank's files are written; so a
folder named step-N is always complete, and a .tmp folder is a save that never finished (ignored, removed at start-up).
Older checkpoints are pruned only after a newer one is complete.

Nothing non-finite is saved: before each save every parameter and optimizer state is checked finite (one reduction on
the device); a NaN or an infinity stops the run with one line naming the last good checkpoint instead.

A complete folder can still be damaged later (a bad disk, a truncated copy, bytes overwritten): each rank records an
xxh3 digest of every file it wrote (read back from the page cache in the save's own thread), and the coordinator
writes them with the .metadata's own digest to checksums.json. Before resuming, the checksums must match (the ranks
share the files out), the .metadata must read, every shard file it lists must exist and hold every item's bytes, and
its pickled items must unpickle. Under checkpoint.resume = auto a damaged one is skipped for the previous one, and
left as it is; a new save of its step keeps it aside as step-N.unreadable. A checkpoint without checksums.json
(written before they were recorded) is checked for the rest and, once loaded, for finite values.

On GPU the save is asynchronous: training blocks only while the state is copied into a cached CPU buffer; the
files are written (and hashed) by a background thread over a gloo process group of their own.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import re
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.futures import Future as TorchFuture

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


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def root_cause(e: BaseException) -> str:
    """The first line of the error under DCP's wrappers (a CheckpointException holds each rank's own failure)."""
    for failure in getattr(e, "failures", {}).values():  # rank -> (exception, traceback)
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return root_cause(inner)
    while e.__cause__ is not None and not str(e).strip():
        e = e.__cause__
    return first_line(e)


CHECKSUMS = "checksums.json"
"""In each checkpoint folder: {"xxh3_64": {file name: hex digest}} for every shard file and the .metadata."""


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


class ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's file writer that records a digest of every file it writes: each rank hashes its own files once written
    and hands the digests to the coordinator inside its write results; the coordinator strips them again (the
    .metadata stays plain DCP), adds the .metadata's digest and writes checksums.json, all before the save returns."""

    def write_data(self, plan, planner) -> TorchFuture:
        results = super().write_data(plan, planner).wait()
        digests = {name: file_digest(Path(self.path) / name)
                   for name in {r.storage_data.relative_path for r in results}}
        future: TorchFuture = TorchFuture()
        future.set_result([dataclasses.replace(r, storage_data=(r.storage_data, digests[r.storage_data.relative_path]))
                           for r in results])
        return future

    def finish(self, metadata, results) -> None:
        digests = {info.relative_path: digest for rank in results for r in rank for info, digest in [r.storage_data]}
        super().finish(metadata, [[dataclasses.replace(r, storage_data=r.storage_data[0]) for r in rank]
                                  for rank in results])
        digests[".metadata"] = file_digest(Path(self.path) / ".metadata")
        tmp = Path(self.path) / f"{CHECKSUMS}.tmp"
        with open(tmp, "w") as f:
            json.dump({"xxh3_64": dict(sorted(digests.items()))}, f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(Path(self.path) / CHECKSUMS)


def recorded_digests(path: Path) -> dict[str, str] | None:
    """A checkpoint's checksums.json as {file name: digest}; None for a checkpoint written without one. Raises
    ValueError (naming the file) when it does not read."""
    file = path / CHECKSUMS
    if not file.is_file():
        return None
    try:
        digests = json.loads(file.read_text())["xxh3_64"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
            raise ValueError("not a map of file names to digests")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file}: does not read ({first_line(e)})") from None
    return digests


def digest_problem(path: Path, name: str, digests: dict[str, str]) -> str | None:
    if name not in digests:
        return f"{path / name}: no checksum recorded for it in {CHECKSUMS}"
    try:
        got = file_digest(path / name)
    except OSError as e:
        return f"{path / name}: {first_line(e)}"
    if got != digests[name]:
        return f"{path / name}: checksum mismatch (xxh3 {got}, {CHECKSUMS} records {digests[name]})"
    return None


def unreadable_file(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint folder `path` cannot be loaded, as "file: reason", or None when it looks whole: its
    checksums.json reads and the .metadata matches its digest, the .metadata reads, every shard file it lists exists
    and is long enough for each item stored in it, each pickled (non-tensor) item unpickles, and the shard files match
    their digests. share = (i, n): hash only every n-th shard file from the i-th (each rank its share); the small
    checks run whole."""
    try:
        digests = recorded_digests(path)
    except ValueError as e:
        return str(e)
    if digests is not None and (problem := digest_problem(path, ".metadata", digests)):
        return problem
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing or damaged .metadata: anything unpickling garbage raises
        return f"{path / '.metadata'}: {first_line(e)}"
    storage = meta.storage_data or {}
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            return f"{file}: missing (its .metadata lists it)"
        if (size := file.stat().st_size) < end:
            return f"{file}: truncated ({size} bytes, its .metadata needs {end})"
    pickled = {fqn for fqn, md in meta.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for index, info in storage.items():
        if index.fqn in pickled and not info.transform_descriptors:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            try:
                torch.load(io.BytesIO(data), weights_only=False)  # as DCP's load does; our own files
            except Exception as e:
                return f"{path / info.relative_path}: {index.fqn} does not unpickle ({first_line(e)})"
    if digests is not None:
        mine, ranks = share
        for name in sorted(ends)[mine::ranks]:
            if problem := digest_problem(path, name, digests):
                return problem
    return None


def some_of(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of the floating-point tensors in the nested `state` (DTensors by their local shards) that hold a NaN or
    an infinity on any rank; [] when all are finite. One flag a tensor, reduced on the device: one host sync (and one
    all-reduce) when all are finite; the names are gathered only when some are not."""
    named = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            named.append((prefix, value.to_local() if hasattr(value, "to_local") else value))

    walk("", state)
    device = next((t.device for _, t in named if t.device.type != "cpu"), torch.device("cpu"))
    flags = torch.stack([torch.isfinite(t).all().to(device) for _, t in named]) if named \
        else torch.ones(0, dtype=torch.bool, device=device)
    bad = (~flags).sum().to(torch.int64)
    if dist.is_initialized():
        dist.all_reduce(bad)
    if bad.item() == 0:
        return []
    mine = [name for (name, _), ok in zip(named, flags.tolist()) if not ok]
    if dist.is_initialized() and dist.get_world_size() > 1:
        seen: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(seen, mine)
        mine = sorted({name for names in seen for name in names})
    return mine


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, rank: int, use_async: bool):
        self.cfg, self.rank, self.use_async = cfg, rank, use_async
        self.folder = run_dir / cfg.folder
        self.pending: Future | None = None
        self.pending_step = 0
        self.finalized = threading.Event()
        """Rank 0: the save in flight is renamed complete (and older ones pruned), or failed; set when none is."""
        self.finalized.set()
        self.unreadable: set[int] = set()
        """Steps whose checkpoint was found damaged at start-up: never pruned, kept aside when saved again."""
        self.written: tuple[int, float] | None = None
        """Rank 0: (step, seconds from the start of its save until it was complete on disk) of the last save."""
        self.good: int | None = None
        """The newest checkpoint known whole and finite: the one loaded, or this run's last save once complete."""
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
            if problem := self.agreed_problem(self.cfg.load_step):
                raise RunError(f"checkpoint.load_step={self.cfg.load_step}: checkpoint {self.path(self.cfg.load_step)} "
                               f"cannot be loaded: {problem}")
            return self.cfg.load_step
        if self.cfg.resume != "auto" or not steps:
            return None
        damaged = None  # the line about the newer checkpoint just skipped, said once the next one is checked
        for step in reversed(steps):
            problem = self.agreed_problem(step)
            if damaged:
                self.say(f"{damaged}; {'trying' if problem else 'resuming from'} step-{step} instead")
            if problem is None:
                return step
            self.unreadable.add(step)
            damaged = f"checkpoint {self.path(step)} cannot be loaded (left as it is): {problem}"
        raise RunError(f"{damaged}; no complete checkpoint in {self.folder} can be loaded (all left as they are): "
                       "move them away, or start a new run with a new --job.dump_folder")

    def agreed_problem(self, step: int) -> str | None:
        """unreadable_file of a checkpoint as every rank sees it (the first problem any rank found), so that all ranks
        resume from the same step even where their nodes see different files."""
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        start = time.perf_counter()
        problem = unreadable_file(self.path(step), share=(self.rank, ranks))
        self.verify_seconds = time.perf_counter() - start
        if dist.is_initialized() and dist.get_world_size() > 1:
            seen: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(seen, problem)
            problem = next((p for p in seen if p), None)
        return problem

    def say_verified(self, step: int) -> None:
        """The line that tells the operator what the start-up spent reading the checkpoint (step_to_resume's) back."""
        path = self.path(step)
        if (path / CHECKSUMS).is_file():
            gib = sum(p.stat().st_size for p in path.iterdir()) / 2**30
            self.say(f"checkpoint step-{step}: checksums verified ({gib:.2f} GiB, {self.verify_seconds:.1f} s)")
        else:
            self.say(f"checkpoint step-{step}: written without checksums (an older flame): its files are not "
                     "verified; its values are checked finite once loaded")

    def good_line(self) -> str:
        """Where to resume from after a failure: the newest checkpoint known whole and finite."""
        if self.good is None:
            return "no checkpoint of this run is known good"
        return f"last good checkpoint: {self.path(self.good)}"

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

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
        """Start (async) or do (sync) a save; returns the seconds training was blocked. A state holding a NaN or an
        infinity is not saved: RunError naming it and the last good checkpoint."""
        self.wait()  # one save in flight at a time
        if bad := nonfinite_tensors(state):
            raise RunError(f"step {step}: not saved: non-finite values in {some_of(bad)}; {self.good_line()}; "
                           "lower the learning rate or check the data")
        start = time.perf_counter()
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if self.use_async:
            response = dcp.async_save(state, checkpoint_id=str(tmp), storage_writer=ChecksummedWriter(tmp),
                                      process_group=self.pg, async_stager=self.stager)
            self.pending = getattr(response, "upload_completion", response)
            self.pending_step = step
            if self.rank == 0:  # rank 0's save returns after DCP wrote the metadata, i.e. after every rank
                self.finalized.clear()
                self.pending.add_done_callback(lambda f: self._finalize_written(f, step, start))
        else:
            try:
                dcp.save(state, checkpoint_id=str(tmp), storage_writer=ChecksummedWriter(tmp))
            except (Exception, dcp.CheckpointException) as e:  # a full disk: every rank gets it (DCP gathers them)
                raise self.write_error(step, e) from e
            dist.barrier()
            if self.rank == 0:
                self._finalize(step, start)
            self.good = step
        return time.perf_counter() - start

    def write_error(self, step: int, e: BaseException) -> RunError:
        """A save that failed (a full disk, a lost file system): one line naming the cause; its step-N.tmp is removed
        (to free the space) and the complete checkpoints before it stay as they are."""
        free = shutil.disk_usage(self.folder).free / 2**20  # a full disk shows here; torch's message may not say
        if self.rank == 0:
            shutil.rmtree(self.folder / f"step-{step}.tmp", ignore_errors=True)
        kept = complete_steps(self.folder)
        return RunError(f"checkpoint step-{step} could not be written to {self.folder} ({free:.1f} MiB free on its "
                        f"file system): {root_cause(e)}; complete checkpoints kept: "
                        f"{', '.join(f'step-{s}' for s in kept) or 'none'}")

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete and visible on every rank."""
        if self.pending is None:
            return
        try:
            self.pending.result()  # re-raises a failed save
        except (Exception, dcp.CheckpointException) as e:
            self.finalized.wait()
            raise self.write_error(self.pending_step, e) from e
        self.finalized.wait()  # the future is done before its callback has renamed the folder
        self.pending = None
        self.good = self.pending_step
        dist.barrier()

    def close(self) -> None:
        self.wait()
        if self.use_async and self.stager is not None:
            self.stager.close()

    def load(self, step: int, state: dict) -> None:
        """Fill `state` (same structure as saved, any number of ranks) in place."""
        try:
            dcp.load(state, checkpoint_id=str(self.path(step)))
        except (OSError, RuntimeError, ValueError, dcp.CheckpointException) as e:  # damage not seen at start-up
            raise RunError(f"checkpoint {self.path(step)} cannot be loaded: {first_line(e)}") from e

    def saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """Global shape of every tensor in a checkpoint, from its metadata (reads no tensor data)."""
        meta = dcp.FileSystemReader(str(self.path(step))).read_metadata()
        return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}

    def _finalize_written(self, written: Future, step: int, start: float) -> None:
        try:
            if written.exception() is None:
                self._finalize(step, start)
        finally:
            self.finalized.set()

    def _discard(self, path: Path) -> None:
        """Delete a checkpoint folder; renamed to a .tmp name first, so that a deletion cut short (a kill, a full
        disk) never leaves a part of it under a complete name."""
        if path.exists():
            doomed = path.with_name(f"{path.name}.deleting.tmp")
            shutil.rmtree(doomed, ignore_errors=True)
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def _finalize(self, step: int, start: float) -> None:
        self.written = (step, time.perf_counter() - start)
        final = self.path(step)
        if step in self.unreadable and final.exists():  # the damaged one stays, under a name no resume picks
            aside, n = self.folder / f"step-{step}.unreadable", 2
            while aside.exists():
                aside, n = self.folder / f"step-{step}.unreadable.{n}", n + 1
            final.rename(aside)
            self.unreadable.discard(step)
            print(f"checkpoint step-{step}: the damaged one found at start-up is kept as {aside.name}", flush=True)
        self._discard(final)
        (self.folder / f"step-{step}.tmp").rename(final)
        if self.cfg.keep_latest_k > 0:
            for old in [s for s in complete_steps(self.folder) if s not in self.unreadable][: -self.cfg.keep_latest_k]:
                self._discard(self.path(old))


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
