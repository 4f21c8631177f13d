"""Packing: a stream of tokenized documents -> micro-batches of [batch_size, seq_len] with no padding.

The documents are concatenated; row b of a micro-batch is the window stream[b*T : b*T + T + 1] (inputs: its first
T tokens, labels: its last T), so consecutive windows share one token and every token after the very first is a
label exactly once. What is left after a batch carries into the next one.

varlen mode adds `cu_seqlens`, the segment boundaries over the flattened B*T inputs: a segment starts at every
row start and at every document start, and no segment is longer than max_doc_len. The label whose target is the
first token of the next document is IGNORE_INDEX: a segment cannot see across the boundary it would predict.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from flame.loss import IGNORE_INDEX


class Packer:
    def __init__(self, *, seq_len: int, batch_size: int, varlen: bool, max_doc_len: int, dtype: np.dtype):
        self.seq_len, self.batch_size, self.varlen, self.max_doc_len = seq_len, batch_size, varlen, max_doc_len
        self.dtype = np.dtype(dtype)
        self.carry = np.zeros(0, self.dtype)
        self.carry_starts_document = True  # False when the carry is the tail of a document

    def state_dict(self) -> dict:
        return {"carry": self.carry.tobytes(), "carry_starts_document": self.carry_starts_document}

    def load_state_dict(self, state: dict) -> None:
        self.carry = np.frombuffer(state["carry"], self.dtype).copy()
        self.carry_starts_document = bool(state["carry_starts_document"])

    def next_batch(self, next_document: Callable[[], np.ndarray]) -> dict[str, torch.Tensor]:
        """Pull documents (token arrays, boundary tokens included) until one micro-batch is full."""
        n = self.batch_size * self.seq_len
        pieces, doc_starts, total = [self.carry], [0] if self.carry_starts_document else [], len(self.carry)
        while total < n + 1:
            doc = next_document()
            pieces.append(doc)
            doc_starts.append(total)
            total += len(doc)
        stream = np.concatenate(pieces) if len(pieces) > 1 else self.carry
        # Every piece starts at or before n, so the tail is part of the last piece only.
        self.carry = stream[n:].copy()
        self.carry_starts_document = bool(doc_starts) and doc_starts[-1] == n
        window = stream[: n + 1].astype(np.int64)
        batch = {"input_ids": torch.from_numpy(window[:-1].reshape(self.batch_size, self.seq_len)),
                 "labels": torch.from_numpy(window[1:].reshape(self.batch_size, self.seq_len).copy())}
        if self.varlen:
            batch["cu_seqlens"] = self._cu_seqlens([s for s in doc_starts if s < n], n)
            targets_starting_a_document = [s - 1 for s in doc_starts if 0 < s <= n]
            batch["labels"].view(-1)[targets_starting_a_document] = IGNORE_INDEX
        return batch

    def _cu_seqlens(self, doc_starts: list[int], n: int) -> torch.Tensor:
        starts = sorted(set(doc_starts) | set(range(0, n, self.seq_len)))
        bounds = []
        for start, end in zip(starts, starts[1:] + [n]):
            step = self.max_doc_len if self.max_doc_len > 0 else end - start
            bounds.extend(range(start, end, step))
        return torch.tensor(bounds + [n], dtype=torch.int32)
