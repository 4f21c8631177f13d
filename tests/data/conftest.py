"""Shared fixtures of the data tests (helpers that write corpora live in corpora.py)."""

from __future__ import annotations

import pytest

from tests.data.corpora import TOKENIZER


@pytest.fixture(scope="session")
def tokenizer():
    from flame.data.tokenizer import TextTokenizer

    return TextTokenizer(TOKENIZER, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
