"""A deterministic synthetic token stream, for tests and benchmarks.

Sample `i` of optimizer step `s` is a function of (seed, s, i) alone, so one global batch is the same however it is
split into ranks, micro-batches and accumulation steps. Each sequence repeats a random motif (learnable, so a loss
can fall) and ignores a random number of trailing label positions (so token counts differ per sequence).
"""

from __future__ import annotations

import torch

from flame.loss import IGNORE_INDEX


def synthetic_sample(seed: int, step: int, index: int, seq_len: int, vocab_size: int):
    g = torch.Generator().manual_seed(hash((seed, step, index)) & 0x7FFF_FFFF_FFFF)
    period = int(torch.randint(2, 9, (1,), generator=g))
    motif = torch.randint(0, min(vocab_size, 1024), (period,), generator=g)
    tokens = motif.repeat(seq_len // period + 2)[: seq_len + 1]
    labels = tokens[1:].clone()
    n_ignored = int(torch.randint(0, seq_len // 2 + 1, (1,), generator=g))
    if n_ignored:
        labels[-n_ignored:] = IGNORE_INDEX
    return tokens[:-1], labels


class SyntheticLoader:
    """Yields micro-batches {input_ids, labels} of shape [batch_size, seq_len] for one data-parallel rank."""

    state_is_global = True
    """Its position is the same on every rank and for any split: a checkpoint resumes on another rank count."""

    def __init__(self, *, seq_len: int, batch_size: int, grad_accum: int, dp_rank: int, dp_world: int,
                 seed: int, vocab_size: int):
        self.seq_len, self.batch_size, self.grad_accum = seq_len, batch_size, grad_accum
        self.dp_rank, self.dp_world, self.seed, self.vocab_size = dp_rank, dp_world, seed, vocab_size
        self.micro_batches_done = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step, micro = divmod(self.micro_batches_done, self.grad_accum)
        first = (self.dp_rank * self.grad_accum + micro) * self.batch_size
        pairs = [synthetic_sample(self.seed, step, first + b, self.seq_len, self.vocab_size)
                 for b in range(self.batch_size)]
        self.micro_batches_done += 1
        return {"input_ids": torch.stack([p[0] for p in pairs]), "labels": torch.stack([p[1] for p in pairs])}

    def state_dict(self) -> dict:
        return {"micro_batches_done": self.micro_batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.micro_batches_done = int(state["micro_batches_done"])

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass
