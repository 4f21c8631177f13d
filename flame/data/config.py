"""The [data] section: where text comes from and how it becomes batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flame.errors import check


@dataclass
class SourceConfig:
    path: str = ""
    """A glob of local files (or a folder), or a hub dataset id with format = "hf". Relative paths are looked up
    from the working directory, then from the repository root."""
    format: Literal["auto", "jsonl", "jsonl.zst", "json.gz", "parquet", "txt", "hf"] = "auto"
    """auto: from each file's name (.jsonl/.json, .jsonl.zst/.zst, .jsonl.gz/.json.gz, .parquet, .txt); a path that
    matches no file but looks like owner/name is a hub id. txt: one document per file. hf: datasets.load_dataset."""
    text_field: str = "text"
    """The field (jsonl) or column (parquet, hf) holding the document text."""
    weight: float = 1.0
    """Relative share of *tokens* drawn from this source when several are mixed."""
    subset: str = ""
    """format hf only: the dataset's configuration name (load_dataset's `name`)."""
    split: str = "train"
    """format hf only: the split to stream."""

    def validate(self, key: str) -> None:
        check(bool(self.path), f"{key}.path", "a glob or a hub dataset id")
        check(self.weight > 0, f"{key}.weight", "a number > 0", self.weight)
        check(bool(self.text_field), f"{key}.text_field", "a field name")


@dataclass
class DataConfig:
    synthetic: bool = False
    """A deterministic synthetic token stream (no files, no tokenizer): for tests and benchmarks."""
    sources: list[SourceConfig] = field(default_factory=list)
    """[[data.sources]] tables."""
    eval_sources: list[SourceConfig] = field(default_factory=list)
    """[[data.eval_sources]] tables, for validation (read in order, never shuffled)."""
    tokenizer: str = "data/tokenizer/gpt-neox-20b/tokenizer.json"
    """A tokenizer.json path (or a folder holding one) or a hub id; or RWKV's World tokenizer (vocabulary 65536):
    "rwkv-world" (the file the rwkv package ships), a World vocabulary .txt, or a folder holding
    rwkv_vocab*.txt and no tokenizer.json (an export folder of a World model)."""
    num_workers: int = 2
    """Dataloader worker processes per rank, each tokenizing its own share of the documents; 0 reads in the
    training process. A checkpoint resumes only with the same num_workers and data-parallel size."""
    shuffle_buffer: int = 1000
    """Documents held for the document-level shuffle (per worker); 0 keeps the stream order."""
    add_bos: bool = False
    """Put bos_token before every document (eos_token always follows one)."""
    bos_token: str = "<|endoftext|>"
    """The token put before documents (add_bos). World tokenizer: only "<|endoftext|>", its id 0."""
    eos_token: str = "<|endoftext|>"
    """The token that ends every document. World tokenizer: only "<|endoftext|>", flame's name for id 0, RWKV's
    document separator (no text encodes to it; the text "<|endoftext|>" in a document stays text)."""
    varlen: bool = False
    """Batches also carry cu_seqlens (document boundaries over the flattened batch) and no label crosses from one
    document into the next."""
    max_doc_len: int = 0
    """varlen only: documents longer than this many tokens are cut into segments of at most this length;
    0 = cut only at row ends (seq_len)."""

    def validate(self) -> None:
        if not self.synthetic:
            check(bool(self.sources), "data.sources", "at least one [[data.sources]] table (or data.synthetic = true)")
            check(bool(self.tokenizer), "data.tokenizer", "a tokenizer.json path or hub id, or \"rwkv-world\"")
        for name in ("sources", "eval_sources"):
            for i, source in enumerate(getattr(self, name)):
                source.validate(f"data.{name}[{i}]")
        check(self.num_workers >= 0, "data.num_workers", "an integer >= 0", self.num_workers)
        check(self.shuffle_buffer >= 0, "data.shuffle_buffer", "an integer >= 0", self.shuffle_buffer)
        check(self.max_doc_len >= 0, "data.max_doc_len", "an integer >= 0", self.max_doc_len)
        check(bool(self.eos_token), "data.eos_token", "a token of the tokenizer")
