"""Convert models between flame, RWKV-LM and FLA / Hugging Face, in any direction.

    python -m flame.convert SRC DST [--to flame|fla|hf|rwkv-lm] [--tokenizer PATH] [--step N]

SRC, detected by what it holds:
  - an RWKV-LM RWKV-7 (x070) or RWKV-6 (x060) checkpoint: a .pth file of RWKV-LM-named tensors (version and
    settings read off their names and shapes);
  - an FLA / Hugging Face folder: config.json with model_type rwkv7, rwkv6, gsa or llama (flame's Transformer),
    weights as model.safetensors, sharded safetensors (model.safetensors.index.json) or pytorch_model.bin;
  - a flame export folder (config.json with "model", model.safetensors: python -m flame.export writes these);
  - a flame run folder: its newest complete checkpoint, or --step N (any number of ranks saved it).
DST, by --to: flame (default) an export folder for flame.export.load_exported and checkpoint.init_from; fla (or hf,
the same) a folder that transformers' AutoModelForCausalLM.from_pretrained loads: RWKV-7, RWKV-6 and GSA with fla
installed, the Transformer as a Llama without it; rwkv-lm a .pth that RWKV-LM and the rwkv package load (RWKV-7 and
RWKV-6). DST is written whole or not at all, and must not exist yet.

Tokenizers travel along: tokenizer.json, or RWKV's World vocabulary under its own name. --tokenizer PATH (a
tokenizer.json, a World .txt, a folder holding one, or "rwkv-world") attaches one instead. An RWKV-LM .pth holds
none: vocabulary 65536 gets the World vocabulary of the installed rwkv package, 50277 / 50304 the bundled GPT-NeoX
tokenizer.json.

Bad input (a missing SRC, an unknown format or model type, a missing, extra or misshapen tensor) is one line on
stderr naming the file and the tensor, and exit code 2. Reading and writing each end with a line and its time on
stderr when it is a terminal or the stage was slow (flame.export.stage).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch import nn

from flame.convert_fla import is_fla_folder, read_fla, write_fla
from flame.convert_rwkv_lm import read_rwkv_lm, write_rwkv_lm
from flame.data.tokenizer import WORLD_MODEL_VOCAB, WORLD_SPEC
from flame.export import (ConvertError, ModelState, is_export_folder, is_run_folder, load_weights, read_export,
                          read_run, stage, tokenizer_files, write_export)

TARGETS = ("flame", "fla", "hf", "rwkv-lm")
"""Output formats; fla and hf are one: an FLA / Hugging Face folder (FLA's models, transformers' Llama)."""
NEOX_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json"
NEOX_VOCABS = (50277, 50304)
"""GPT-NeoX-20B's vocabulary, and padded to a multiple of 64 as RWKV-LM's Pile models have it."""


def detect(src: Path) -> str:
    """The format of `src`: rwkv-lm, fla, flame-export or flame-run; ConvertError if it is none of them."""
    if not src.exists():
        raise ConvertError(f"{src}: no such file or folder")
    if src.is_file():
        if src.suffix in (".pth", ".pt"):
            return "rwkv-lm"
        raise ConvertError(f"{src}: unknown format (a file that is not an RWKV-LM .pth)")
    if is_export_folder(src):
        return "flame-export"
    if is_fla_folder(src):
        return "fla"
    if is_run_folder(src):
        return "flame-run"
    raise ConvertError(f"{src}: unknown format (no config.json of flame or FLA / Hugging Face, no checkpoint/ of "
                       f"a flame run)")


def read_model(src: str | Path, step: int | None = None) -> ModelState:
    """Any supported source as flame model args + a flame state dict (fp32) + its tokenizer files."""
    src = Path(src)
    kind = detect(src)
    if step is not None and kind != "flame-run":
        raise ConvertError(f"{src}: --step applies to a flame run folder only (this is {kind})")
    if kind == "rwkv-lm":
        model = read_rwkv_lm(src)
        model.tokenizer, model.tokenizer_note = default_tokenizer(model.args.vocab_size)
        return model
    if kind == "fla":
        return read_fla(src)
    if kind == "flame-export":
        return read_export(src)
    return read_run(src, step)


def default_tokenizer(vocab_size: int) -> tuple[dict[str, Path], str | None]:
    """The tokenizer a checkpoint without one most likely used, judged by its vocabulary (and a note when none)."""
    if vocab_size == WORLD_MODEL_VOCAB:
        try:
            return tokenizer_files(WORLD_SPEC), None
        except ConvertError as e:
            return {}, f"vocabulary {vocab_size} (RWKV World), but {e}: no tokenizer copied"
    if vocab_size in NEOX_VOCABS:
        return {"tokenizer.json": NEOX_TOKENIZER}, None
    return {}, f"no tokenizer known for vocabulary {vocab_size}: none copied (attach one with --tokenizer)"


def write_model(model: ModelState, dst: str | Path, to: str = "flame") -> Path:
    dst = Path(dst)
    if to == "flame":
        return write_export(dst, model)
    if to in ("fla", "hf"):
        return write_fla(dst, model)
    if to == "rwkv-lm":
        return write_rwkv_lm(dst, model)
    raise ConvertError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")


def convert(src: str | Path, dst: str | Path, to: str = "flame", tokenizer: str | None = None,
            step: int | None = None) -> ModelState:
    """Read `src` (any format), write `dst` in format `to`; returns what was read (its notes included)."""
    if tokenizer is not None and to == "rwkv-lm":
        raise ConvertError(f"--tokenizer {tokenizer}: an RWKV-LM .pth holds no tokenizer")
    attached = tokenizer_files(tokenizer, "--tokenizer") if tokenizer is not None else None
    if attached == {}:
        raise ConvertError(f"--tokenizer {tokenizer!r}: not a local tokenizer file or folder (hub ids are not fetched)")
    with stage(f"read {src} ({detect(Path(src))})"):
        model = read_model(src, step)
    if attached is not None:
        model.tokenizer = attached
    with stage(f"wrote {dst} ({to})"):
        write_model(model, dst, to)
    return model


def load_init_weights(model: nn.Module, source: str | Path) -> ModelState:
    """checkpoint.init_from: copy the weights of any supported source into `model` (built from the run's config).
    Raises ConvertError for a source that cannot be read, ValueError of one line for weights that do not fit (both
    architectures named where they differ, else the settings that differ and the tensors that do not fit)."""
    loaded = read_model(source)
    load_weights(model, loaded.state, loaded.args)
    return loaded


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flame.convert",
                                description="Convert a model between flame, RWKV-LM (.pth) and FLA / Hugging Face.")
    p.add_argument("src", type=Path, help="RWKV-LM .pth, FLA/HF folder, flame export folder or flame run folder")
    p.add_argument("dst", type=Path, help="the folder (or .pth for --to rwkv-lm) to write; must not exist")
    p.add_argument("--to", choices=TARGETS, default="flame",
                   help="output format (default: flame export folder; fla = hf: an FLA / Hugging Face folder)")
    p.add_argument("--tokenizer", default=None,
                   help='tokenizer to attach: a tokenizer.json, a World vocabulary .txt, a folder, or "rwkv-world"')
    p.add_argument("--step", type=int, default=None, help="run folders: checkpoint step (default: newest complete)")
    a = p.parse_args(argv)
    try:
        model = convert(a.src, a.dst, a.to, a.tokenizer, a.step)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for note in dict.fromkeys(model.messages()):
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {a.dst} ({a.to}: {model.args.name}, {sum(v.numel() for v in model.state.values()) / 1e6:.1f}M "
          f"parameters) from {a.src}")


if __name__ == "__main__":
    main()
