"""What flame.eval's tests score: held-out documents, a byte-level BPE tokenizer trained on them and a tiny exported
Transformer using it (tests/test_eval.py in one process, tests/test_eval_distributed.py on two ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flame.export import ModelState, write_export
from flame.models import build_model, model_args_class
from tests.helpers import byte_bpe

DOCS = ["the quick brown fox jumps over the lazy dog. " * 3,
        "héllo wörld, naïve café ünïcode text",
        "a",
        "pack my box with five dozen liquor jugs " * 4]
SEQ_LEN = 16


def tiny_eval_export(base: Path):
    """(base, export folder, held-out .jsonl, tokenizer, the exported model in eval mode) under `base`."""
    tok = byte_bpe(DOCS, base / "tokenizer.json")
    args = model_args_class("transformer")(name="transformer", vocab_size=320, hidden_size=64, num_layers=2,
                                           num_heads=2)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export = write_export(base / "export", ModelState(args, state, "test",
                                                      tokenizer={"tokenizer.json": base / "tokenizer.json"}))
    data = base / "held_out.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return base, export, data, tok, model.eval()


def parse(out: str) -> dict[str, float]:
    """flame.eval's printed `key: value` lines."""
    return {k: float(v) for k, v in (line.split(": ") for line in out.strip().splitlines())}
