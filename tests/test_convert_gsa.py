"""flame.convert for GSA: a folder FLA wrote gives FLA's own logits once converted into flame (also with packed
documents), flame -> FLA -> flame is bit-exact, and FLA's from_pretrained loads the --to fla folder with our
weights. FLA's models run on CPU through tests/fla_cpu.py (Triton's interpreter)."""

from __future__ import annotations

import json

import pytest
import torch

from flame.convert import main
from flame.export import ModelState, load_exported, read_export, write_export
from flame.models import build_model, model_args_class
from tests.helpers import fla_logits_error

SETTINGS = {"vocab_size": 300, "hidden_size": 64, "num_heads": 2, "num_slots": 8, "use_short_conv": True}


def convert(*argv) -> None:
    main([str(a) for a in argv])


def fla_name(name: str) -> str:
    """flame GSA name -> FLA GSAForCausalLM name: FLA's names inside the blocks, FLA's prefixes outside."""
    for ours, theirs in (("embed.", "model.embeddings."), ("layers.", "model.layers."), ("norm.", "model.norm.")):
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A flame GSA export with random weights everywhere (norms included)."""
    args = model_args_class("gsa")(name="gsa", num_layers=2, **SETTINGS)
    with torch.device("meta"):
        shapes = build_model(args).state_dict()
    g = torch.Generator().manual_seed(0)
    state = {k: 0.1 * torch.randn(v.shape, generator=g) + (1.0 if "norm" in k else 0.0) for k, v in shapes.items()}
    return write_export(tmp_path_factory.mktemp("gsa") / "export", ModelState(args, state, "test"))


def test_fla_gsa_folder_gives_fla_logits(tmp_path):
    fla_cpu = pytest.importorskip("tests.fla_cpu")
    theirs = fla_cpu.fla_gsa(num_hidden_layers=2, **SETTINGS)
    with torch.no_grad():   # away from FLA's init (unit norms), so that every tensor matters
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "fla")
    convert(tmp_path / "fla", tmp_path / "flame")
    ours = load_exported(tmp_path / "flame").eval()
    docs = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(docs).logits                  # FLA: one document per row (one interpreted call: ~2 s)
        got = ours(docs)
        packed = ours(docs.reshape(1, 32), cu_seqlens=torch.tensor([0, 16, 32])).view(2, 16, -1)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert ((packed - want).abs().max() / want.abs().max()).item() < 1e-4


def test_fla_folder_loads_in_fla_and_round_trips(exported, tmp_path):
    pytest.importorskip("fla")
    from transformers import AutoConfig, AutoModelForCausalLM

    import fla  # noqa: F401  (registers FLA's models with transformers)

    convert(exported, tmp_path / "fla", "--to", "fla")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fla")
    assert type(model).__name__ == "GSAForCausalLM"
    ours, theirs = read_export(exported).state, model.state_dict()
    assert theirs.keys() == {fla_name(k) for k in ours}
    assert all(torch.equal(theirs[fla_name(k)], v) for k, v in ours.items())
    written = json.loads((tmp_path / "fla" / "config.json").read_text())
    AutoConfig.from_pretrained(tmp_path / "fla").save_pretrained(tmp_path / "resaved")
    assert written == json.loads((tmp_path / "resaved" / "config.json").read_text())

    convert(tmp_path / "fla", tmp_path / "back")
    a, b = read_export(exported), read_export(tmp_path / "back")
    assert a.args == b.args
    assert a.state.keys() == b.state.keys() and all(torch.equal(a.state[k], b.state[k]) for k in a.state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fla_gives_our_logits_on_cuda(exported, tmp_path, dtype, tolerance):
    pytest.importorskip("fla")
    err = fla_logits_error(exported, tmp_path / "fla", 300, dtype)
    assert err < tolerance, err
