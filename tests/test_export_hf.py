"""The Transformer as a Hugging Face Llama folder (python -m flame.convert EXPORT DST --to hf): transformers'
AutoModelForCausalLM loads it in a process where fla cannot be imported and gives flame's logits (fp32, CPU);
flame.convert reads the folder back into the same tensors; its files get the umask's mode."""

from __future__ import annotations

import json
import stat

import pytest
import torch

from flame.convert import main as convert
from flame.convert import read_model
from flame.export import ModelState, load_exported, write_export
from flame.models import build_model, model_args_class
from tests.helpers import run_script

pytest.importorskip("transformers")

# transformers alone: fla is made unimportable first, so the folder cannot lean on FLA's registrations
LOAD_WITHOUT_FLA = """
import sys
sys.modules["fla"] = None
import torch
from transformers import AutoModelForCausalLM
folder, ids_file, out_file = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
assert "fla" not in type(model).__module__, type(model)
with torch.no_grad():
    torch.save(model(torch.load(ids_file)).logits, out_file)
print(type(model).__name__)
"""

CASES = {
    # grouped-query attention, a non-default RoPE base, SwiGLU width of its own
    "gqa": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=5000.0, intermediate_size=96,
                norm_eps=1e-5),
    # plain multi-head attention with the head tied to the embedding
    "tied": dict(hidden_size=48, num_layers=3, num_heads=3, tie_embeddings=True),
}


def tiny_export(folder, fields: dict):
    args = model_args_class("transformer")(name="transformer", vocab_size=211, **fields)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():   # norms away from 1 and larger residual branches, so that every tensor shows in the logits
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return write_export(folder, ModelState(args, dict(model.state_dict()), "test", seq_len=64))


@pytest.mark.parametrize("case", CASES)
def test_transformers_loads_it_without_fla_and_gives_flame_logits(case, tmp_path):
    exported = tiny_export(tmp_path / "export", CASES[case])
    hf = tmp_path / "hf"
    convert([str(exported), str(hf), "--to", "hf"])
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]

    ids = torch.randint(0, 211, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    # forked from the train_forks server, which has imported neither transformers nor fla
    proc = run_script(LOAD_WITHOUT_FLA, str(hf), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "LlamaForCausalLM"
    theirs = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        ours = load_exported(exported).eval()(ids)
    assert ours.abs().max() > 0.5   # logits with something to compare
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_the_folder_reads_back_into_the_same_tensors(tmp_path):
    exported = tiny_export(tmp_path / "export", CASES["gqa"])
    convert([str(exported), str(tmp_path / "hf"), "--to", "hf"])
    back = read_model(tmp_path / "hf")
    original = read_model(exported)
    assert back.args == original.args
    assert back.state.keys() == original.state.keys()
    assert all(torch.equal(back.state[k], v) for k, v in original.state.items())


def test_the_folder_files_follow_the_umask(tmp_path):
    exported = tiny_export(tmp_path / "export", CASES["tied"])
    # flame.convert's main as `python -m flame.convert` runs it, under the umask, forked from the train_forks server
    proc = run_script("import os; os.umask(0o027); from flame.convert import main; main()", str(exported),
                      str(tmp_path / "hf"), "--to", "hf", timeout=120)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert modes == {"config.json": 0o640, "model.safetensors": 0o640}, modes
