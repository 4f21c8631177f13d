"""Small corpora written in every supported format, and plain-Python references to compare the pipeline with."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from flame.data.config import DataConfig, SourceConfig

TOKENIZER = str(Path(__file__).resolve().parents[2] / "data" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json")


def write_docs(path: Path, texts: list[str], fmt: str) -> Path:
    """Write `texts` as one file of format `fmt` (jsonl lines are {"text": ..., "meta": {...}})."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(pa.table({"text": texts}), path, row_group_size=7)
        return path
    data = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "test"}}) + "\n" for t in texts).encode()
    if fmt == "jsonl.zst":
        data = zstandard.ZstdCompressor().compress(data)
    elif fmt == "json.gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def make_corpus(folder: Path, name: str, n_files: int, docs_per_file: int, fmt: str = "jsonl.zst",
                words: str = "doc") -> list[str]:
    """n_files files of distinct, numbered documents; returns every document text (the reference)."""
    suffix = {"jsonl.zst": ".jsonl.zst", "json.gz": ".jsonl.gz", "jsonl": ".jsonl", "parquet": ".parquet"}[fmt]
    every = []
    for f in range(n_files):
        texts = [f"{name} {words} {f}-{d}: " + " ".join([words] * (3 + (7 * d + f) % 40)) for d in range(docs_per_file)]
        write_docs(folder / f"{name}-{f:02d}{suffix}", texts, fmt)
        every += texts
    return every


def data_config(*sources: tuple[str, float], **kwargs) -> DataConfig:
    cfg = DataConfig(sources=[SourceConfig(path=p, weight=w) for p, w in sources], tokenizer=TOKENIZER, **kwargs)
    cfg.validate()
    return cfg

