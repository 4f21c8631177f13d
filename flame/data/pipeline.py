"""One reader's whole path: raw documents -> tokens -> weighted mix -> shuffle buffer -> packed micro-batches.

Everything that decides the next batch lives in this object and its state_dict: source positions, tokenized
documents not yet drawn, tokens drawn per source, the shuffle buffer (contents included) and its RNG, the packer's
carry. Token arrays are stored as bytes, and the shuffle buffer as a dict of slots, so the dataloader's incremental
worker snapshots only send the slots that changed.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from flame.data.counters import Counters
from flame.data.packing import Packer
from flame.data.sources import DocumentStream, SourcePlan
from flame.data.tokenizer import TextTokenizer, WorldTokenizer, open_tokenizer

TOKENIZE_BATCH = 32  # documents per call into the tokenizer


@dataclass
class PipelineSettings:
    """What every reader of one loader shares (picklable: it travels to the worker processes)."""

    plans: list[SourcePlan]
    tokenizer: str
    seq_len: int
    batch_size: int
    seed: int
    shuffle_buffer: int
    varlen: bool
    max_doc_len: int
    add_bos: bool
    bos_token: str
    eos_token: str


class ReaderPipeline:
    def __init__(self, settings: PipelineSettings, *, reader: int, n_readers: int,
                 tokenizer: TextTokenizer | WorldTokenizer | None = None):
        s = settings
        self.tokenizer = tokenizer or open_tokenizer(s.tokenizer, eos_token=s.eos_token, bos_token=s.bos_token)
        self.dtype = np.dtype(np.uint16 if self.tokenizer.vocab_size <= 1 << 16 else np.int32)
        self.prefix = [self.tokenizer.bos_id] if s.add_bos else []
        self.suffix = [self.tokenizer.eos_id]
        self.counters = Counters()
        self.streams = [DocumentStream(p, reader=reader, n_readers=n_readers, seed=s.seed, counters=self.counters)
                        for p in s.plans]
        self.weights = [p.config.weight for p in s.plans]
        self.pending: list[list[bytes]] = [[] for _ in s.plans]  # tokenized, not yet drawn (in order)
        self.drawn_tokens = [0] * len(s.plans)
        self.shuffle_size = s.shuffle_buffer
        self.shuffle_slots: dict[str, bytes] = {}
        self.rng = random.Random(f"shuffle/{s.seed}/{reader}")
        self.packer = Packer(seq_len=s.seq_len, batch_size=s.batch_size, varlen=s.varlen,
                             max_doc_len=s.max_doc_len, dtype=self.dtype)

    def next_batch(self):
        return self.packer.next_batch(self._next_document)

    def _next_document(self) -> np.ndarray:
        doc = self._mixed_document()
        if self.shuffle_size:
            # Fill the buffer first; then each new document takes the place of a randomly chosen one, which leaves.
            while len(self.shuffle_slots) < self.shuffle_size:
                self.shuffle_slots[str(len(self.shuffle_slots))] = doc
                doc = self._mixed_document()
            slot = str(self.rng.randrange(self.shuffle_size))
            doc, self.shuffle_slots[slot] = self.shuffle_slots[slot], doc
        return np.frombuffer(doc, self.dtype)

    def _mixed_document(self) -> bytes:
        """The next document of the source furthest behind its token share (ties: the first such source)."""
        i = min(range(len(self.weights)), key=lambda k: self.drawn_tokens[k] / self.weights[k])
        if not self.pending[i]:
            self._tokenize_more(i)
        doc = self.pending[i].pop(0)
        self.drawn_tokens[i] += len(doc) // self.dtype.itemsize
        return doc

    def _tokenize_more(self, i: int) -> None:
        texts = [self.streams[i].next() for _ in range(TOKENIZE_BATCH)]
        docs = [np.array(self.prefix + ids + self.suffix, self.dtype).tobytes()
                for ids in self.tokenizer.encode_batch(texts)]
        self.pending[i] = docs
        self.counters.add("docs", len(docs))
        self.counters.add("tokens", sum(len(d) for d in docs) // self.dtype.itemsize)

    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams],
                "pending": {str(i): list(p) for i, p in enumerate(self.pending)},
                "drawn_tokens": list(self.drawn_tokens),
                "shuffle_slots": dict(self.shuffle_slots),
                "rng": self.rng.getstate(),
                "packer": self.packer.state_dict(),
                "counters": self.counters.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["streams"]) != len(self.streams):
            raise ValueError(f"the data state has {len(state['streams'])} sources, the config {len(self.streams)}")
        for stream, s in zip(self.streams, state["streams"]):
            stream.load_state_dict(s)
        self.pending = [list(state["pending"][str(i)]) for i in range(len(self.streams))]
        self.drawn_tokens = [int(n) for n in state["drawn_tokens"]]
        self.shuffle_slots = dict(state["shuffle_slots"])
        self.rng.setstate(_as_rng_state(state["rng"]))
        self.packer.load_state_dict(state["packer"])
        self.counters.load_state_dict(state["counters"])


def _as_rng_state(state):
    """random.Random state, whose inner tuple may have come back from a checkpoint as a list."""
    version, internal, gauss = state
    return int(version), tuple(int(x) for x in internal), gauss


class TextDataset(IterableDataset):
    """Endless micro-batches of one data-parallel rank; inside each dataloader worker, that worker's reader.

    Yields (batch, worker id, counters) so the training process can report the workers' counters. The dataloader
    (torchdata's StatefulDataLoader) asks each worker for state_dict() and restores it with load_state_dict().
    """

    def __init__(self, settings: PipelineSettings, *, dp_rank: int, dp_world: int, num_workers: int):
        self.settings, self.dp_rank, self.dp_world = settings, dp_rank, dp_world
        self.workers = max(1, num_workers)
        self.pipeline: ReaderPipeline | None = None
        self.restored_state: dict | None = None
        self.worker_id = 0

    def __iter__(self):
        info = get_worker_info()
        self.worker_id = info.id if info is not None else 0
        if info is not None:  # one tokenizer thread per worker: num_workers is the knob, and ranks x workers x
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # thread pools would oversubscribe the cores
        # Built here, not lazily in the generator: the dataloader reads state_dict() right after iter().
        self.pipeline = ReaderPipeline(self.settings, reader=self.dp_rank * self.workers + self.worker_id,
                                       n_readers=self.dp_world * self.workers)
        if self.restored_state is not None:
            self.pipeline.load_state_dict(self.restored_state)
        return self._batches(self.pipeline)

    def _batches(self, pipeline: ReaderPipeline):
        while True:
            batch = pipeline.next_batch()
            yield batch, self.worker_id, pipeline.counters.state_dict()

    def state_dict(self) -> dict:
        return self.pipeline.state_dict() if self.pipeline is not None else dict(self.restored_state or {})

    def load_state_dict(self, state: dict) -> None:
        self.restored_state = state or None
