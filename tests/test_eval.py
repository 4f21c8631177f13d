"""flame.eval against a plain PyTorch reference: the model's logits on the same token windows, F.cross_entropy
summed; bits per byte against bytes counted here from the documents; --max-tokens; the one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flame.eval import main
from tests.eval_export import DOCS, SEQ_LEN, parse, tiny_eval_export
from tests.helpers import EOS, one_error_line


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_eval_export(tmp_path_factory.mktemp("eval"))


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
        one_error_line(capsys, main, argv, "flame.eval")
    else:
        one_error_line(capsys, main, argv + ["--device", "cpu"])
