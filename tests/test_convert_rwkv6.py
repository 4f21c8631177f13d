"""flame.convert for RWKV-6: an RWKV-LM x060 .pth converted into flame gives the rwkv package's RWKV-6 logits (RNN
mode token by token, sequence mode, packed documents), the round trips through RWKV-LM and FLA are bit-exact, the
--to fla folder gives FLA's own model (on CPU, tests/fla_cpu.py) flame's logits, a folder FLA wrote converts into
flame with FLA's logits, foreseeable bad input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from flame.export import load_exported, read_export
from tests.convert_helpers import (assert_rwkv_lm_round_trip, assert_same_export, checkpoint_fixtures, convert,
                                   flame_logits_one_and_two_documents, random_rwkv_lm_checkpoint, relative,
                                   rwkv_package_x060)
from tests.helpers import one_thread  # noqa: F401  (the rwkv package's RNN mode: tiny ops per token)

LAYERS, WIDTH, HEAD, VOCAB = 2, 128, 64, 300
MIX_RANK, DECAY_RANK, FFN = 16, 24, 448   # ranks unlike RWKV-LM's defaults, so the widths must come from the shapes


def rwkv_lm_checkpoint(layers=LAYERS, width=WIDTH, head=HEAD, vocab=VOCAB, seed=0) -> dict:
    """Random tensors under RWKV-LM's x060 names and shapes, every one nonzero and of a scale where every path
    moves the logits (decays spread over exp(-exp(-2..0)), a bonus and gates away from their init)."""
    C, H = width, width // head

    def block(t, i):
        att, ffn = f"blocks.{i}.att.", f"blocks.{i}.ffn."
        sd = {f"{att}time_maa_{x}": t.rand(1, 1, C) for x in ("x", "w", "k", "v", "r", "g")}
        sd[att + "time_maa_w1"] = t.normal(C, 5 * MIX_RANK, std=0.1)
        sd[att + "time_maa_w2"] = t.normal(5, MIX_RANK, C, std=0.1)
        sd[att + "time_decay"] = t.normal(1, 1, C, std=0.5, mean=-1.0)
        sd[att + "time_decay_w1"] = t.normal(C, DECAY_RANK, std=0.1)
        sd[att + "time_decay_w2"] = t.normal(DECAY_RANK, C, std=0.1)
        sd[att + "time_faaaa"] = t.normal(H, head, std=0.5)
        for name in ("receptance", "key", "value", "output", "gate"):
            sd[f"{att}{name}.weight"] = t.normal(C, C, std=C ** -0.5)
        sd.update(t.norm(att + "ln_x"))
        sd[ffn + "time_maa_k"] = t.rand(1, 1, C)
        sd[ffn + "time_maa_r"] = t.rand(1, 1, C)
        sd[ffn + "key.weight"] = t.normal(FFN, C, std=C ** -0.5)
        sd[ffn + "receptance.weight"] = t.normal(C, C, std=C ** -0.5)
        sd[ffn + "value.weight"] = t.normal(C, FFN, std=FFN ** -0.5)
        return sd

    return random_rwkv_lm_checkpoint(layers, width, vocab, seed, block)


pth, exported = checkpoint_fixtures(rwkv_lm_checkpoint)


@pytest.fixture(scope="module")
def rwkv_package(pth):
    """The rwkv package's RWKV-6 on the .pth, CPU fp32 (tests/convert_helpers.py)."""
    return rwkv_package_x060(pth)


def rnn_logits(model, tokens: list[int]) -> torch.Tensor:
    """The rwkv package in RNN mode, one token at a time from a fresh state."""
    state, out = None, []
    for t in tokens:
        logits, state = model.forward([t], state)
        out.append(logits)
    return torch.stack(out)


def test_rwkv_lm_checkpoint_gives_the_rwkv_package_logits(exported, rwkv_package):
    tokens, single, packed = flame_logits_one_and_two_documents(exported, VOCAB)
    first = rnn_logits(rwkv_package, tokens[:23])                       # RNN mode, token by token
    whole, _ = rwkv_package.forward(tokens, None, full_output=True)      # sequence mode
    second, _ = rwkv_package.forward(tokens[23:], None, full_output=True)
    assert relative(single[:23], first) < 1e-4
    assert relative(single, whole) < 1e-4
    assert relative(packed, torch.cat([first, second])) < 1e-4           # each document from a fresh state
    args = read_export(exported).args   # the settings came from the shapes
    assert (args.name, args.num_layers, args.hidden_size, args.head_dim, args.vocab_size) == \
        ("rwkv6", LAYERS, WIDTH, HEAD, VOCAB)
    assert (args.mix_low_rank, args.decay_low_rank, args.ffn_width) == (MIX_RANK, DECAY_RANK, FFN)


def test_flame_to_rwkv_lm_and_back_is_bit_exact(pth, exported, tmp_path):
    assert_rwkv_lm_round_trip(pth, exported, tmp_path)


def test_bad_input_is_one_line(pth, exported, tmp_path, capsys):
    def fails(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            convert(*argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    sd = rwkv_lm_checkpoint(seed=1)
    del sd["blocks.1.att.time_decay_w2"]
    torch.save(sd, tmp_path / "missing.pth")
    assert "blocks.1.att.time_decay_w2" in fails(tmp_path / "missing.pth", tmp_path / "a")
    sd = rwkv_lm_checkpoint(seed=1)
    sd["blocks.1.ffn.value.weight"] = sd["blocks.1.ffn.value.weight"][:, :-32]
    torch.save(sd, tmp_path / "misshapen.pth")
    assert "blocks.1.ffn.value.weight" in fails(tmp_path / "misshapen.pth", tmp_path / "b")
    # RWKV-5 (x052) has time_faaaa but no data-dependent mixes
    sd = {k: v for k, v in rwkv_lm_checkpoint(seed=1).items() if "time_maa" not in k}
    torch.save(sd, tmp_path / "x052.pth")
    assert "x052" in fails(tmp_path / "x052.pth", tmp_path / "c")
    # FLA's RWKV-6 with a key width other than hidden_size (its default expand_k 0.5) is not flame's model
    convert(exported, tmp_path / "fla", "--to", "fla")
    capsys.readouterr()
    config = json.loads((tmp_path / "fla" / "config.json").read_text())
    (tmp_path / "fla" / "config.json").write_text(json.dumps({**config, "expand_k": 0.5}))
    assert "expand_k" in fails(tmp_path / "fla", tmp_path / "d")


def fla_logits(folder, ids):
    """FLA's RWKV6ForCausalLM from `folder`, fp32 on CPU under the interpreter (its PyTorch norms), logits of ids
    (below 64 tokens FLA runs its step-by-step kernel)."""
    fla_cpu = pytest.importorskip("tests.fla_cpu")
    from transformers import AutoModelForCausalLM

    import fla  # noqa: F401  (registers FLA's models with transformers)
    with fla_cpu.fla_interpreter(), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, fuse_norm=False, fuse_cross_entropy=False).float().eval()
        assert type(model).__name__ == "RWKV6ForCausalLM"
        return model(ids).logits


def test_fla_folder_gives_flame_logits_and_round_trips(exported, tmp_path):
    convert(exported, tmp_path / "fla", "--to", "fla")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    want = fla_logits(tmp_path / "fla", ids)
    with torch.no_grad():
        got = load_exported(exported).eval()(ids)
    assert relative(got, want) < 1e-4
    convert(tmp_path / "fla", tmp_path / "back")
    assert_same_export(exported, tmp_path / "back")


def test_fla_made_folder_converts_into_flame(tmp_path):
    # FLA's own init (its LoRA weights start at zero) moved away from it, so that every tensor matters
    fla_cpu = pytest.importorskip("tests.fla_cpu")
    theirs = fla_cpu.fla_rwkv6(hidden_size=WIDTH, num_heads=WIDTH // HEAD, expand_k=1.0, num_hidden_layers=LAYERS,
                               proj_low_rank_dim=MIX_RANK, gate_low_rank_dim=DECAY_RANK, vocab_size=VOCAB)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    theirs.save_pretrained(tmp_path / "fla")
    convert(tmp_path / "fla", tmp_path / "flame")
    ours = load_exported(tmp_path / "flame").eval()
    assert ours.args.ffn_width == 448   # FLA's width: int(3.5 C) rounded up to a multiple of 32
    docs = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(docs).logits
        got = ours(docs)
        packed = ours(docs.reshape(1, 32), cu_seqlens=torch.tensor([0, 16, 32])).view(2, 16, -1)
    assert relative(got, want) < 1e-4
    assert relative(packed, want) < 1e-4
