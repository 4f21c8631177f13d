"""Bad input: a counted skip naming file and line (never a crash, never a silent loss), or an error before
training starts naming the config key."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import zstandard

from flame.config import ConfigError, load_config
from flame.data import build_train_loader, check_sources
from flame.data.config import SourceConfig
from flame.data.counters import Counters
from flame.data.sources import DocumentStream, plan_source

from tests.data.corpora import TOKENIZER, data_config, write_docs

GOOD = [f"good document number {i}" for i in range(6)]
BAD_LINES = [  # (raw jsonl line, reason it is skipped)
    (b'{"text": "unterminated', "bad_json"),
    (b'{"meta": {"pile_set_name": "x"}}', "missing_text"),
    (b'{"text": null}', "missing_text"),
    (b'{"text": ""}', "empty_text"),
    (b'{"text": "  \\n "}', "empty_text"),
    (b'{"text": 42}', "non_string_text"),
    (b'{"text": ["a"]}', "non_string_text"),
    (b'{"text": "caf\xe9 latin-1"}', "bad_utf8"),
    (b'{"text": "lone \\ud800 surrogate"}', "bad_utf8"),
    (b"[1, 2]", "missing_text"),
    (b"", "blank_line"),
]


def read_all(path: str, fmt: str = "auto"):
    plan = plan_source(SourceConfig(path=path, format=fmt), "data.sources[0]", 0)
    counters = Counters()
    stream = DocumentStream(plan, reader=0, n_readers=1, seed=0, counters=counters)
    docs = []
    while stream.epoch == 0:
        docs.append(stream.next())
    return docs[:-1], counters.values


def mixed_lines() -> bytes:
    lines = []
    for i, (raw, _) in enumerate(BAD_LINES):
        lines += [json.dumps({"text": GOOD[i % len(GOOD)] + f" ({i})"}).encode(), raw]
    return b"\n".join(lines) + b"\n"


@pytest.mark.parametrize("compress", ["jsonl", "jsonl.zst", "json.gz"])
def test_each_bad_line_is_counted_and_every_good_one_kept(tmp_path, compress, caplog):
    data = mixed_lines()
    path = tmp_path / {"jsonl": "x.jsonl", "jsonl.zst": "x.jsonl.zst", "json.gz": "x.jsonl.gz"}[compress]
    path.write_bytes({"jsonl": data, "jsonl.zst": zstandard.ZstdCompressor().compress(data),
                      "json.gz": gzip.compress(data)}[compress])
    with caplog.at_level(logging.WARNING, logger="flame.data"):
        docs, counts = read_all(str(path))
    expected_good = [json.loads(line)["text"] for line in data.split(b"\n")[0::2] if line]
    assert docs == expected_good
    expected = {}
    for _, reason in BAD_LINES:
        expected[f"skipped_{reason}"] = expected.get(f"skipped_{reason}", 0) + 1
    assert {k: v for k, v in counts.items() if k.startswith("skipped_")} == expected
    assert f"{path}:2" in caplog.text and "bad_json" in caplog.text  # names file and line


@pytest.mark.parametrize("fmt", ["jsonl.zst", "json.gz"])
def test_truncated_compressed_file_keeps_what_precedes_the_cut_and_goes_on(tmp_path, fmt):
    import random

    rng = random.Random(0)  # incompressible text, so the file spans many compressed blocks
    texts = [f"document {i} " + "".join(rng.choices("abcdefghij klmnop", k=300)) for i in range(1500)]
    full = write_docs(tmp_path / f"a.{fmt}", texts, fmt)
    data = full.read_bytes()
    full.write_bytes(data[: len(data) // 2])
    docs, counts = read_all(str(full))  # one pass, then the stream goes on with the next epoch
    assert counts["skipped_truncated_file"] == 1
    assert 0 < len(docs) < len(texts) and docs == texts[: len(docs)]  # a prefix, in order, nothing invented


def test_parquet_nulls_and_empty_rows_are_counted(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a real document", None, "", "another one"]}), tmp_path / "w.parquet")
    docs, counts = read_all(str(tmp_path / "w.parquet"))
    assert docs == ["a real document", "another one"]
    assert counts["skipped_missing_text"] == 1 and counts["skipped_empty_text"] == 1


def test_loader_metrics_count_skips_docs_and_tokens(tmp_path, tokenizer):
    (tmp_path / "x.jsonl").write_bytes(mixed_lines())
    cfg = data_config((str(tmp_path / "x.jsonl"), 1.0), num_workers=0, shuffle_buffer=0)
    loader = build_train_loader(cfg, seq_len=8, batch_size=2, grad_accum=1, dp_rank=0, dp_world=1, seed=0,
                                vocab_size=50304)
    good = [json.loads(line)["text"] for line in mixed_lines().split(b"\n")[0::2] if line]
    n_tokens = sum(len(ids) + 1 for ids in tokenizer.encode_batch(good))  # + EOS
    for _ in range(3 * n_tokens // 16):  # about three passes over the file
        next(loader)
    m = loader.metrics()
    passes = m["data_docs"] // len(good)
    assert passes >= 2 and m["data_docs"] % 32 == 0  # tokenized 32 documents at a time
    docs_read = (good * (passes + 1))[: m["data_docs"]]
    assert m["data_tokens"] == sum(len(ids) + 1 for ids in tokenizer.encode_batch(docs_read))
    # the bad JSON line follows the first good line: a pass counts it once it reads a second good document
    full_passes, rest = divmod(m["data_docs"], len(good))
    assert m["data_skipped_bad_json"] == full_passes + (rest >= 2)
    assert m["data_source0_epoch"] == full_passes - (rest == 0)


# ----------------------------------------------------------------------------------- errors before training starts
def config_error(cfg) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        check_sources(cfg)
    return e.value


def test_glob_matching_nothing(tmp_path):
    e = config_error(data_config((str(tmp_path / "missing-*.jsonl.zst"), 1.0)))
    assert e.key == "data.sources[0].path" and "missing-*" in str(e)


def test_eval_glob_matching_nothing(tmp_path):
    write_docs(tmp_path / "a.jsonl", GOOD, "jsonl")
    cfg = data_config((str(tmp_path / "a.jsonl"), 1.0))
    cfg.eval_sources = [SourceConfig(path=str(tmp_path / "nothing/*.jsonl"))]
    assert config_error(cfg).key == "data.eval_sources[0].path"


def test_unknown_format(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    e = config_error(data_config((str(tmp_path / "*.csv"), 1.0)))
    assert e.key == "data.sources[0].format" and "data.csv" in str(e)


def test_unreadable_file(tmp_path, monkeypatch):
    write_docs(tmp_path / "a.jsonl", GOOD, "jsonl")
    import flame.data.sources as sources

    def denied(path, *args, **kwargs):  # as root, chmod cannot make a file unreadable
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(sources, "open", denied, raising=False)
    e = config_error(data_config((str(tmp_path / "a.jsonl"), 1.0)))
    assert e.key == "data.sources[0].path" and "Permission denied" in str(e)


def test_parquet_without_the_text_column_and_corrupt_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "a.parquet")
    e = config_error(data_config((str(tmp_path / "a.parquet"), 1.0)))
    assert e.key == "data.sources[0].text_field" and "content" in str(e)
    (tmp_path / "a.parquet").write_bytes(b"not a parquet file")
    assert config_error(data_config((str(tmp_path / "a.parquet"), 1.0))).key == "data.sources[0].path"


def test_bad_tokenizer_and_bad_eos(tmp_path):
    write_docs(tmp_path / "a.jsonl", GOOD, "jsonl")
    cfg = data_config((str(tmp_path / "a.jsonl"), 1.0))
    cfg.tokenizer = str(tmp_path / "no/tokenizer.json")
    assert config_error(cfg).key == "data.tokenizer"
    cfg.tokenizer, cfg.eos_token = TOKENIZER, "</s>"
    assert config_error(cfg).key == "data.eos_token"


def test_weight_and_worker_checks_in_the_toml(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\n[[data.sources]]\npath = "x"\nweight = 0\n')
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight"):
        load_config(toml)
    toml.write_text('[data]\nnum_workers = -1\n[[data.sources]]\npath = "x"\nformat = "csv"\n')
    with pytest.raises(ConfigError, match=r"data.sources\[0\].format"):
        load_config(toml)


def test_reader_with_no_documents_says_so(tmp_path):
    (tmp_path / "only.txt").write_text("a single document")
    cfg = data_config((str(tmp_path / "only.txt"), 1.0), num_workers=0, shuffle_buffer=0)
    loader = build_train_loader(cfg, seq_len=8, batch_size=1, grad_accum=1, dp_rank=1, dp_world=2, seed=0,
                                vocab_size=50304)
    with pytest.raises(RuntimeError, match=r"data.sources\[0\].*reader 1 of 2 found no usable document"):
        next(loader)
