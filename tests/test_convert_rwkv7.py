"""flame.convert for RWKV-7: an RWKV-LM x070 .pth gives the rwkv package's logits once converted, round trips through
RWKV-LM and FLA are bit-exact, FLA loads the --to fla folder, tokenizers travel along, checkpoint.init_from takes a
.pth directly. FLA's logits on our export are checked on the GPU (FLA's RWKV-7 takes ~20 s on CPU's interpreter)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flame.convert import load_init_weights
from flame.data.tokenizer import open_tokenizer
from flame.export import WEIGHTS, read_export
from flame.models import build_model
from tests.convert_helpers import (X070_LERP, X070_RANKS, assert_rwkv_lm_round_trip, assert_same_export,
                                   checkpoint_fixtures, convert, flame_logits_one_and_two_documents, relative,
                                   rwkv_package_settings, x070_checkpoint)
from tests.helpers import REPO, fla_logits_error, read_checkpoint, run_train, write_config

LAYERS, WIDTH, HEAD, VOCAB = 3, 128, 64, 300   # x070_checkpoint's default shape


def fla_name_map(layers: int) -> dict[str, tuple[str, str]]:
    """FLA RWKV7ForCausalLM name -> (flame name, how FLA holds it): same, row j of lerp, [1,1,C], transposed."""
    m = {"model.embeddings.weight": ("embed.weight", "same"), "model.norm.weight": ("norm.weight", "same"),
         "model.norm.bias": ("norm.bias", "same"), "lm_head.weight": ("lm_head.weight", "same")}
    for p in ("weight", "bias"):
        m[f"model.layers.0.pre_norm.{p}"] = (f"embed_norm.{p}", "same")
    for i in range(layers):
        f, o = f"model.layers.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            m[f"{f}attn_norm.{p}"] = (f"{o}attn_norm.{p}", "same")
            m[f"{f}ffn_norm.{p}"] = (f"{o}ffn_norm.{p}", "same")
            m[f"{f}attn.g_norm.{p}"] = (f"{o}attn.ln_x.{p}", "same")
        for j, name in enumerate(X070_LERP):
            m[f"{f}attn.{name}"] = (f"{o}attn.lerp", f"row{j}")
        for name in ("k_k", "k_a", "r_k", "r_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
            m[f"{f}attn.{name}"] = (f"{o}attn.{name}", "same")
        for x in ("w", "a", "v", "g"):
            if x == "v" and i == 0:
                continue
            m[f"{f}attn.{x}_lora.lora.0.weight"] = (f"{o}attn.{x}1", "t")
            m[f"{f}attn.{x}_lora.lora.2.weight"] = (f"{o}attn.{x}2", "t")
            if x != "g":
                m[f"{f}attn.{x}_lora.lora.2.bias"] = (f"{o}attn.{x}0", "same")
        for name in ("x_k", "key.weight", "value.weight"):
            m[f"{f}ffn.{name}"] = (f"{o}ffn.{name}", "same")
    return m


def held_by_fla(ours: dict, how: str, name: str) -> torch.Tensor:
    t = ours[name]
    if how.startswith("row"):
        return t[int(how[3:])].reshape(1, 1, -1)
    return t.t() if how == "t" else t


pth, exported = checkpoint_fixtures(x070_checkpoint)


@pytest.fixture(scope="module")
def rwkv_package(pth):
    """The rwkv package's RWKV_x070 (CPU fp32) on the .pth. Importing it switches global torch settings
    (TF32, cuDNN benchmark, JIT autocast); they are put back."""
    pytest.importorskip("rwkv")
    import importlib

    with rwkv_package_settings(v7=True):
        import rwkv.model
        if not hasattr(rwkv.model, "RWKV_x070"):   # imported before without RWKV-7
            importlib.reload(rwkv.model)
        return rwkv.model.RWKV_x070(str(pth.with_suffix("")), "cpu fp32")   # it appends .pth itself


def rnn_logits(model, tokens: list[int]) -> torch.Tensor:
    """The rwkv package in RNN mode, one token at a time from a fresh state (its TorchScript functions run
    unoptimized: the JIT's profiling runs cost several times the forward itself at this size)."""
    state, out = None, []
    with torch.jit.optimized_execution(False):
        for t in tokens:
            logits, state = model.forward(t, state)
            out.append(logits)
    return torch.stack(out)


def test_rwkv_lm_checkpoint_gives_the_rwkv_package_logits(exported, rwkv_package):
    tokens, single, packed = flame_logits_one_and_two_documents(exported, VOCAB)
    assert relative(single, rnn_logits(rwkv_package, tokens)) < 1e-4
    apart = torch.cat([rnn_logits(rwkv_package, tokens[:23]), rnn_logits(rwkv_package, tokens[23:])])
    assert relative(packed, apart) < 1e-4
    # the settings came from the shapes
    args = read_export(exported).args
    assert (args.num_layers, args.hidden_size, args.head_dim, args.vocab_size, args.ffn_mult) == \
        (LAYERS, WIDTH, HEAD, VOCAB, 4)
    assert [args.lora(x) for x in ("decay", "a", "v", "gate")] == list(X070_RANKS.values())


def test_flame_to_rwkv_lm_and_back_is_bit_exact(pth, exported, tmp_path):
    unused = {"blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"}   # RWKV-LM's, never read
    assert_rwkv_lm_round_trip(pth, exported, tmp_path, unused)


def test_fla_folder_loads_in_fla_and_round_trips(exported, tmp_path):
    pytest.importorskip("fla")
    from transformers import AutoConfig, AutoModelForCausalLM

    import fla  # noqa: F401  (registers FLA's models with transformers)

    out = tmp_path / "fla"
    convert(exported, out, "--to", "fla")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "RWKV7ForCausalLM"
    ours = read_export(exported).state
    theirs = model.state_dict()
    names = fla_name_map(LAYERS)
    assert theirs.keys() == names.keys()
    for k, (name, how) in names.items():
        assert torch.equal(theirs[k], held_by_fla(ours, how, name)), k
    assert sum(v.numel() for v in theirs.values()) == sum(v.numel() for v in ours.values())
    # config.json holds every field FLA's config class writes, with the same values it writes back
    written = json.loads((out / "config.json").read_text())
    config = AutoConfig.from_pretrained(out)
    config.save_pretrained(tmp_path / "resaved")
    assert written == json.loads((tmp_path / "resaved" / "config.json").read_text())

    convert(out, tmp_path / "back")
    assert_same_export(exported, tmp_path / "back")


def test_fla_made_folder_converts_into_flame(tmp_path):
    """A folder FLA itself wrote (its config.json, its own init) reads into flame with every tensor in place."""
    pytest.importorskip("fla")
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    config = RWKV7Config(hidden_size=WIDTH, num_hidden_layers=2, head_dim=HEAD, vocab_size=VOCAB,
                         decay_low_rank_dim=32, a_low_rank_dim=16, v_low_rank_dim=24, gate_low_rank_dim=40)
    torch.manual_seed(0)
    model = RWKV7ForCausalLM(config)
    with torch.no_grad():   # FLA zero-initializes several tensors: make every one distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(tmp_path / "fla")
    convert(tmp_path / "fla", tmp_path / "flame")
    ours = read_export(tmp_path / "flame").state
    theirs = model.state_dict()
    for k, (name, how) in fla_name_map(2).items():
        assert torch.equal(theirs[k], held_by_fla(ours, how, name)), k


def test_fla_weight_layouts(exported, tmp_path):
    """Sharded safetensors (model.safetensors.index.json) and pytorch_model.bin read as model.safetensors does."""
    from safetensors.torch import load_file, save_file

    convert(exported, tmp_path / "fla", "--to", "fla")
    config = (tmp_path / "fla" / "config.json").read_text()
    sd = load_file(str(tmp_path / "fla" / "model.safetensors"))
    names = sorted(sd)
    sharded, binary = tmp_path / "sharded", tmp_path / "binary"
    for folder in (sharded, binary):
        folder.mkdir()
        (folder / "config.json").write_text(config)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: sd[k] for k in keys}, str(sharded / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.save({k: v.to(torch.bfloat16) for k, v in sd.items()}, binary / "pytorch_model.bin")
    want = read_export(exported).state
    for folder in (sharded, binary):
        convert(folder, tmp_path / f"{folder.name}_flame")
        got = read_export(tmp_path / f"{folder.name}_flame").state
        exact = folder is sharded   # the .bin went through bf16
        assert all(torch.equal(got[k], want[k] if exact else want[k].bfloat16().float()) for k in want)


@pytest.mark.parametrize("vocab, expected", [(65536, "rwkv_vocab_v20230424.txt"), (50304, "tokenizer.json"),
                                             (300, None)])
def test_default_tokenizer_by_vocabulary(tmp_path, capsys, vocab, expected):
    pth = tmp_path / "m.pth"
    torch.save(x070_checkpoint(layers=2, width=64, vocab=vocab, ranks={"w": 8, "a": 8, "v": 8, "g": 8}), pth)
    convert(pth, tmp_path / "out")
    files = {p.name for p in (tmp_path / "out").iterdir()} - {"config.json", WEIGHTS}
    if expected is None:
        assert files == set() and "--tokenizer" in capsys.readouterr().err
        convert(tmp_path / "out", tmp_path / "attached", "--tokenizer", "rwkv-world")
        files = {p.name for p in (tmp_path / "attached").iterdir()} - {"config.json", WEIGHTS}
        expected = "rwkv_vocab_v20230424.txt"
    assert files == {expected}
    folder = tmp_path / ("attached" if vocab == 300 else "out")
    if expected == "tokenizer.json":
        source = REPO / "data" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json"
    else:
        import rwkv
        source = os.path.join(os.path.dirname(rwkv.__file__), expected)
    assert (folder / expected).read_bytes() == open(source, "rb").read()
    # the folder serves as a tokenizer spec (data.tokenizer, flame.generate)
    tokenizer = open_tokenizer(str(folder), eos_token=None, bos_token=None)
    assert type(tokenizer).__name__ == ("TextTokenizer" if expected == "tokenizer.json" else "WorldTokenizer")


def test_tokenizer_travels_through_fla_and_back(exported, tmp_path):
    convert(exported, tmp_path / "fla", "--to", "fla", "--tokenizer", "data/tokenizer/gpt-neox-20b")
    convert(tmp_path / "fla", tmp_path / "flame")
    neox = (REPO / "data" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json").read_bytes()
    assert (tmp_path / "fla" / "tokenizer.json").read_bytes() == neox
    assert (tmp_path / "flame" / "tokenizer.json").read_bytes() == neox


RWKV7_RUN = """
[job]
dump_folder = "{dump}"
[model]
name = "rwkv7"
vocab_size = 300
hidden_size = 128
num_layers = 3
head_dim = 64
decay_low_rank = 32
a_low_rank = 16
v_low_rank = 24
gate_low_rank = 40
[data]
synthetic = true
[training]
batch_size = 2
seq_len = 16
steps = 1
seed = 7
[optimizer]
lr = 1e-30
[lr_scheduler]
warmup_steps = 0
[checkpoint]
interval = 1000
[validation]
enable = false
"""


def test_init_from_takes_an_rwkv_lm_checkpoint(pth, exported, tmp_path):
    # a run started from the .pth, whose one step at a vanishing lr leaves the weights as loaded
    path, dump = write_config(tmp_path, "run", RWKV7_RUN)
    proc = run_train(path, f"--checkpoint.init_from={pth}")
    assert proc.returncode == 0 and "initialized from" in proc.stdout, proc.stderr[-3000:]
    trained = read_checkpoint(dump, 1)["model"]
    converted = read_export(exported).state
    assert trained.keys() == converted.keys()
    assert all(torch.equal(trained[k], converted[k]) for k in converted)
    # and the run folder (its DCP checkpoint) converts back into the same RWKV-LM tensors
    convert(dump, tmp_path / "run.pth", "--to", "rwkv-lm", "--step", "1")
    original, written = torch.load(pth), torch.load(tmp_path / "run.pth")
    assert all(torch.equal(written[k], v) for k, v in original.items() if not k.startswith("blocks.0.att.v"))

    # a model that does not fit: every misfit tensor and the setting behind it are named
    args = read_export(exported).args
    args.hidden_size, args.head_dim = 64, 32
    with torch.device("meta"):
        small = build_model(args)
    with pytest.raises(ValueError) as e:
        load_init_weights(small.to_empty(device="cpu"), pth)
    assert "embed.weight: shape (300, 128)" in str(e.value) and "model.hidden_size: 128" in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fla_gives_our_logits_on_cuda(exported, tmp_path, dtype, tolerance):
    pytest.importorskip("fla")
    err = fla_logits_error(exported, tmp_path / "fla", VOCAB, dtype)
    assert err < tolerance, err
