"""Data: raw documents per rank/worker -> tokens -> packed batches. `build_train_loader` is the trainer's entry.

Layout: config.py ([data] section), sources.py (files, formats, sharding, raw positions), tokenizer.py,
packing.py (documents -> windows, cu_seqlens), pipeline.py (one reader: tokenize, mix, shuffle, pack, state),
loader.py (workers, resume, counters, eval), synthetic.py (no files).
"""

from __future__ import annotations

from flame.data.config import DataConfig, SourceConfig

# The readers and loaders import torch, torchdata and the file formats' libraries: loaded when first asked for, so
# that reading a config (flame.config, which launch.sh's checks run before any rank starts) stays a light import.
_LAZY = {"check_sources": "loader", "EvalLoader": "loader", "TextLoader": "loader", "NoDocumentError": "sources",
         "IGNORE_INDEX": "synthetic", "SyntheticLoader": "synthetic"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'flame.data' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"flame.data.{_LAZY[name]}"), name)


__all__ = ["DataConfig", "SourceConfig", "IGNORE_INDEX", "build_train_loader", "build_eval_loader", "check_sources",
           "NoDocumentError"]


def build_train_loader(cfg: DataConfig, *, seq_len: int, batch_size: int, grad_accum: int, dp_rank: int,
                       dp_world: int, seed: int, vocab_size: int):
    """An iterator of micro-batches {input_ids [B, T], labels [B, T] (IGNORE_INDEX = no loss), optional cu_seqlens},
    with state_dict()/load_state_dict() for exact resume, metrics() for counters and close() to stop its workers.

    Text sources raise ConfigError (naming data.sources[i].path, data.tokenizer, ...) here, before training starts.
    The text loader's `vocab_size` is the tokenizer's; the trainer checks that it fits model.vocab_size."""
    from flame.data.loader import TextLoader
    from flame.data.synthetic import SyntheticLoader

    if cfg.synthetic:
        return SyntheticLoader(seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, dp_rank=dp_rank,
                               dp_world=dp_world, seed=seed, vocab_size=vocab_size)
    return TextLoader(cfg, seq_len=seq_len, batch_size=batch_size, dp_rank=dp_rank, dp_world=dp_world, seed=seed)


def build_eval_loader(cfg: DataConfig, *, seq_len: int, batch_size: int, dp_rank: int, dp_world: int):
    """A fresh, deterministic iterable of eval batches over data.eval_sources, or None when there are none."""
    if not cfg.eval_sources:
        return None
    from flame.data.loader import EvalLoader

    return EvalLoader(cfg, seq_len=seq_len, batch_size=batch_size, dp_rank=dp_rank, dp_world=dp_world)
