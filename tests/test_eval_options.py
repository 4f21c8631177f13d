"""flame.eval --step N scores that checkpoint of a run folder and --json prints the same figures as one object,
both against a plain PyTorch reference from the checkpoint's own tensors; weights of another architecture given as
checkpoint.init_from stop the run with one short line naming both architectures."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flame.config import load_config
from flame.convert import load_init_weights
from flame.eval import main
from flame.export import ModelState, write_export
from flame.models import build_model, model_args_class
from tests.helpers import read_checkpoint, run_train, write_config

EOS = "<|endoftext|>"
DOCS = ["the quick brown fox jumps over the lazy dog. " * 3, "pack my box with five dozen liquor jugs " * 4]
SEQ_LEN = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Transformer run with checkpoints at steps 1 and 2, a tokenizer that fits its vocabulary, held-out text."""
    base = tmp_path_factory.mktemp("eval_options")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(base / "tokenizer.json"))
    data = base / "held_out.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    config, dump = write_config(base)
    proc = run_train(config, "--training.steps=2", "--checkpoint.interval=1", "--optimizer.lr=1e-2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, dump, data, tok


def reference_loss(config, dump, step: int, tok) -> float:
    """Mean cross entropy of the leading-eos token stream in windows of SEQ_LEN + 1 sharing their end token, from
    the checkpoint's tensors in a model built here."""
    model = build_model(load_config(str(config)).model)
    model.load_state_dict(read_checkpoint(dump, step)["model"])
    eos = tok.token_to_id(EOS)
    stream = [eos]
    for d in DOCS:
        stream += tok.encode(d, add_special_tokens=False).ids + [eos]
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, SEQ_LEN):
            w = torch.tensor(stream[start:start + SEQ_LEN + 1])
            total += F.cross_entropy(model(w[None, :-1])[0].double(), w[1:], reduction="sum").item()
    return total / (len(stream) - 1)


def flame_eval(capsys, dump, data, tok_dir, *more: str) -> str:
    main([str(dump), "--data", str(data), "--seq-len", str(SEQ_LEN), "--device", "cpu", "--tokenizer",
          str(tok_dir / "tokenizer.json"), *more])
    return capsys.readouterr().out


def test_step_and_json(run, capsys):
    config, dump, data, tok = run
    tok_dir = data.parent
    results = {}
    for step in (1, 2):
        out = flame_eval(capsys, dump, data, tok_dir, "--step", str(step), "--json")
        results[step] = json.loads(out)   # one JSON object, nothing else on stdout
        assert results[step]["step"] == step and results[step]["model"] == str(dump)
        assert results[step]["loss"] == pytest.approx(reference_loss(config, dump, step, tok), rel=1e-5)
    assert results[1]["loss"] != results[2]["loss"]
    assert set(results[1]) == {"model", "step", "data", "tokens", "bytes", "loss", "perplexity", "bits_per_byte"}

    text = flame_eval(capsys, dump, data, tok_dir)   # no --step: the newest checkpoint; no --json: key: value lines
    lines = dict(line.split(": ") for line in text.strip().splitlines())
    assert float(lines["loss"]) == pytest.approx(results[2]["loss"], abs=1e-6)
    assert int(lines["tokens"]) == results[2]["tokens"] and int(lines["bytes"]) == results[2]["bytes"]


def test_a_missing_step_is_one_line(run, capsys):
    config, dump, data, tok = run
    with pytest.raises(SystemExit) as e:
        flame_eval(capsys, dump, data, data.parent, "--step", "7")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "step-7" in err and "[1, 2]" in err, err


def tiny_export(path, name: str, **fields):
    args = model_args_class(name)(name=name, vocab_size=512, num_layers=2, **fields)
    model = build_model(args)
    model.init_weights()
    return write_export(path, ModelState(args, dict(model.state_dict()), "test"))


def test_init_from_of_another_architecture_is_one_short_line(run, tmp_path):
    config, dump, data, tok = run
    rwkv7 = tiny_export(tmp_path / "rwkv7", "rwkv7", hidden_size=64, head_dim=16)
    config2, _ = write_config(tmp_path, "child")
    proc = run_train(config2, "--training.steps=1", f"--checkpoint.init_from={rwkv7}")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "'rwkv7'" in err and "'transformer'" in err and "architectures" in err and len(err) < 300, err


def test_init_from_with_other_settings_names_them_in_one_line(tmp_path):
    wide = tiny_export(tmp_path / "wide", "transformer", hidden_size=64, num_heads=4)
    args = model_args_class("transformer")(name="transformer", vocab_size=512, num_layers=2, hidden_size=32,
                                           num_heads=4)
    with pytest.raises(ValueError) as e:
        load_init_weights(build_model(args), wide)
    message = str(e.value)
    assert "\n" not in message and "model.hidden_size: 64 there, 32 here" in message, message
    assert "embed.weight: shape (512, 64) there, (512, 32) here" in message and len(message) < 600, message
