"""Rebuild data/tokenizer/gpt-neox-20b/tokenizer.json (the Pile's GPT-NeoX-20B tokenizer) without any model hub.

Run by hand only (it downloads); CI never runs it. Steps:

1. `pip download --no-binary :all: llama-cpp-python==0.3.36`: its sdist vendors llama.cpp, whose
   `models/ggml-vocab-gpt-neox.gguf` holds the GPT-NeoX-20B vocabulary, token types and BPE merges, and whose
   `gguf-py/` reads that file (so no extra package is needed).
2. Convert: byte-level BPE with the GPT-2 pre-tokenizer regex, NFC normalizer (as GPT-NeoX-20B), the two control
   tokens as special added tokens and the 23 runs of spaces (ids 50254..50276) as plain added tokens. llama.cpp pads
   the table to 50432 rows with "[PAD<id>]" entries; those are not part of the tokenizer and are dropped (50277 ids).
3. Check the *converter* on a vocabulary with reference vectors made by the original HF tokenizer: llama.cpp ships
   `ggml-vocab-gpt-2.gguf` with `.inp`/`.out` test vectors (for GPT-NeoX it ships none); converting it the same way
   must reproduce every vector.
4. With `--llama-tokenize PATH` (llama.cpp's `llama-tokenize`, built from the same sdist:
   `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-tokenize`), write reference vectors for
   GPT-NeoX made by llama.cpp's own BPE (an implementation independent of `tokenizers`) on our test strings,
   data/tokenizer/gpt-neox-20b/reference.jsonl; tests/data/test_tokenizer.py checks the committed tokenizer.json
   against them. The gguf names no pre-tokenizer (llama.cpp would fall back to its "default" regex), so a copy of it
   with tokenizer.ggml.pre = "gpt-2" (GPT-NeoX's regex) is what llama-tokenize reads.

    python scripts/convert_neox_tokenizer.py [--sdist llama_cpp_python-0.3.36.tar.gz] [--llama-tokenize PATH]
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SDIST_VERSION = "0.3.36"
OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "gpt-neox-20b"
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"  # llama.cpp's .inp format
# gguf token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# Our test strings: edge cases of byte-level BPE and of GPT-NeoX's added whitespace tokens.
TEST_STRINGS = [
    "", " ", "  ", "   ", " " * 24, " " * 25, "a" + " " * 7 + "b", "\t", "\n", "\n\n\n", "\t\n \n",
    "Hello world", " Hello world", "Hello, world!", "HELLO WORLD?!",
    "It's what I'd've done, they're sure; we'll see. You've", "don't  DON'T", "'s 're 've 'm 'll 'd 't",
    "3.14159 1,000,000 2024-01-31 0x7FF 1e-9", "123456789 12 1234", "the 1990s and '80s",
    "naïve café résumé — “quoted” ‘single’ … ©®™", "Ångström e\u0301 (combining accent, NFC-normalized)",
    "日本語のテキスト、中文文本，한국어", "Привет, мир! Γειά σου Κόσμε", "emoji 🦙🚀👍🏽 and ZWJ 👩‍💻", "\u00a0nbsp\u2009thin",
    "def f(x):\n    return x ** 2  # square\n\tif x: pass", "<html><body class=\"a\">&amp;</body></html>",
    "<|endoftext|>", "text<|endoftext|>more", "<|padding|>", "http://example.com/path?q=1&r=two#frag",
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$", "!!!???...,,,;;;:::", "a\r\nb\rc", "\u200b\ufeffzero width",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want"
    " of a wife.",
    ":hacker: n.\n\n   [originally, someone who makes furniture with an axe] 1. A person who enjoys exploring the"
    " details of programmable systems and how to stretch their capabilities.",
]


def gguf_reader_from_sdist(sdist: Path, workdir: Path):
    """Extract the vocab files and gguf-py from the sdist; return (GGUFReader class, models folder)."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if "/vendor/llama.cpp/gguf-py/" in m.name or "/vendor/llama.cpp/models/ggml-vocab-" in m.name]
        tar.extractall(workdir, members=members, filter="data")
    root = next(workdir.glob("*/vendor/llama.cpp"))
    sys.path.insert(0, str(root / "gguf-py"))
    from gguf import GGUFReader  # llama.cpp's own reader, vendored in the sdist

    return GGUFReader, root / "models"


def gguf_to_tokenizer(reader_cls, gguf_path: Path, *, nfc: bool) -> Tokenizer:
    fields = reader_cls(str(gguf_path)).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    merges = list(fields["tokenizer.ggml.merges"].contents())
    assert fields["tokenizer.ggml.model"].contents() == "gpt2", "expected a byte-level BPE (gpt2) vocabulary"
    while tokens and tokens[-1] == f"[PAD{len(tokens) - 1}]":  # llama.cpp's padding rows, not real tokens
        tokens.pop()
    types = types[: len(tokens)]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token strings"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    # Control tokens never come out of plain text; user-defined ones (NeoX's space runs) are matched before BPE.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=True) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    return tok


def check_against_llama_vectors(tok: Tokenizer, inp: Path, out: Path) -> int:
    """Compare with llama.cpp's .inp/.out vectors; return the number of mismatches (printed)."""
    texts = inp.read_text(encoding="utf-8").split(TEST_SEPARATOR)
    expected = out.read_text(encoding="utf-8").split("\n")
    bad = 0
    for text, line in zip(texts, expected):
        want = [int(x) for x in line.split()]
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            bad += 1
            print(f"MISMATCH {text!r}: ours {got} reference {want}")
    print(f"{inp.name}: {len(texts) - bad}/{len(texts)} vectors reproduced")
    return bad


def gguf_with_pre_tokenizer(reader_cls, src: Path, dst: Path, pre: str) -> None:
    """Copy a tensor-less vocab gguf adding the string key tokenizer.ggml.pre (llama-tokenize ignores
    --override-kv): the new key/value goes right after the last one and the header's kv count grows by one."""
    last = list(reader_cls(str(src)).fields.values())[-1]
    end = last.offset + sum(part.nbytes for part in last.parts)
    data = bytearray(src.read_bytes())
    (kv_count,) = struct.unpack_from("<Q", data, 16)  # after magic, version (u32) and tensor count (u64)
    struct.pack_into("<Q", data, 16, kv_count + 1)
    key, value = b"tokenizer.ggml.pre", pre.encode()
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value
    dst.write_bytes(bytes(data[:end]) + entry + bytes(data[end:]))


def llama_reference(llama_tokenize: str, gguf_path: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [llama_tokenize, "-m", str(gguf_path), "-f", f.name, "--ids", "--no-bos", "--log-disable",
           "--no-parse-special"]
    line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", type=Path, help="llama_cpp_python-*.tar.gz (downloaded when omitted)")
    parser.add_argument("--llama-tokenize", help="llama.cpp's llama-tokenize binary, to write reference vectors")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="neox-tok-"))
    sdist = args.sdist
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
                        f"llama-cpp-python=={SDIST_VERSION}"], check=True)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    reader_cls, models_dir = gguf_reader_from_sdist(sdist, work / "src")

    gpt2 = gguf_to_tokenizer(reader_cls, models_dir / "ggml-vocab-gpt-2.gguf", nfc=False)
    if check_against_llama_vectors(gpt2, models_dir / "ggml-vocab-gpt-2.gguf.inp",
                                   models_dir / "ggml-vocab-gpt-2.gguf.out"):
        sys.exit("the converter does not reproduce GPT-2's reference vectors; not writing anything")

    neox_gguf = models_dir / "ggml-vocab-gpt-neox.gguf"
    neox = gguf_to_tokenizer(reader_cls, neox_gguf, nfc=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    neox.save(str(args.out_dir / "tokenizer.json"), pretty=False)
    print(f"wrote {args.out_dir / 'tokenizer.json'} ({neox.get_vocab_size()} tokens)")

    if args.llama_tokenize:
        patched = work / "gpt-neox-pre-gpt2.gguf"
        gguf_with_pre_tokenizer(reader_cls, neox_gguf, patched, "gpt-2")
        # GPT-NeoX NFC-normalizes before BPE and llama.cpp does not: llama.cpp gets the normalized text.
        rows = [{"text": t, "ids": llama_reference(args.llama_tokenize, patched, unicodedata.normalize("NFC", t))}
                for t in TEST_STRINGS]
        with open(args.out_dir / "reference.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        neox.encode_special_tokens = True  # as flame.data.tokenizer uses it: document text is never a control token
        mismatches = [r["text"] for r in rows if neox.encode(r["text"], add_special_tokens=False).ids != r["ids"]]
        print(f"wrote {len(rows)} llama.cpp reference vectors; tokenizer.json disagrees on {len(mismatches)}: {mismatches}")


if __name__ == "__main__":
    main()
