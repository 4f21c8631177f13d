"""Export folders: a model as config.json + model.safetensors (fp32) + its tokenizer files, written whole or not at all.

    python -m flame.export RUN_DIR OUT_DIR [--step N]

config.json holds {"model": <model args>, "step": N, "source": <where it came from>, "seq_len": <training length>};
the tokenizer travels as tokenizer.json (a `tokenizers` file) or as RWKV's World vocabulary (rwkv_vocab_v20230424.txt),
as flame.data.tokenizer.tokenizer_files names them, so that a folder works as data.tokenizer and for flame.generate.
`load_exported` gives the model back (evaluation, generation). `python -m flame.convert` writes such folders from
other formats (and those formats from them); checkpoint.init_from starts a new run from any of them.

Progress (stderr): each stage (reading, writing) ends with one line and its time when stderr is a terminal or the
stage took SLOW_S seconds or more; loops over tensors show a tqdm bar once they run longer than BAR_DELAY_S.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import sys
import time
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from flame.checkpoint import complete_steps, unreadable_file
from flame.config import ConfigError, build_dataclass, config_from_toml
from flame.data.paths import resolve_path
from flame.data.tokenizer import tokenizer_files as spec_tokenizer_files
from flame.models import build_model, known_models, model_args_class

CONFIG = "config.json"
SLOW_S = 5.0
"""A stage that takes this long says so on stderr even when stderr is not a terminal (a job's log)."""
BAR_DELAY_S = 2.0
"""A loop over tensors shows its bar once it has run this long: quick ones (tests, small models) print nothing."""
WEIGHTS = "model.safetensors"
# Files of a Hugging Face tokenizer that travel along with it (the tokenizer itself is tokenizer.json or a vocabulary).
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


class ConvertError(ValueError):
    """A source that cannot be read, or a destination that cannot be written, as asked. The message is one line
    that names the file (and the tensor or key); the command-line tools print it and exit with code 2."""


@dataclass
class ModelState:
    """A model read from any format, in flame's terms."""

    args: object
    """The model's Args dataclass (flame.models registry)."""
    state: dict[str, torch.Tensor]
    """flame parameter names -> fp32 tensors."""
    source: str
    """Where it came from (a path), recorded in export folders."""
    step: int | None = None
    """Training step, where the source knows one."""
    tokenizer: dict[str, Path] = field(default_factory=dict)
    """Tokenizer files to carry along: name in the destination folder -> file."""
    tokenizer_note: str | None = None
    """Why no tokenizer travels along, where none does."""
    notes: list[str] = field(default_factory=list)
    """Other things the user should know (a norm epsilon that differs between formats)."""
    seq_len: int | None = None
    """The training sequence length (a Transformer generates from prompts up to it), where the source knows it."""

    def messages(self) -> list[str]:
        return self.notes + ([self.tokenizer_note] if self.tokenizer_note and not self.tokenizer else [])


# ------------------------------------------------------------------------------------------------ tokenizer files
def folder_tokenizer_files(folder: Path) -> dict[str, Path]:
    """The tokenizer files a model folder holds: Hugging Face tokenizer files, a World vocabulary (rwkv_vocab*.txt)
    and the tokenizer code such a folder names in its tokenizer_config.json (*tokenizer*.py)."""
    found = {name: folder / name for name in TOKENIZER_NAMES if (folder / name).is_file()}
    for pattern in ("rwkv_vocab*.txt", "*tokenizer*.py"):
        found.update((p.name, p) for p in sorted(folder.glob(pattern)) if p.is_file())
    return found


def tokenizer_files(spec: str, what: str = "tokenizer") -> dict[str, Path]:
    """The files of a tokenizer spec (as data.tokenizer takes it: "rwkv-world", a tokenizer.json, a World vocabulary
    .txt, or a folder holding one), by the names under which flame.data.tokenizer finds them in an export folder;
    a folder's other Hugging Face tokenizer files come along. Empty for a hub id (nothing local to copy);
    ConvertError for a path that is not there."""
    path = Path(resolve_path(spec))
    companions = folder_tokenizer_files(path) if path.is_dir() else {}
    try:
        return {**companions, **spec_tokenizer_files(spec)}
    except FileNotFoundError as e:
        raise ConvertError(f"{what} {spec!r}: {e}") from None


def copy_tokenizer(files: dict[str, Path], folder: Path) -> None:
    for name, path in files.items():
        shutil.copyfile(path, folder / name)


# ---------------------------------------------------------------------------------------------------- progress
@contextmanager
def stage(what: str) -> Iterator[None]:
    """Time the block; when it completes, `what: 1.2 s` on stderr if stderr is a terminal or the block took SLOW_S
    or more (a failed block prints nothing: its error is the one line)."""
    start = time.perf_counter()
    yield
    took = time.perf_counter() - start
    if took >= SLOW_S or sys.stderr.isatty():
        print(f"{what}: {took:.1f} s", file=sys.stderr, flush=True)


def tensor_bar(items, what: str):
    """`items` (tensors) with a tqdm bar on stderr, shown once the loop has run BAR_DELAY_S and cleared after."""
    return tqdm(items, desc=what, unit="tensor", file=sys.stderr, delay=BAR_DELAY_S, leave=False)


def as_fp32(state: dict[str, torch.Tensor], what: str = "to fp32") -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in tensor_bar(state.items(), what)}


# ---------------------------------------------------------------------------------------------- writing whole
def standalone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32, contiguous, each tensor owning its memory: safetensors refuses tensors that share storage (the rows of
    a stacked parameter written as separate tensors), and a .pth would otherwise save whole stacks per row."""
    out = {}
    for k, v in tensor_bar(state.items(), "preparing tensors"):
        v = v.detach().float().contiguous()
        whole = v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.numel() * v.element_size()
        out[k] = v if whole else v.clone()
    return out


@contextmanager
def staged_output(dst: Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write into; it becomes `dst` only if the block completes, and on any
    failure nothing is left behind (neither the temporary path nor parent folders made for it). `dst` must not
    exist yet (an empty folder is fine), so a conversion never destroys what is there."""
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise ConvertError(f"{dst}: already exists; remove it or choose another destination")
    made = next((p for p in reversed(dst.absolute().parents) if not p.exists()), None)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if dst.is_dir():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        _remove(tmp)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ------------------------------------------------------------------------------------------- checking tensors
def empty_state(args) -> dict[str, torch.Tensor]:
    """The model's state dict on the meta device: every name and shape, no memory."""
    with torch.device("meta"):
        return build_model(args).state_dict()


def check_tensors(file: str | Path, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  ignored: set[str] = frozenset()) -> None:
    """ConvertError naming the first missing, extra or misshapen tensor of `got` (names in the file's own terms),
    and how many problems there are in all. `ignored` names may be present or not."""
    problems = [f"missing tensor {k}" for k in expected if k not in got and k not in ignored]
    problems += [f"tensor {k} is not part of this model" for k in got if k not in expected and k not in ignored]
    problems += [f"tensor {k} has shape {tuple(got[k].shape)}, the config says {tuple(v.shape)}"
                 for k, v in expected.items() if k in got and tuple(got[k].shape) != tuple(v.shape)]
    if problems:
        n = len(problems) - 1
        more = f" (and {n} more problem{'s' if n > 1 else ''})" if n else ""
        raise ConvertError(f"{file}: {problems[0]}{more}")


def load_torch_file(path: Path, what: str = "PyTorch checkpoint") -> dict:
    """torch.load of a plain tensor file (no code runs: weights_only), memory-mapped where the file allows it."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)   # the legacy (pre-zip) format
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(f"{path}: not a readable {what} ({first})") from None


def build_args(name: str, fields: dict, file: str | Path):
    """The Args dataclass of model `name` from `fields`, validated; ConvertError naming the file otherwise."""
    args_cls = model_args_class(name)
    if args_cls is None:
        raise ConvertError(f"{file}: unknown model {name!r} (known: {', '.join(known_models())})")
    try:
        args = build_dataclass(args_cls, {"name": name, **fields}, "model")
        args.validate()
    except ConfigError as e:
        raise ConvertError(f"{file}: {e.line()}") from None
    return args


# -------------------------------------------------------------------------------------------- export folders
def is_export_folder(folder: Path) -> bool:
    try:
        meta = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("model"), dict) and "name" in meta["model"]


def read_args(folder: str | Path):
    path = Path(folder) / CONFIG
    try:
        meta = json.loads(path.read_text())["model"]
        fields = {k: v for k, v in meta.items() if k != "name"}
        return build_args(meta["name"], fields, path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, ConvertError):
            raise
        raise ConvertError(f"{path}: not a flame export config ({type(e).__name__}: {e})") from None


def read_export(folder: str | Path) -> ModelState:
    folder = Path(folder)
    args = read_args(folder)
    path = folder / WEIGHTS
    try:
        state = as_fp32(load_file(str(path)))
    except (OSError, SafetensorError) as e:
        raise ConvertError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    check_tensors(path, state, empty_state(args))
    meta = json.loads((folder / CONFIG).read_text())
    return ModelState(args, state, str(folder.resolve()), meta.get("step"), folder_tokenizer_files(folder),
                      f"{folder} holds no tokenizer files; none copied", seq_len=meta.get("seq_len"))


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with the file's mode following the umask like every other file written: safetensors
    writes a private temporary file (mode 0600) and renames it into place, which would leave the weights unreadable
    to the group that can read the rest of the folder."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def write_export(dst: str | Path, model: ModelState) -> Path:
    """`dst` as an export folder, complete or absent."""
    dst = Path(dst)
    with staged_output(dst) as tmp:
        tmp.mkdir()
        save_safetensors(standalone(model.state), tmp / WEIGHTS)
        meta = {"model": dataclasses.asdict(model.args), "step": model.step, "source": model.source,
                "seq_len": model.seq_len}
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2))
        copy_tokenizer(model.tokenizer, tmp)
    return dst


# ---------------------------------------------------------------------------------------------- run folders
def is_run_folder(folder: Path) -> bool:
    return (folder / "checkpoint").is_dir() or (folder / "config.toml").is_file()


def check_shards(path: Path) -> None:
    """ConvertError naming the shard files the checkpoint's metadata lists but its folder lacks: on several nodes
    each node writes its own ranks' files, so a run folder that is not shared holds only some of them."""
    storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data or {}
    files = {info.relative_path for info in storage.values()}
    missing = sorted(files - {p.name for p in path.iterdir()})
    if missing:
        raise ConvertError(f"{path}: {len(missing)} of its {len(files)} shard files missing: {', '.join(missing)} "
                           "(each node writes its own ranks' shards: share the run folder between all nodes, or copy "
                           "the other nodes' files into it)")


def read_run(run_dir: str | Path, step: int | None = None) -> ModelState:
    """The model of a run folder's newest complete checkpoint (or `step`), whatever the number of ranks that saved
    it, with the tokenizer its config names."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConvertError(f"{run_dir}: no such run folder")
    folder = run_dir / "checkpoint"
    steps = complete_steps(folder)
    if not steps:
        raise ConvertError(f"{folder}: no complete checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConvertError(f"{folder}: no complete checkpoint step-{step} (complete: {steps})")
    path = str(folder / f"step-{step}")
    check_shards(Path(path))
    if problem := unreadable_file(Path(path)):  # its checksums too: a damaged checkpoint is not exported
        raise ConvertError(f"{path} cannot be loaded: {problem}")
    train_state = {"config": ""}
    with warnings.catch_warnings():  # DCP warns that it loads in a single process, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load({"train_state": train_state}, checkpoint_id=path, no_dist=True)
        try:
            cfg = config_from_toml(train_state["config"])
        except ConfigError as e:  # saved by a flame whose config keys differ from this one's
            raise ConvertError(f"{path}: its saved config does not load here ({e.line()})") from None
        with torch.device("meta"):
            model = build_model(cfg.model)
        state = {"model": model.to_empty(device="cpu").state_dict()}
        dcp.load(state, checkpoint_id=path, no_dist=True)  # full tensors, whatever the number of ranks that saved
    note = f"tokenizer {cfg.data.tokenizer!r} is not a local file; not copied"
    try:
        tokenizer = tokenizer_files(cfg.data.tokenizer, f"{run_dir}: data.tokenizer")
    except ConvertError as e:  # the weights are still worth having
        tokenizer, note = {}, f"{e}; no tokenizer copied"
    return ModelState(cfg.model, as_fp32(state["model"]), str(run_dir.resolve()), step,
                      tokenizer, note, seq_len=cfg.training.seq_len)


def export(run_dir: Path, out_dir: Path, step: int | None = None) -> ModelState:
    """Write the run's checkpoint (the newest complete one, or `step`) as an export folder; returns what was read."""
    with stage(f"read {run_dir}" + (f" step {step}" if step is not None else "")):
        model = read_run(run_dir, step)
    for note in model.messages():
        print(f"note: {note}", file=sys.stderr)
    with stage(f"wrote {out_dir}"):
        write_export(out_dir, model)
    return model


# ------------------------------------------------------------------------------------------------ loading back
def load_exported(folder: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The exported model, ready for evaluation or generation."""
    exported = read_export(folder)
    with torch.device("meta"):
        model = build_model(exported.args)
    model = model.to_empty(device=device)
    load_weights(model, exported.state, exported.args)
    return model


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], args=None) -> None:
    """Copy flame-named `weights` into `model`; otherwise a ValueError of one line (its caller names the source):
    given the source's args, a source of another architecture names both, one with other settings names the settings
    that differ; then how many tensors do not fit, and the first few."""
    mine = getattr(model, "args", None)
    if args is not None and mine is not None and args.name != mine.name:
        raise ValueError(f"holds a {args.name!r} model (model.name), not a {mine.name!r} one: weights do not carry "
                         f"over between architectures")
    own = model.state_dict()
    problems = [f"{k}: missing there" for k in own if k not in weights]
    problems += [f"{k}: not in this model" for k in weights if k not in own]
    problems += [f"{k}: shape {tuple(weights[k].shape)} there, {tuple(v.shape)} here"
                 for k, v in own.items() if k in weights and weights[k].shape != v.shape]
    if problems:
        changed = []
        if args is not None and mine is not None:
            changed = [f"model.{k}: {v!r} there, {getattr(mine, k, None)!r} here"
                       for k, v in vars(args).items() if getattr(mine, k, None) != v]
        settings = f"model settings differ ({'; '.join(changed)}); " if changed else ""
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        count = f"{len(problems)} tensors do not fit" if len(problems) > 1 else "1 tensor does not fit"
        raise ValueError(f"weights do not fit this model: {settings}{count} ({shown})")
    model.load_state_dict(weights)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m flame.export",
        description="Export a checkpoint of a flame run as a folder of config.json (model settings, step, training "
                    "seq_len), model.safetensors (fp32 weights) and the run's tokenizer files. The folder is what "
                    "flame.eval, flame.generate, flame.lm_eval and checkpoint.init_from read; flame.convert turns "
                    "it into FLA / Hugging Face or RWKV-LM formats.",
        epilog="Any number of ranks may have saved the checkpoint. OUT_DIR is written whole or not at all. Bad input "
               "is one line on stderr and exit code 2.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run folder (job.dump_folder): its checkpoint/step-N folders are read")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the export folder to write; must not exist yet "
                   "(an empty folder is fine)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="export checkpoint step-N (default: the newest complete checkpoint)")
    a = p.parse_args(argv)
    try:
        model = export(a.run_dir, a.out_dir, a.step)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported step {model.step} of {a.run_dir} to {a.out_dir} ({model.args.name}, "
          f"{sum(v.numel() for v in model.state.values()) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
