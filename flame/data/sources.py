"""Raw documents: which files a source names, which of their documents belong to one reader, and where it stands.

A *reader* is one dataloader worker of one data-parallel rank: reader = dp_rank * workers + worker, out of
R = dp_world * workers. With at least R files, reader r reads files r, r + R, r + 2R, ... whole; with fewer, each
file is shared by the readers r with r % F == its index, which take every k-th record of it. Either way every
record of every file belongs to exactly one reader. A reader passes over its share endlessly, epoch after epoch
(file order reshuffled per epoch), and its position (epoch, file, record, byte offset) is its whole state, so a
restored reader continues with the very next document.

Local files are read here rather than through `datasets`: a bad line, a truncated `.zst` or invalid UTF-8 must be a
counted skip naming file and line, not an exception from deep inside a builder. Hub datasets (format "hf") stream
through `datasets.load_dataset(..., streaming=True)` + `split_dataset_by_node`, whose own state_dict resumes exactly.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from dataclasses import dataclass, field

import zstandard

from flame.data.config import DataConfig, SourceConfig
from flame.data.counters import Counters
from flame.data.paths import expand_glob
from flame.errors import ConfigError

CHUNK_BYTES = 1 << 20
SUFFIX_FORMATS = [(".jsonl.zst", "jsonl.zst"), (".json.zst", "jsonl.zst"), (".zst", "jsonl.zst"),
                  (".jsonl.gz", "json.gz"), (".json.gz", "json.gz"), (".jsonl", "jsonl"), (".json", "jsonl"),
                  (".parquet", "parquet"), (".txt", "txt")]
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class TruncatedFile(Exception):
    pass


class NoDocumentError(RuntimeError):
    """A reader found no usable document in a whole pass over its share of a source (every line bad, a truncated
    file): foreseeable, so the trainer reports its one line and exits 2."""

    @staticmethod
    def message_of(e: Exception) -> str:
        """The error's own line, also when a dataloader worker raised it (the training process then gets the worker's
        whole traceback as the message, whose last line is ours)."""
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return last.split("NoDocumentError: ", 1)[-1]


def detect_format(path: str) -> str | None:
    name = path.lower()
    return next((fmt for suffix, fmt in SUFFIX_FORMATS if name.endswith(suffix)), None)


@dataclass
class SourcePlan:
    """A source resolved before training starts: its files and their formats (or a hub id). Picklable."""

    index: int
    key: str
    config: SourceConfig
    files: list[str] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)

    @property
    def is_hub(self) -> bool:
        return not self.files


def plan_source(source: SourceConfig, key: str, index: int) -> SourcePlan:
    """Resolve the files of a source; raise ConfigError naming `key` for anything a run would trip over later."""
    if source.format == "hf":
        return SourcePlan(index, key, source)
    files = expand_glob(source.path)
    if not files:
        if source.format == "auto" and HUB_ID.match(source.path) and not os.path.exists(source.path):
            raise ConfigError(f"{key}.path", 'a local glob matching files (for a hub dataset set format = "hf")',
                              source.path)
        raise ConfigError(f"{key}.path", "a glob or folder matching at least one file", source.path)
    formats = []
    for path in files:
        fmt = source.format if source.format != "auto" else detect_format(path)
        if fmt is None:
            raise ConfigError(f"{key}.format", "a format this file's name does not tell: one of jsonl, jsonl.zst, "
                              f"json.gz, parquet, txt (file {path})", source.format)
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"{key}.path", "readable files", f"{path}: {e.strerror}") from None
        if fmt == "parquet":
            _check_parquet_column(path, source.text_field, key)
        formats.append(fmt)
    return SourcePlan(index, key, source, files, formats)


def _check_parquet_column(path: str, column: str, key: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{key}.path", "readable parquet files", f"{path}: {e}") from None
    if column not in schema.names:
        raise ConfigError(f"{key}.text_field", f"a column of {path} (it has {', '.join(schema.names)})", column)
    if not (pa.types.is_string(schema.field(column).type) or pa.types.is_large_string(schema.field(column).type)):
        raise ConfigError(f"{key}.text_field", f"a string column of {path}", f"{column}: {schema.field(column).type}")


def plan_sources(cfg: DataConfig, which: str = "sources") -> list[SourcePlan]:
    return [plan_source(s, f"data.{which}[{i}]", i) for i, s in enumerate(getattr(cfg, which))]


# -------------------------------------------------------------------------------------------------- reading bytes
def _decompressed_chunks(path: str, fmt: str, skip: int):
    """The file's (decompressed) bytes in chunks, starting `skip` bytes in. Raises TruncatedFile if a compressed
    stream stops mid-frame."""
    with open(path, "rb") as raw:
        if fmt in ("jsonl", "txt"):
            raw.seek(skip)
            skip = 0
            chunks = iter(lambda: raw.read(CHUNK_BYTES), b"")
        elif fmt == "json.gz":
            chunks = _gzip_chunks(raw)
        else:
            chunks = _zstd_chunks(raw)
        for chunk in chunks:
            if skip:  # compressed streams cannot seek: drop what was already read
                dropped = min(skip, len(chunk))
                chunk, skip = chunk[dropped:], skip - dropped
            if chunk:
                yield chunk


def _gzip_chunks(raw):
    with gzip.GzipFile(fileobj=raw) as f:
        try:
            yield from iter(lambda: f.read1(CHUNK_BYTES), b"")  # read1: data before a cut still comes out
        except (EOFError, gzip.BadGzipFile) as e:
            raise TruncatedFile(str(e)) from None


def _zstd_chunks(raw):
    """All frames of a zstd file (parallel compressors write several); a stream cut inside a frame is reported."""
    dctx = zstandard.ZstdDecompressor()
    obj, mid_frame = dctx.decompressobj(), False
    for data in iter(lambda: raw.read(CHUNK_BYTES), b""):
        while data:
            try:
                out = obj.decompress(data)
            except zstandard.ZstdError as e:
                raise TruncatedFile(f"corrupt zstd data: {e}") from None
            mid_frame = True
            if out:
                yield out
            if obj.eof:
                data, obj, mid_frame = obj.unused_data, dctx.decompressobj(), False
            else:
                data = b""
    if mid_frame:
        raise TruncatedFile("the zstd stream ends inside a frame")


def _whole(chunks):
    data = b"".join(chunks)
    yield data, len(data)


def _lines(chunks):
    """(line without its newline, bytes it took in the file) for every line."""
    rest = b""
    for chunk in chunks:
        if rest:
            chunk = rest + chunk
        lines = chunk.split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line, len(line) + 1
    if rest:
        yield rest, len(rest)


# ---------------------------------------------------------------------------------------------- one reader's share
class DocumentStream:
    """The documents of one source that belong to one reader, endlessly. `next()` returns the next text."""

    def __init__(self, plan: SourcePlan, *, reader: int, n_readers: int, seed: int, counters: Counters):
        self.plan, self.reader, self.n_readers, self.seed, self.counters = plan, reader, n_readers, seed, counters
        self.text_field = plan.config.text_field
        n_files = len(plan.files)
        if plan.is_hub:
            self.my_files, self.stride, self.offset = [], 1, 0
        elif n_files >= n_readers:
            self.my_files, self.stride, self.offset = list(range(reader, n_files, n_readers)), 1, 0
        else:
            mine = reader % n_files
            self.my_files = [mine]
            self.stride, self.offset = len(range(mine, n_readers, n_files)), reader // n_files
        self.epoch_key = f"source{plan.index}_epoch"
        counters.values.setdefault(self.epoch_key, 0)
        self.epoch = self.file_pos = self.record = self.byte_offset = self.docs_this_epoch = 0
        self.hub_state = None
        self._hub_dataset = None
        self._documents = None

    def state_dict(self) -> dict:
        hub = self._hub_dataset.state_dict() if self._hub_dataset is not None and self._documents else self.hub_state
        return {"epoch": self.epoch, "file_pos": self.file_pos, "record": self.record,
                "byte_offset": self.byte_offset, "docs_this_epoch": self.docs_this_epoch, "hub_state": hub}

    def load_state_dict(self, state: dict) -> None:
        for name in ("epoch", "file_pos", "record", "byte_offset", "docs_this_epoch"):
            setattr(self, name, int(state[name]))
        self.hub_state = state["hub_state"]
        self._documents = None  # the next call re-opens at the saved position

    def next(self) -> str:
        if self._documents is None:
            self._documents = self._hub_documents() if self.plan.is_hub else self._file_documents()
        return next(self._documents)

    # Positions advance before each yield, so a state taken between two next() calls points at the next document.
    def _file_documents(self):
        while True:
            order = list(self.my_files)
            random.Random(f"{self.seed}/{self.plan.index}/{self.reader}/{self.epoch}").shuffle(order)
            while self.file_pos < len(order):
                index = order[self.file_pos]
                path, fmt = self.plan.files[index], self.plan.formats[index]
                if fmt == "parquet":
                    yield from self._parquet_documents(path)
                else:
                    yield from self._line_documents(path, fmt)
                self.file_pos, self.record, self.byte_offset = self.file_pos + 1, 0, 0
            self._end_epoch()

    def _end_epoch(self) -> None:
        if self.docs_this_epoch == 0:
            raise NoDocumentError(
                f"{self.plan.key} ({self.plan.config.path}): reader {self.reader} of {self.n_readers} found no usable "
                f"document in a whole pass over its share ({len(self.my_files)} of {len(self.plan.files)} files, "
                f"every {self.stride}-th record); give the source more files/documents or use fewer workers")
        self.epoch, self.file_pos, self.record, self.byte_offset, self.docs_this_epoch = self.epoch + 1, 0, 0, 0, 0
        self.counters.values[self.epoch_key] = self.epoch

    def _line_documents(self, path: str, fmt: str):
        whole_file = fmt == "txt"  # one document per file
        if whole_file and self.record > 0:
            return
        try:
            chunks = _decompressed_chunks(path, fmt, self.byte_offset)
            records = _whole(chunks) if whole_file else _lines(chunks)
            for line, nbytes in records:
                record = self.record
                self.record, self.byte_offset = record + 1, self.byte_offset + nbytes
                if record % self.stride != self.offset:
                    continue
                text = self._text_of_line(line, f"{path}:{record + 1}", whole_file)
                if text is not None:
                    self.docs_this_epoch += 1
                    yield text
        except TruncatedFile as e:
            self.counters.skip("truncated_file", f"{path}:{self.record + 1}", f"{e}; rest of the file skipped")
        except OSError as e:
            self.counters.skip("unreadable_file", f"{path}:{self.record + 1}", f"{e}; rest of the file skipped")

    def _text_of_line(self, line: bytes, where: str, whole_file: bool) -> str | None:
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError as e:
            self.counters.skip("bad_utf8", where, str(e))
            return None
        if whole_file:
            return self._checked_text(decoded, where)
        if not decoded.strip():
            self.counters.skip("blank_line", where, "empty line")
            return None
        try:
            row = json.loads(decoded)
        except json.JSONDecodeError as e:
            self.counters.skip("bad_json", where, str(e))
            return None
        if not isinstance(row, dict) or self.text_field not in row:
            self.counters.skip("missing_text", where, f"no {self.text_field!r} field")
            return None
        return self._checked_text(row[self.text_field], where)

    def _checked_text(self, text, where: str) -> str | None:
        if text is None:
            self.counters.skip("missing_text", where, f"{self.text_field!r} is null")
        elif not isinstance(text, str):
            self.counters.skip("non_string_text", where, f"{self.text_field!r} is a {type(text).__name__}")
        elif not text.strip():
            self.counters.skip("empty_text", where, f"{self.text_field!r} is empty or blank")
        elif not text.isascii() and not _encodable(text):
            self.counters.skip("bad_utf8", where, "text holds a lone surrogate (\\ud800-\\udfff escape)")
        else:
            return text
        return None

    def _parquet_documents(self, path: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            first_row = 0
            for group in range(pf.num_row_groups):
                n_rows = pf.metadata.row_group(group).num_rows
                if first_row + n_rows <= self.record:  # already read before a resume
                    first_row += n_rows
                    continue
                column = pf.read_row_group(group, columns=[self.text_field]).column(0).to_pylist()
                for i in range(self.record - first_row, n_rows):
                    record = first_row + i
                    self.record = record + 1
                    if record % self.stride != self.offset:
                        continue
                    text = self._checked_text(column[i], f"{path}:row {record}")
                    if text is not None:
                        self.docs_this_epoch += 1
                        yield text
                first_row += n_rows
        except (OSError, pa.ArrowException) as e:
            self.counters.skip("unreadable_file", f"{path}:row {self.record}", f"{e}; rest of the file skipped")

    def _hub_documents(self):
        import datasets
        from datasets.distributed import split_dataset_by_node

        cfg = self.plan.config
        if self._hub_dataset is None:
            ds = datasets.load_dataset(cfg.path, name=cfg.subset or None, split=cfg.split, streaming=True)
            self._hub_dataset = split_dataset_by_node(ds, rank=self.reader, world_size=self.n_readers)
            self._hub_start = self._hub_dataset.state_dict()
        while True:
            self._hub_dataset.load_state_dict(self.hub_state or self._hub_start)
            for i, row in enumerate(self._hub_dataset):
                text = self._checked_text(row.get(self.text_field), f"{cfg.path}:{self.epoch}/{i}")
                if text is not None:
                    self.docs_this_epoch += 1
                    yield text
            self.hub_state = None
            self._end_epoch()


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
