"""Data: raw documents per rank/worker -> tokens -> packed batches. `build_train_loader` is the trainer's entry."""

from __future__ import annotations

from flame.data.config import DataConfig, SourceConfig
from flame.data.synthetic import IGNORE_INDEX, SyntheticLoader

__all__ = ["DataConfig", "SourceConfig", "IGNORE_INDEX", "build_train_loader"]


def build_train_loader(cfg: DataConfig, *, seq_len: int, batch_size: int, grad_accum: int, dp_rank: int,
                       dp_world: int, seed: int, vocab_size: int):
    """An iterator of micro-batches {input_ids [B, T], labels [B, T] (IGNORE_INDEX = no loss), optional cu_seqlens},
    with state_dict()/load_state_dict() for exact resume and metrics() for counters."""
    if cfg.synthetic:
        return SyntheticLoader(seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, dp_rank=dp_rank,
                               dp_world=dp_world, seed=seed, vocab_size=vocab_size)
    raise NotImplementedError("text sources arrive with the data pipeline (issue 3); use data.synthetic = true")
