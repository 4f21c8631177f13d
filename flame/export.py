"""Export a checkpoint as a plain model folder, and load such a folder back.

    python -m flame.export RUN_DIR [--step N] OUT_DIR

OUT_DIR gets config.json (the model's settings), model.safetensors (full fp32 weights) and tokenizer.json. flame
loads it back with `load_exported` (evaluation, generation) or starts a new run from it with checkpoint.init_from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn

from flame.checkpoint import complete_steps
from flame.config import build_dataclass, config_from_toml
from flame.models import build_model, model_args_class

REPO = Path(__file__).resolve().parents[1]


def _empty_model(args, device="cpu") -> nn.Module:
    with torch.device("meta"):
        model = build_model(args)
    return model.to_empty(device=device)


def export(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    folder = run_dir / "checkpoint"
    steps = complete_steps(folder)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {folder}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"no complete checkpoint step-{step} in {folder} (complete: {steps})")
    path = str(folder / f"step-{step}")
    train_state = {"config": ""}
    with warnings.catch_warnings():  # DCP warns that it loads in a single process, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load({"train_state": train_state}, checkpoint_id=path, no_dist=True)
        cfg = config_from_toml(train_state["config"])
        model = _empty_model(cfg.model)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path, no_dist=True)  # full tensors, whatever the number of ranks that saved

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state["model"].items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(
        {"model": dataclasses.asdict(cfg.model), "step": step, "source": str(run_dir.resolve())}, indent=2))
    tokenizer = _tokenizer_file(cfg.data.tokenizer)
    if tokenizer is not None:
        shutil.copy(tokenizer, out_dir / "tokenizer.json")
    else:
        print(f"note: tokenizer {cfg.data.tokenizer!r} is not a local file; not copied", file=sys.stderr)
    return out_dir


def _tokenizer_file(name: str) -> Path | None:
    for base in (Path.cwd(), REPO):
        p = base / name
        if p.is_dir():
            p = p / "tokenizer.json"
        if p.is_file():
            return p
    return None


def read_args(folder: str | Path):
    meta = json.loads((Path(folder) / "config.json").read_text())["model"]
    args_cls = model_args_class(meta["name"])
    if args_cls is None:
        raise ValueError(f"{folder}: unknown model {meta['name']!r}")
    return build_dataclass(args_cls, meta, "model")


def load_exported(folder: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The exported model, ready for evaluation or generation."""
    model = _empty_model(read_args(folder), device)
    load_exported_weights(model, folder)
    return model


def load_exported_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy an exported folder's weights into `model` (same architecture), naming any mismatch."""
    weights = load_file(str(Path(folder) / "model.safetensors"))
    own = model.state_dict()
    problems = [f"{k}: missing from {folder}" for k in own if k not in weights]
    problems += [f"{k}: not in this model" for k in weights if k not in own]
    problems += [f"{k}: shape {tuple(weights[k].shape)} in {folder}, {tuple(v.shape)} here"
                 for k, v in own.items() if k in weights and weights[k].shape != v.shape]
    if problems:
        raise ValueError("exported weights do not fit this model:\n  " + "\n  ".join(problems[:8]))
    model.load_state_dict(weights)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Export a flame checkpoint as config.json + model.safetensors.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    a = p.parse_args(argv)
    out = export(a.run_dir, a.out_dir, a.step)
    print(f"exported {a.run_dir} to {out}")


if __name__ == "__main__":
    main()
