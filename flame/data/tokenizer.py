"""Loading the tokenizer (a tokenizer.json file or a hub id) and naming its document-boundary tokens."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from flame.data.paths import resolve_path


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the ids the pipeline needs. Document text never yields control tokens: a
    document that contains the string "<|endoftext|>" is tokenized as that text, not as the boundary token."""

    def __init__(self, spec: str, *, eos_token: str, bos_token: str):
        path = resolve_path(spec)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if os.path.isfile(path):
            self.tokenizer = Tokenizer.from_file(path)
        elif os.path.exists(path) or spec.startswith((".", "/")) or spec.endswith(".json"):
            raise FileNotFoundError(f"no tokenizer.json at {spec!r}")
        else:
            self.tokenizer = Tokenizer.from_pretrained(spec)  # a hub id; needs the network once, then the cache
        self.tokenizer.encode_special_tokens = True
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._token_id(eos_token, "eos_token")
        self.bos_id = self._token_id(bos_token, "bos_token")

    def _token_id(self, token: str, what: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (batched: one call into Rust for many documents)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
