"""The committed GPT-NeoX-20B tokenizer.json against reference vectors made by llama.cpp's own BPE implementation
(scripts/convert_neox_tokenizer.py wrote them from the same gguf vocabulary)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "tokenizer" / "gpt-neox-20b" / "reference.jsonl"
ROWS = [json.loads(line) for line in REFERENCE.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("row", ROWS, ids=[repr(r["text"][:24]) for r in ROWS])
def test_reference_vectors(tokenizer, row):
    assert tokenizer.encode_batch([row["text"]]) == [row["ids"]]


def test_vocabulary_and_boundary_tokens(tokenizer):
    assert len(ROWS) >= 30
    assert tokenizer.vocab_size == 50277  # GPT-NeoX-20B; llama.cpp's padding rows are not tokens
    assert tokenizer.eos_id == tokenizer.bos_id == tokenizer.tokenizer.token_to_id("<|endoftext|>") == 0


def test_decode_gives_back_the_normalized_text(tokenizer):
    for row in ROWS:
        text = row["text"]
        assert tokenizer.tokenizer.decode(row["ids"], skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_the_tests_small_tokenizer_is_the_sample_bpe(tmp_path):
    """tests/assets/sample_bpe512.json (tests.helpers.SMALL_TOKENIZER) is what byte_bpe trains on the sample's eval
    documents today: a file anyone can make again, not an opaque blob."""
    from tests.helpers import REPO, SMALL_TOKENIZER, byte_bpe

    docs = [json.loads(line)["text"] for line in (REPO / "data/sample/eval/eval-00.jsonl").read_text().splitlines()]
    byte_bpe(docs, tmp_path / "tokenizer.json", vocab_size=512)
    assert (tmp_path / "tokenizer.json").read_text() == SMALL_TOKENIZER.read_text()
