"""RWKV's World tokenizer in flame (data.tokenizer = "rwkv-world", a World .txt, an export folder): token ids equal
to the rwkv package's own TRIE_TOKENIZER, text back, the pipeline's document separator 0, clear config errors, and
generation from an export folder with either kind of tokenizer."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from safetensors.torch import save_file

from flame.config import ConfigError
from flame.data import build_train_loader, check_sources
from flame.data.config import DataConfig, SourceConfig
from flame.data.paths import REPO_ROOT
from flame.data.tokenizer import WorldTokenizer, open_tokenizer, tokenizer_files, world_vocab_file

from tests.data.corpora import TOKENIZER, write_docs

SAMPLE = REPO_ROOT / "data" / "sample"
TRICKY = [
    "\n\n", "\n", " ", "\r\n\r\n", "\t\tindented\n", "para one\n\npara two\n\n\n", "a" * 3000,
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 40, "-" * 300 + "#" * 81 + " " * 129, "1234567890" * 50,
    "😀", "👩‍👩‍👧‍👦 👍🏽 🇯🇵 🏳️‍🌈", "今天是美好的一天。", "日本語のテキスト、カタカナ",
    "한국어 문장입니다", "مرحبا بالعالم", "Ελληνικά καὶ ῥήματα", "e\u0301\u0301 n\u0303",
    "\x00\x01\x7f\x80\x9f", "\ufffd\ufffd", "\ufeffBOM", "\u2028\u2029\u200b\u200d", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠀀𪚥",
    "\U0010ffff\uffff", "b'\\xe4\\xb8' \\x80 \\u00ff", "<|endoftext|>", "text <|endoftext|> more",
    "Ã©Ã¨ mojibake Ã¢â‚¬â„¢", "",
]


def sample_documents(every: int = 30) -> list[str]:
    """Every `every`-th document of the bundled sample (Austen chapters, fortunes, Jargon File entries)."""
    docs = []
    for name in ("pile-00", "pile-01"):
        with open(f"{SAMPLE}/pile/{name}.jsonl.zst", "rb") as f:
            lines = zstandard.ZstdDecompressor().stream_reader(f).read().decode().splitlines()
        docs += [json.loads(line)["text"] for line in lines if line]
    for name in ("webtext-00", "webtext-01"):
        docs += pq.read_table(f"{SAMPLE}/webtext/{name}.parquet").column("text").to_pylist()
    return docs[::every]


@pytest.fixture(scope="module")
def reference():
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    return TRIE_TOKENIZER(world_vocab_file())


@pytest.fixture(scope="module")
def world():
    return open_tokenizer("rwkv-world")


def reference_text(reference, ids: list[int]) -> str:
    """The rwkv package's bytes of each id (none for ids it has no entry for), as text."""
    return b"".join(reference.idx2token.get(i, b"") for i in ids).decode("utf-8", "replace")


def test_encoding_equals_the_rwkv_package_and_decodes_back(world, reference):
    docs = sample_documents() + TRICKY
    assert len(docs) > 300
    ids = world.encode_batch(docs)
    assert ids == [reference.encode(d) for d in docs]
    assert sum(map(len, ids)) > 30_000
    assert all(0 not in x and max(x, default=1) < 65530 for x in ids)  # 0 is only ever the separator
    assert [world.decode(x) for x in ids] == docs
    assert isinstance(world, WorldTokenizer) and world.vocab_size == 65536 and world.eos_id == world.bos_id == 0


def test_decode_of_ids_that_are_not_whole_characters(world, reference):
    ids = world.encode_batch(["😀 and 今"])[0]
    assert len(reference.idx2token[ids[0]]) < 4  # the emoji is split into byte tokens
    for cut in range(len(ids) + 1):
        assert world.decode(ids[:cut]) == reference_text(reference, ids[:cut])
    assert world.decode([0, 65530, 65535] + ids) == "😀 and 今"


def test_pipeline_separates_documents_with_zero(tmp_path):
    docs = [t for t in TRICKY if t.strip()] + sample_documents(every=400)  # the pipeline skips blank documents
    write_docs(tmp_path / "docs.jsonl", docs, "jsonl")
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "docs.jsonl"))], tokenizer="rwkv-world",
                     num_workers=0, shuffle_buffer=0)
    cfg.validate()
    loader = build_train_loader(cfg, seq_len=64, batch_size=4, grad_accum=1, dp_rank=0, dp_world=1, seed=0,
                                vocab_size=65536)
    assert loader.vocab_size == 65536
    stream = []
    while stream.count(0) < len(docs) + 1:
        batch = next(loader)
        assert batch["input_ids"].shape == (4, 64)
        assert torch.equal(batch["input_ids"].flatten()[1:], batch["labels"].flatten()[:-1])
        stream += batch["input_ids"].flatten().tolist()
    loader.close()
    world = open_tokenizer("rwkv-world")
    pieces = []
    while 0 in stream:
        pieces.append(stream[:stream.index(0)])
        stream = stream[stream.index(0) + 1:]
    assert [world.decode(p) for p in pieces] == (docs + docs)[: len(pieces)]
    assert pieces[: len(docs)] == world.encode_batch(docs)


def world_vocab_lines() -> list[str]:
    """A small World-format vocabulary: every single byte, as RWKV's file writes them, and a few words."""
    lines = [f"{b + 1} {repr(chr(b)) if b < 128 else repr(bytes([b]))} 1" for b in range(256)]
    return lines + ["300 'the' 3", "301 ' the' 4", "302 '世界' 6", "303 b'\\xe4\\xb8' 2"]


def test_a_world_vocabulary_file_or_folder(tmp_path):
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    path = tmp_path / "small_vocab.txt"
    path.write_text("\r\n".join(world_vocab_lines()) + "\r\n", encoding="utf-8")
    small = open_tokenizer(str(path))
    texts = ["the cat and the 世界 in 丁", "thethe the"]
    assert small.encode_batch(texts) == [TRIE_TOKENIZER(str(path)).encode(t) for t in texts]
    assert [small.decode(x) for x in small.encode_batch(texts)] == texts

    folder = tmp_path / "export"
    folder.mkdir()
    for name, source in tokenizer_files(str(path)).items():
        shutil.copyfile(source, folder / name)
    assert small.encode_batch(texts) == open_tokenizer(str(folder)).encode_batch(texts)
    assert tokenizer_files(str(folder)) == {"rwkv_vocab_small_vocab.txt": folder / "rwkv_vocab_small_vocab.txt"}
    assert list(tokenizer_files(TOKENIZER)) == ["tokenizer.json"] and tokenizer_files("owner/some-model") == {}
    shutil.copyfile(TOKENIZER, folder / "tokenizer.json")
    assert open_tokenizer(str(folder)).vocab_size == 50277  # a tokenizer.json comes first


@pytest.mark.parametrize("content, message", [
    (None, "no World vocabulary file"),
    (["1 'a' 1", "2 'b'"], "line 2: expected '<id> <str or bytes literal> <length>'"),
    (["1 'ab' 3"], "line 1: expected a non-empty str or bytes literal of 3 bytes"),
    (["1 'a' 1", "1 'b' 1"], "line 2: id 1 or its bytes b'b' came before"),
    (["70000 'a' 1"], "line 1: id 70000 is not in 1..65535"),
    (["1 __import__('os').system('false') 1"], "line 1: expected '<id>"),
    (["1 'a' 1"], "not a World vocabulary: 255 single bytes have no id (first: 0x00)"),
])
def test_a_bad_world_vocabulary_is_one_config_line(tmp_path, content, message):
    path = tmp_path / "vocab.txt"
    if content is not None:
        path.write_text("\n".join(content) + "\n")
    write_docs(tmp_path / "a.jsonl", ["one document"], "jsonl")
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "a.jsonl"))], tokenizer=str(path))
    with pytest.raises(ConfigError) as e:
        check_sources(cfg)
    assert e.value.key == "data.tokenizer" and message in str(e.value) and "\n" not in str(e.value)


def test_boundary_tokens_of_the_world_vocabulary(tmp_path):
    write_docs(tmp_path / "a.jsonl", ["one document"], "jsonl")
    cfg = DataConfig(sources=[SourceConfig(path=str(tmp_path / "a.jsonl"))], tokenizer="rwkv-world",
                     eos_token="</s>")
    with pytest.raises(ConfigError, match=r"data.eos_token: expected '<\|endoftext\|>' \(the World vocabulary's "
                                          r"only control token, id 0\), got '</s>'"):
        check_sources(cfg)
    cfg.eos_token, cfg.bos_token = "<|endoftext|>", "<s>"
    with pytest.raises(ConfigError, match="data.bos_token"):
        check_sources(cfg)


def tiny_export(folder, vocab_size: int, tokenizer_spec: str):
    """An export folder written by hand in flame.export's format: config.json {"model": args}, model.safetensors,
    and the tokenizer's files under the names tokenizer_files gives."""
    from flame.models import build_model
    from flame.models.transformer import TransformerArgs

    torch.manual_seed(0)
    args = TransformerArgs(vocab_size=vocab_size, hidden_size=64, num_layers=2, num_heads=4)
    model = build_model(args)
    model.init_weights()
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model": dataclasses.asdict(args), "step": 0}))
    for name, source in tokenizer_files(tokenizer_spec).items():
        shutil.copyfile(source, folder / name)
    return model.eval()


@pytest.mark.parametrize("kind", ["world", "tokenizer.json"])
def test_generate_uses_the_export_folders_tokenizer(tmp_path, capsys, reference, kind):
    from tokenizers import Tokenizer

    from flame.generate import main

    spec, vocab = ("rwkv-world", 65536) if kind == "world" else (TOKENIZER, 50304)
    model = tiny_export(tmp_path / "export", vocab, spec)
    prompt = "Hello, 世界! 🌍"
    if kind == "world":
        ids, decode = reference.encode(prompt), lambda x: reference_text(reference, x)
    else:
        neox = Tokenizer.from_file(TOKENIZER)
        ids, decode = neox.encode(prompt, add_special_tokens=False).ids, neox.decode
    with torch.no_grad():  # greedy, one token at a time, from the model written into the folder
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    main([str(tmp_path / "export"), "--prompt", prompt, "--max-new-tokens", "4"])
    assert capsys.readouterr().out == decode(ids) + "\n"
