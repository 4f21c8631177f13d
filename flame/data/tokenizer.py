"""Opening a tokenizer from a spec (data.tokenizer, or an export folder): a `tokenizers` tokenizer.json, or RWKV's
World vocabulary. Both kinds give token ids of document text, the ids of the document-boundary tokens, and text back.

A spec is one of:
  - "rwkv-world": the World vocabulary that the `rwkv` package ships (rwkv_vocab_v20230424.txt);
  - a path to a World-format vocabulary .txt;
  - a folder: its tokenizer.json if it has one, else its World vocabulary (rwkv_vocab*.txt), as export folders hold;
  - a path to a tokenizer.json file, or a hub id (needs the network once, then the cache).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from flame.data.paths import resolve_path
from flame.errors import ConfigError

if TYPE_CHECKING:
    from flame.data.config import DataConfig

WORLD_SPEC = "rwkv-world"
WORLD_VOCAB = "rwkv_vocab_v20230424.txt"
WORLD_SEPARATOR = "<|endoftext|>"  # flame's name for id 0, RWKV's document separator
WORLD_MODEL_VOCAB = 65536  # embedding rows of RWKV World models; the file fills ids 1..65529


class BoundaryTokenError(KeyError):
    """eos_token or bos_token cannot be used with this tokenizer; `setting` names which."""

    def __init__(self, setting: str, expected: str, got: str):
        super().__init__(f"{setting}: expected {expected}, got {got!r}")
        self.setting, self.expected, self.got = setting, expected, got


def open_tokenizer(spec: str, *, eos_token: str | None = WORLD_SEPARATOR,
                   bos_token: str | None = WORLD_SEPARATOR) -> TextTokenizer | WorldTokenizer:
    """The tokenizer a spec names (see the module docstring). eos_token/bos_token: the boundary tokens' names, or
    None where they are not needed (their id is then None for a tokenizer.json; World's is always 0).
    Raises BoundaryTokenError for a boundary token that does not apply, another exception for a bad spec or file."""
    kind, where = _locate(spec)
    if kind == "world":
        return WorldTokenizer(where, eos_token=eos_token, bos_token=bos_token)
    return TextTokenizer(spec, eos_token=eos_token, bos_token=bos_token)


def load_tokenizer(cfg: DataConfig) -> TextTokenizer | WorldTokenizer:
    """data.tokenizer opened with data's boundary tokens; any problem is a ConfigError naming the key."""
    try:
        return open_tokenizer(cfg.tokenizer, eos_token=cfg.eos_token, bos_token=cfg.bos_token)
    except BoundaryTokenError as e:
        raise ConfigError(f"data.{e.setting}", e.expected, e.got) from None
    except Exception as e:  # a missing file, a bad json or World vocabulary, an unknown hub id
        raise ConfigError("data.tokenizer", "a tokenizer.json (file or folder), a reachable hub id, "
                          "\"rwkv-world\" or a World vocabulary .txt", f"{cfg.tokenizer} ({e})") from None


def tokenizer_files(spec: str) -> dict[str, Path]:
    """The local files a spec's tokenizer is read from, by the name they take in an export folder, where
    open_tokenizer(folder) finds them again: tokenizer.json, or the World vocabulary under its own name (prefixed
    "rwkv_vocab_" unless it starts so). Empty for a hub id; FileNotFoundError for a path that is not there."""
    kind, where = _locate(spec)
    if kind == "world":
        name = Path(where).name
        return {name if name.startswith("rwkv_vocab") else f"rwkv_vocab_{name}": Path(where).resolve()}
    return {"tokenizer.json": Path(where).resolve()} if kind == "json" else {}


def world_vocab_file() -> str:
    """The World vocabulary that the `rwkv` package ships."""
    try:
        import rwkv
    except ImportError:
        raise FileNotFoundError(f"the rwkv package (which ships {WORLD_VOCAB}) is not installed") from None
    return os.path.join(os.path.dirname(rwkv.__file__), WORLD_VOCAB)


def _locate(spec: str) -> tuple[str, str]:
    """("world", vocabulary path), ("json", tokenizer.json path) or ("hub", hub id)."""
    if spec == WORLD_SPEC:
        return "world", world_vocab_file()
    path = resolve_path(spec)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return "json", os.path.join(path, "tokenizer.json")
        return "world", _folder_world_vocab(path, spec)
    if spec.endswith(".txt"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no World vocabulary file at {spec!r}")
        return "world", path
    if os.path.isfile(path):
        return "json", path
    if os.path.exists(path) or spec.startswith((".", "/")) or spec.endswith(".json"):
        raise FileNotFoundError(f"no tokenizer.json at {spec!r}")
    return "hub", spec


def _folder_world_vocab(folder: str, spec: str) -> str:
    if os.path.isfile(os.path.join(folder, WORLD_VOCAB)):
        return os.path.join(folder, WORLD_VOCAB)
    found = sorted(p for p in Path(folder).glob("rwkv_vocab*.txt") if p.is_file())
    if not found:
        raise FileNotFoundError(f"no tokenizer.json or World vocabulary (rwkv_vocab*.txt) in {spec!r}")
    if len(found) > 1:
        raise FileNotFoundError(f"several World vocabularies in {spec!r} ({', '.join(p.name for p in found)}): "
                                f"name one")
    return str(found[0])


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the ids the pipeline needs. Document text never yields control tokens: a
    document that contains the string "<|endoftext|>" is tokenized as that text, not as the boundary token."""

    def __init__(self, spec: str, *, eos_token: str | None, bos_token: str | None):
        kind, where = _locate(spec)
        if kind == "world":
            raise ValueError(f"{spec!r} is a World vocabulary, not a tokenizer.json: open it with open_tokenizer")
        # a hub id needs the network once, then the cache
        self.tokenizer = Tokenizer.from_file(where) if kind == "json" else Tokenizer.from_pretrained(where)
        self.tokenizer.encode_special_tokens = True
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._token_id(eos_token, "eos_token")
        self.bos_id = self._token_id(bos_token, "bos_token")

    def _token_id(self, token: str | None, setting: str) -> int | None:
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise BoundaryTokenError(setting, "a token of the tokenizer's vocabulary", token)
        return token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (batched: one call into Rust for many documents)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; control tokens (the boundary tokens among them) are left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class WorldTokenizer:
    """RWKV's World tokenizer: the longest vocabulary entry that matches the text's UTF-8 bytes at the current
    position, again and again. Id 0 is RWKV's document separator and its only control token (eos_id = bos_id = 0,
    named "<|endoftext|>" here); no text encodes to it, since the vocabulary holds every single byte and not id 0.

    Encoding runs in pyrwkv_tokenizer (Rust, one thread). The vocabulary is also read here, to check the file (that
    library accepts a malformed one silently) and to decode (it cannot decode a partial UTF-8 character)."""

    vocab_size = WORLD_MODEL_VOCAB

    def __init__(self, path: str, *, eos_token: str | None, bos_token: str | None):
        for setting, token in (("eos_token", eos_token), ("bos_token", bos_token)):
            if token not in (None, WORLD_SEPARATOR):
                raise BoundaryTokenError(setting, f"{WORLD_SEPARATOR!r} (the World vocabulary's only control token, "
                                                  f"id 0)", token)
        self.eos_id = self.bos_id = 0
        self.pieces = read_world_vocab(path)
        self.encoder = _rust_world_tokenizer(path)
        # The Rust reader parses the file on its own: it must see the same entries as read_world_vocab.
        for token_id, piece in enumerate(self.pieces):
            text = _utf8(piece)
            if text and self.encoder.encode(text) != [token_id]:
                raise ValueError(f"{path}: pyrwkv_tokenizer reads entry {token_id} differently")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (one call per text: the library's batch call starts a thread pool per call)."""
        return [self.encoder.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; id 0 and ids past the vocabulary give nothing, bytes that are not UTF-8 give U+FFFD."""
        return b"".join(self.pieces[i] if 0 <= i < len(self.pieces) else b"" for i in ids).decode("utf-8", "replace")


def read_world_vocab(path: str) -> list[bytes]:
    """The bytes of each id (b"" where the file has none: id 0 and unused ids) from a World vocabulary file: one
    entry a line, `<id> <Python str or bytes literal> <length in bytes>`. Raises ValueError naming the line."""
    pieces = [b""] * WORLD_MODEL_VOCAB
    seen: set[bytes] = set()
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines, as RWKV's own reader
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        where = f"{path} line {number}"
        try:
            first, last = line.index(" "), line.rindex(" ")
            token_id, length = int(line[:first]), int(line[last + 1:])
            literal = line[first + 1:last]
            quote = literal[:1]
            if quote in ("'", '"') and len(literal) > 1 and literal.endswith(quote) and quote not in literal[1:-1] \
                    and "\\" not in literal:
                piece = literal[1:-1]  # a quoted string without escapes, as most are: literal_eval is slow
            else:
                piece = ast.literal_eval(literal)  # a literal only: never runs code from the file
        except (ValueError, SyntaxError):
            raise ValueError(f"{where}: expected '<id> <str or bytes literal> <length>'") from None
        piece = piece.encode("utf-8") if isinstance(piece, str) else piece
        if not isinstance(piece, bytes) or len(piece) != length or not piece:
            raise ValueError(f"{where}: expected a non-empty str or bytes literal of {length} bytes")
        if not 0 < token_id < WORLD_MODEL_VOCAB:
            raise ValueError(f"{where}: id {token_id} is not in 1..{WORLD_MODEL_VOCAB - 1}")
        if pieces[token_id] or piece in seen:
            raise ValueError(f"{where}: id {token_id} or its bytes {piece!r} came before")
        pieces[token_id] = piece
        seen.add(piece)
    missing = [b for b in range(256) if bytes([b]) not in seen]
    if missing:  # then some text would have no encoding
        raise ValueError(f"{path}: not a World vocabulary: {len(missing)} single bytes have no id "
                         f"(first: {missing[0]:#04x})")
    return pieces


def _utf8(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _rust_world_tokenizer(path: str):
    import pyrwkv_tokenizer

    try:
        return pyrwkv_tokenizer.WorldTokenizer(path)
    except Exception as e:
        raise ValueError(f"{path}: pyrwkv_tokenizer cannot read it ({e})") from None
    except BaseException as e:  # a Rust panic arrives as pyo3's PanicException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"{path}: pyrwkv_tokenizer cannot read it ({str(e).splitlines()[0]})") from None
