"""Packing against plain Python: windows reproduce the document stream; varlen boundaries and masked labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flame.data.packing import Packer
from flame.loss import IGNORE_INDEX


def documents(seed: int, n: int):
    rng = np.random.default_rng(seed)
    # lengths from 1 token to several rows long; token values are unique per document position for readability
    return [rng.integers(1, 50_000, size=int(rng.choice([1, 2, 5, 30, 77, 300]))).astype(np.uint16) for _ in range(n)]


def take_batches(packer: Packer, docs, n_batches):
    it = iter(docs)
    return [packer.next_batch(lambda: next(it)) for _ in range(n_batches)]


@pytest.mark.parametrize("seq_len,batch_size", [(16, 1), (16, 3), (64, 2)])
def test_windows_reproduce_the_stream_without_padding_or_loss(seq_len, batch_size):
    docs = documents(0, 2000)
    packer = Packer(seq_len=seq_len, batch_size=batch_size, varlen=False, max_doc_len=0, dtype=np.uint16)
    batches = take_batches(packer, docs, 40)
    stream = np.concatenate(docs).astype(np.int64)
    n = seq_len * batch_size
    for k, batch in enumerate(batches):
        assert set(batch) == {"input_ids", "labels"}
        for b in range(batch_size):
            start = k * n + b * seq_len
            assert batch["input_ids"][b].tolist() == stream[start: start + seq_len].tolist()
            assert batch["labels"][b].tolist() == stream[start + 1: start + seq_len + 1].tolist()


def reference_segments(doc_lengths, n_total, seq_len, batch_size, max_doc_len, k):
    """Plain Python: document start positions in the whole stream -> batch k's cu_seqlens and masked labels."""
    starts, pos = set(), 0
    for length in doc_lengths:
        starts.add(pos)
        pos += length
    n = seq_len * batch_size
    lo = k * n
    bounds = sorted({p - lo for p in starts if lo <= p < lo + n} | set(range(0, n, seq_len)))
    cu = []
    for a, b in zip(bounds, bounds[1:] + [n]):
        while b - a > max_doc_len > 0:
            cu.append(a)
            a += max_doc_len
        cu.append(a)
    masked = sorted(p - lo - 1 for p in starts if lo < p <= lo + n)
    return cu + [n], masked


@pytest.mark.parametrize("max_doc_len", [0, 7])
def test_varlen_boundaries_and_masked_labels(max_doc_len):
    seq_len, batch_size = 32, 3
    docs = documents(1, 3000)
    packer = Packer(seq_len=seq_len, batch_size=batch_size, varlen=True, max_doc_len=max_doc_len, dtype=np.uint16)
    batches = take_batches(packer, docs, 30)
    stream = np.concatenate(docs).astype(np.int64)
    n = seq_len * batch_size
    for k, batch in enumerate(batches):
        cu, masked = reference_segments([len(d) for d in docs], len(stream), seq_len, batch_size, max_doc_len, k)
        assert batch["cu_seqlens"].dtype == torch.int32
        assert batch["cu_seqlens"].tolist() == cu
        expected = torch.from_numpy(stream[k * n + 1: k * n + n + 1].copy())
        expected[masked] = IGNORE_INDEX
        assert torch.equal(batch["labels"].view(-1), expected)
        assert batch["input_ids"].view(-1).tolist() == stream[k * n: k * n + n].tolist()
        if max_doc_len:
            assert (batch["cu_seqlens"].diff() <= max_doc_len).all()


def test_restored_packer_continues_identically():
    docs = documents(2, 500)
    straight = take_batches(Packer(seq_len=20, batch_size=2, varlen=True, max_doc_len=0, dtype=np.uint16), docs, 12)
    first = Packer(seq_len=20, batch_size=2, varlen=True, max_doc_len=0, dtype=np.uint16)
    it = iter(docs)
    for _ in range(5):
        first.next_batch(lambda: next(it))
    second = Packer(seq_len=20, batch_size=2, varlen=True, max_doc_len=0, dtype=np.uint16)
    second.load_state_dict(first.state_dict())
    rest = [second.next_batch(lambda: next(it)) for _ in range(7)]
    for a, b in zip(straight[5:], rest):
        assert all(torch.equal(a[key], b[key]) for key in a)
