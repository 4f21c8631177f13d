"""What the trainer holds: the training loader of one rank (workers, resume, counters) and the eval loader."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import warnings

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from flame.data.config import DataConfig
from flame.data.counters import merge_counters
from flame.data.pipeline import PipelineSettings, ReaderPipeline, TextDataset
from flame.data.sources import SourcePlan, plan_sources
from flame.data.tokenizer import TextTokenizer, WorldTokenizer, load_tokenizer
from flame.lifeline import alive, die_with_parent
from flame.stop_signals import STOP_SIGNALS


def check_sources(cfg: DataConfig) -> tuple[list[SourcePlan], TextTokenizer | WorldTokenizer]:
    """Resolve sources, eval sources and tokenizer before training starts; raise ConfigError naming the key.
    Returns the training sources' plans and the tokenizer."""
    plans = plan_sources(cfg, "sources")
    plan_sources(cfg, "eval_sources")
    return plans, load_tokenizer(cfg)


def _init_worker(worker_id: int, rank_pid: int) -> None:
    """A stop signal sent to every process (Slurm's preemption notice, Ctrl-C in a terminal) is the training
    process' to handle: it saves a checkpoint that needs these workers' state, then shuts them down. A rank that dies
    takes its workers with it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(os.getppid())  # the rank when forked; a fork server (a child of the rank) ends with the rank
    if not alive(rank_pid):
        os._exit(1)


def _settings(cfg: DataConfig, plans, *, seq_len: int, batch_size: int, seed: int) -> PipelineSettings:
    return PipelineSettings(plans=plans, tokenizer=cfg.tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed,
                            shuffle_buffer=cfg.shuffle_buffer, varlen=cfg.varlen, max_doc_len=cfg.max_doc_len,
                            add_bos=cfg.add_bos, bos_token=cfg.bos_token, eos_token=cfg.eos_token)


class TextLoader:
    """Micro-batches {input_ids, labels[, cu_seqlens]} of one rank, endlessly; state_dict()/load_state_dict() resume
    exactly (same dp size and num_workers); metrics() sums the workers' counters; vocab_size is the tokenizer's."""

    def __init__(self, cfg: DataConfig, *, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, seed: int):
        plans, tokenizer = check_sources(cfg)
        self.vocab_size = tokenizer.vocab_size
        self.layout = {"dp_rank": dp_rank, "dp_world": dp_world, "num_workers": cfg.num_workers,
                       "seq_len": seq_len, "batch_size": batch_size, "sources": [p.config.path for p in plans]}
        settings = _settings(cfg, plans, seq_len=seq_len, batch_size=batch_size, seed=seed)
        dataset = TextDataset(settings, dp_rank=dp_rank, dp_world=dp_world, num_workers=cfg.num_workers)
        # batch_size=None: each worker yields whole micro-batches; workers take turns, one batch each.
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API on construction
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(dataset, batch_size=None, num_workers=cfg.num_workers,
                                             pin_memory=torch.cuda.is_available(), snapshot_every_n_steps=1,
                                             worker_init_fn=functools.partial(_init_worker, rank_pid=os.getpid()))
        self._iterator = None
        self._restored = None  # the dataloader state last loaded (None: start from the beginning)
        self._counters: dict[int, dict] = {}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        batch, worker, counters = next(self._iterator)
        self._counters[int(worker)] = counters
        return batch

    def close(self) -> None:
        """Stop the worker processes now. They ignore SIGTERM, so they must not be left to interpreter exit."""
        if self._iterator is not None and hasattr(self._iterator, "_shutdown_workers"):
            self._iterator._shutdown_workers()
        self._iterator = None

    def metrics(self) -> dict[str, int]:
        """data_docs, data_tokens (read and tokenized), data_skipped_<reason>, data_source<i>_epoch (passes done)."""
        return {f"data_{k}": v for k, v in merge_counters(list(self._counters.values())).items()}

    def state_dict(self) -> dict:
        """{"state": bytes}: one pickled blob, so the checkpoint's structure does not depend on what the buffers
        hold (DCP loads into the structure of a fresh loader's state_dict, used as the template)."""
        if self._iterator is None:  # nothing drawn since construction or load_state_dict: no workers to ask
            loader_state = self._restored
        else:
            loader_state = self.loader.state_dict()
        state = {"layout": dict(self.layout), "loader": loader_state,
                 "counters": {str(w): dict(c) for w, c in self._counters.items()}}
        return {"state": pickle.dumps(state)}

    def load_state_dict(self, state: dict) -> None:
        state = pickle.loads(state["state"])
        for key, value in self.layout.items():
            if state["layout"].get(key) != value:
                raise ValueError(f"the checkpoint's data state was saved with {key} = {state['layout'].get(key)!r}, "
                                 f"this run has {value!r}: data resumes exactly only with the same layout")
        self._restored = state["loader"]
        self.loader.load_state_dict(self._restored or {})
        self._counters = {int(w): dict(c) for w, c in state["counters"].items()}
        self._iterator = None


class EvalLoader:
    """Deterministic batches over data.eval_sources for one rank: each iter() starts again from the first document
    (no shuffle). Endless (passes repeat): take validation.steps batches, the same number on every rank."""

    def __init__(self, cfg: DataConfig, *, seq_len: int, batch_size: int, dp_rank: int, dp_world: int):
        self.tokenizer = load_tokenizer(cfg)
        self.vocab_size = self.tokenizer.vocab_size
        self.settings = _settings(cfg, plan_sources(cfg, "eval_sources"), seq_len=seq_len, batch_size=batch_size,
                                  seed=0)
        self.settings.shuffle_buffer = 0
        self.dp_rank, self.dp_world = dp_rank, dp_world

    def __iter__(self):
        pipeline = ReaderPipeline(self.settings, reader=self.dp_rank, n_readers=self.dp_world,
                                  tokenizer=self.tokenizer)
        while True:
            yield pipeline.next_batch()
