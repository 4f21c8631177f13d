"""Sharding and raw positions: every document exactly once per epoch over ranks x workers; exact resume."""

from __future__ import annotations

import collections

import pytest

from flame.data.config import SourceConfig
from flame.data.counters import Counters
from flame.data.sources import DocumentStream, plan_source

from tests.data.corpora import make_corpus, write_docs


def streams(path: str, n_readers: int, fmt: str = "auto", seed: int = 0):
    plan = plan_source(SourceConfig(path=path, format=fmt), "data.sources[0]", 0)
    return [DocumentStream(plan, reader=r, n_readers=n_readers, seed=seed, counters=Counters())
            for r in range(n_readers)]


def one_epoch(stream: DocumentStream) -> list[str]:
    docs = []
    while stream.epoch == 0:
        docs.append(stream.next())
    return docs[:-1]  # the last one already belongs to epoch 1


@pytest.mark.parametrize("fmt,n_files", [("jsonl.zst", 6), ("jsonl.zst", 2), ("json.gz", 3), ("jsonl", 1),
                                         ("parquet", 5), ("parquet", 3)])
def test_every_document_once_per_epoch_over_ranks_and_workers(tmp_path, fmt, n_files):
    # 2 ranks x 2 workers = 4 readers; fewer files than readers shares files by record, more shares by file.
    reference = make_corpus(tmp_path, "c", n_files=n_files, docs_per_file=23, fmt=fmt)
    seen = []
    for stream in streams(str(tmp_path / "c-*"), n_readers=4):
        docs = one_epoch(stream)
        assert docs, "every reader gets documents"
        seen += docs
    assert collections.Counter(seen) == collections.Counter(reference)


def test_txt_files_are_one_document_each(tmp_path):
    texts = [f"Text file number {i}.\nSecond line.\n" for i in range(5)]
    for i, t in enumerate(texts):
        (tmp_path / f"book{i}.txt").write_text(t)
    seen = []
    for stream in streams(str(tmp_path), n_readers=2):
        seen += one_epoch(stream)
    assert sorted(seen) == sorted(texts)


def test_epochs_repeat_the_share_in_a_new_file_order(tmp_path):
    reference = make_corpus(tmp_path, "c", n_files=8, docs_per_file=3)
    (stream,) = streams(str(tmp_path / "*.zst"), n_readers=1)
    epochs = [[], [], []]
    while stream.epoch < 2:
        epochs[stream.epoch].append(stream.next())
    first = epochs[0]
    second = [first.pop()] + epochs[1][:-1]  # a doc belongs to the epoch during which it was read
    assert sorted(first) == sorted(second) == sorted(reference)
    assert first != second
    assert stream.counters.values["source0_epoch"] == 2


@pytest.mark.parametrize("fmt,n_files,n_readers", [("jsonl.zst", 3, 1), ("jsonl", 2, 3), ("parquet", 2, 1),
                                                    ("json.gz", 2, 2)])
def test_restored_stream_continues_with_the_next_document(tmp_path, fmt, n_files, n_readers):
    make_corpus(tmp_path, "c", n_files=n_files, docs_per_file=40, fmt=fmt)
    path = str(tmp_path / "c-*")
    for reader in range(n_readers):
        straight = streams(path, n_readers)[reader]
        expected = [straight.next() for _ in range(100)]  # crosses files and an epoch boundary
        for cut in (1, 17, 55):
            before = streams(path, n_readers)[reader]
            [before.next() for _ in range(cut)]
            state = before.state_dict()
            after = streams(path, n_readers)[reader]
            after.load_state_dict(state)
            assert [after.next() for _ in range(100 - cut)] == expected[cut:]


def test_multi_frame_zstd_reads_every_frame(tmp_path):
    import zstandard

    a = write_docs(tmp_path / "a.jsonl", ["first frame"], "jsonl").read_bytes()
    b = write_docs(tmp_path / "b.jsonl", ["second frame", "more"], "jsonl").read_bytes()
    cctx = zstandard.ZstdCompressor()
    (tmp_path / "multi.jsonl.zst").write_bytes(cctx.compress(a) + cctx.compress(b))
    (stream,) = streams(str(tmp_path / "multi.jsonl.zst"), n_readers=1)
    assert one_epoch(stream) == ["first frame", "second frame", "more"]


def test_hub_format_streams_through_datasets_and_resumes(tmp_path):
    # A local folder read with format "hf" takes the same path as a hub id (datasets.load_dataset, streaming).
    reference = make_corpus(tmp_path / "ds", "h", n_files=2, docs_per_file=15, fmt="jsonl")
    seen = []
    for stream in streams(str(tmp_path / "ds"), n_readers=3, fmt="hf"):
        seen += one_epoch(stream)
    assert sorted(seen) == sorted(reference)

    straight = streams(str(tmp_path / "ds"), n_readers=2, fmt="hf")[1]
    expected = [straight.next() for _ in range(25)]
    before = streams(str(tmp_path / "ds"), n_readers=2, fmt="hf")[1]
    [before.next() for _ in range(9)]
    after = streams(str(tmp_path / "ds"), n_readers=2, fmt="hf")[1]
    after.load_state_dict(before.state_dict())
    assert [after.next() for _ in range(16)] == expected[9:]
