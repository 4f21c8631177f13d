"""The training loader end to end: exact resume over ranks x workers, mixing proportions, eval batches, the sample."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flame.data import build_eval_loader, build_train_loader
from flame.data.config import DataConfig, SourceConfig

from tests.data.corpora import TOKENIZER, data_config, make_corpus, write_docs


def loader(cfg, rank=0, world=1, seq_len=64, batch_size=2, seed=7):
    return build_train_loader(cfg, seq_len=seq_len, batch_size=batch_size, grad_accum=2, dp_rank=rank,
                              dp_world=world, seed=seed, vocab_size=50304)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def checkpoint_roundtrip(saved, fresh, folder):
    """As flame/train.py does it: DCP save of {"dataloader": {rank: state}}, DCP load into a fresh loader's
    state_dict as the template, then load_state_dict."""
    dcp.save({"dataloader": {"rank_0": saved.state_dict()}}, checkpoint_id=str(folder))
    template = {"dataloader": {"rank_0": fresh.state_dict()}}
    dcp.load(template, checkpoint_id=str(folder))
    fresh.load_state_dict(template["dataloader"]["rank_0"])


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    # Small on purpose: every reader goes through several epochs of both sources within the test.
    root = tmp_path_factory.mktemp("mix")
    make_corpus(root / "pile", "p", n_files=5, docs_per_file=8, fmt="jsonl.zst", words="pile")  # by file
    make_corpus(root / "web", "w", n_files=2, docs_per_file=10, fmt="parquet", words="web")  # shared files
    return root


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("num_workers,varlen", [(2, True), (0, False)])
def test_exact_resume_over_two_ranks(two_sources, tmp_path, num_workers, varlen):
    cfg = data_config((str(two_sources / "pile"), 0.7), (str(two_sources / "web"), 0.3), num_workers=num_workers,
                      shuffle_buffer=16, varlen=varlen)
    straight = {}
    for rank in range(2):
        straight[rank] = take(loader(cfg, rank, 2), 14)
        first = loader(cfg, rank, 2)
        head = take(first, 5)
        restored = loader(cfg, rank, 2)
        checkpoint_roundtrip(first, restored, tmp_path / f"ckpt-{rank}")
        resumed = loader(cfg, rank, 2)  # saved again before drawing a batch: still the same position
        checkpoint_roundtrip(restored, resumed, tmp_path / f"ckpt-{rank}-again")
        assert_same_batches(head + take(resumed, 9), straight[rank])
        assert resumed.metrics()["data_source0_epoch"] >= 1 and resumed.metrics()["data_source1_epoch"] >= 1
    assert not any(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(straight[0], straight[1]))


@pytest.mark.parametrize("add_bos", [False, True])
def test_unshuffled_stream_is_the_documents_in_file_order(tmp_path, tokenizer, add_bos):
    texts = make_corpus(tmp_path, "s", n_files=1, docs_per_file=30, fmt="jsonl")
    cfg = data_config((str(tmp_path / "s-00.jsonl"), 1.0), num_workers=0, shuffle_buffer=0, add_bos=add_bos)
    expected = []
    for ids in tokenizer.encode_batch(texts + texts):  # two passes
        expected += [tokenizer.bos_id] * add_bos + ids + [tokenizer.eos_id]
    batches = take(loader(cfg, seq_len=50, batch_size=3), 6)
    assert torch.cat([b["input_ids"].view(-1) for b in batches]).tolist() == expected[: 6 * 150]


def test_resume_refuses_another_layout(two_sources):
    cfg = data_config((str(two_sources / "pile"), 1.0), num_workers=0)
    state = loader(cfg, 0, 2).state_dict()
    with pytest.raises(ValueError, match="dp_world"):
        loader(cfg, 0, 4).load_state_dict(state)


def test_mixing_follows_the_token_weights(tmp_path, tokenizer):
    a = [" ".join(["alpha"] * (40 + 7 * i % 40)) for i in range(30)]
    b = [" ".join(["omega"] * (30 + 5 * i % 30)) for i in range(30)]
    write_docs(tmp_path / "a.jsonl", a, "jsonl")
    write_docs(tmp_path / "b.jsonl", b, "jsonl")
    ids_a = {t for ids in tokenizer.encode_batch(a) for t in ids}
    ids_b = {t for ids in tokenizer.encode_batch(b) for t in ids}
    assert not ids_a & ids_b
    for weights in ((0.8, 0.2), (1.0, 3.0)):
        cfg = data_config((str(tmp_path / "a.jsonl"), weights[0]), (str(tmp_path / "b.jsonl"), weights[1]),
                          num_workers=0, shuffle_buffer=8)
        tokens = torch.cat([batch["input_ids"].view(-1) for batch in take(loader(cfg, seq_len=256, batch_size=4), 25)])
        n_a = sum(int((tokens == t).sum()) for t in ids_a)
        n_b = sum(int((tokens == t).sum()) for t in ids_b)
        assert n_a + n_b + int((tokens == tokenizer.eos_id).sum()) == tokens.numel()
        assert abs(n_a / (n_a + n_b) - weights[0] / sum(weights)) < 0.02


def test_eval_loader_is_fresh_and_deterministic_per_rank():
    cfg = DataConfig(sources=[SourceConfig(path="data/sample/pile/*.jsonl.zst")],
                     eval_sources=[SourceConfig(path="data/sample/eval/*.jsonl")], tokenizer=TOKENIZER)
    assert build_eval_loader(DataConfig(sources=cfg.sources, tokenizer=TOKENIZER), seq_len=32, batch_size=2,
                             dp_rank=0, dp_world=1) is None
    ranks = [build_eval_loader(cfg, seq_len=128, batch_size=2, dp_rank=r, dp_world=2) for r in range(2)]
    first = [b for b, _ in zip(ranks[0], range(4))]
    again = [b for b, _ in zip(ranks[0], range(4))]
    assert_same_batches(first, again)
    other = [b for b, _ in zip(ranks[1], range(4))]
    assert not any(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, other))
    assert ranks[0].vocab_size == 50277


def test_bundled_sample_with_workers_through_the_toml(tmp_path):
    from flame.config import load_config

    toml = tmp_path / "tiny.toml"
    toml.write_text(
        '[data]\ntokenizer = "data/tokenizer/gpt-neox-20b/tokenizer.json"\nnum_workers = 2\nshuffle_buffer = 64\n'
        '[[data.sources]]\npath = "data/sample/pile/*.jsonl.zst"\nweight = 0.8\n'
        '[[data.sources]]\npath = "data/sample/webtext/*.parquet"\nweight = 0.2\n'
        '[[data.eval_sources]]\npath = "data/sample/eval/*.jsonl"\n')
    cfg = load_config(toml).data
    train = loader(cfg, seq_len=256, batch_size=4)
    batches = take(train, 6)
    assert train.vocab_size == 50277
    for batch in batches:
        assert batch["input_ids"].shape == batch["labels"].shape == (4, 256)
        assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < train.vocab_size
    assert any(int((b["input_ids"] == 0).sum()) for b in batches)  # documents end with <|endoftext|>
    m = train.metrics()
    assert m["data_docs"] > 0 and m["data_tokens"] >= 6 * 4 * 256 // 2
