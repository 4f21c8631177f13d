"""flame.eval against a plain PyTorch reference: the model's logits on the same token windows, F.cross_entropy
summed; bits per byte against bytes counted here from the documents; --max-tokens; the one-line errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flame.eval import main
from flame.export import ModelState, write_export
from flame.models import build_model, model_args_class
from tests.helpers import REPO, env

EOS = "<|endoftext|>"
DOCS = ["the quick brown fox jumps over the lazy dog. " * 3,
        "héllo wörld, naïve café ünïcode text",
        "a",
        "pack my box with five dozen liquor jugs " * 4]
SEQ_LEN = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(base / "tokenizer.json"))
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


def reference(model, tok, n_targets=None):
    """Summed cross entropy of the leading-eos token stream in windows of SEQ_LEN + 1 sharing their end token."""
    eos = tok.token_to_id(EOS)
    stream = [eos]
    for d in DOCS:
        stream += tok.encode(d, add_special_tokens=False).ids + [eos]
    if n_targets is not None:
        stream = stream[:n_targets + 1]
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, SEQ_LEN):
            w = torch.tensor(stream[start:start + SEQ_LEN + 1])
            logits = model(w[None, :-1])[0].double()
            total += F.cross_entropy(logits, w[1:], reduction="sum").item()
    return total, len(stream) - 1


def parse(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.split(": ") for line in out.strip().splitlines())}


def test_loss_and_bits_per_byte_match_reference(setup, capsys):
    base, export, data, tok, model = setup
    main([str(export), "--data", str(data), "--seq-len", str(SEQ_LEN), "--batch-size", "3", "--device", "cpu"])
    got = parse(capsys.readouterr().out)
    loss_sum, n = reference(model, tok)
    n_bytes = sum(len(d.encode("utf-8")) + 1 for d in DOCS)  # each document's text and its eos
    assert n > 4 * SEQ_LEN and got["tokens"] == n and got["bytes"] == n_bytes
    assert got["loss"] == pytest.approx(loss_sum / n, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(loss_sum / n), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(loss_sum / math.log(2) / n_bytes, rel=1e-5)


def test_max_tokens_cuts_inside_a_document(setup, capsys):
    base, export, data, tok, model = setup
    first = len(tok.encode(DOCS[0], add_special_tokens=False).ids)
    cut = first + 1 + 5  # all of document 0 and its eos, then 5 tokens of document 1
    main([str(export), "--data", str(data), "--seq-len", str(SEQ_LEN), "--max-tokens", str(cut), "--device", "cpu"])
    got = parse(capsys.readouterr().out)
    loss_sum, n = reference(model, tok, cut)
    covered = tok.decode(tok.encode(DOCS[1], add_special_tokens=False).ids[:5])
    assert "\ufffd" not in covered and DOCS[1].startswith(covered) and len(covered) < len(DOCS[1])
    assert n == cut and got["tokens"] == cut
    assert got["bytes"] == len(DOCS[0].encode()) + 1 + len(covered.encode())
    assert got["loss"] == pytest.approx(loss_sum / n, rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(loss_sum / math.log(2) / got["bytes"], rel=1e-5)


@pytest.mark.parametrize("case", ["missing model", "no files", "bad tokenizer", "no tokenizer"])
def test_bad_input_is_one_line(setup, tmp_path, capsys, case):
    base, export, data, tok, model = setup
    argv = [str(export), "--data", str(data)]
    if case == "missing model":
        argv[0] = str(tmp_path / "nope")
    elif case == "no files":
        argv[2] = str(tmp_path / "*.jsonl")
    elif case == "bad tokenizer":
        (tmp_path / "tokenizer.json").write_text("{not json")
        argv += ["--tokenizer", str(tmp_path / "tokenizer.json")]
    else:
        bare = tmp_path / "bare"
        bare.mkdir()
        for name in ("config.json", "model.safetensors"):
            (bare / name).write_bytes((export / name).read_bytes())
        argv[0] = str(bare)
    if case == "missing model":  # once through the real entry point
        r = subprocess.run([sys.executable, "-m", "flame.eval", *argv], capture_output=True, text=True, cwd=REPO,
                           env=env(), timeout=120)
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(argv + ["--device", "cpu"])
        code, (out, err) = exit_info.value.code, capsys.readouterr()
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert out == ""
