"""FLA / Hugging Face folders whose config.json says tie_word_embeddings = true, converted into flame: the output layer
is the one transformers (5) loads from the folder. lm_head.weight absent or equal to the embedding: the embedding (a
tied flame Transformer; the RWKV and GSA models get their own copy). lm_head.weight present and different:
transformers does not tie them and keeps it, and so does flame (untied, with a note). References: transformers' Llama
logits on CPU, and the lm_head that FLA's models load (no forward: that needs a GPU or Triton's slow interpreter)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flame.convert import load_init_weights
from flame.export import ModelState, load_exported, read_export, write_export
from flame.models import build_model, model_args_class
from tests.convert_helpers import convert

VOCAB = 100
MODELS = {   # tiny flame models of each kind, and the name of the embedding in their FLA / Hugging Face folders
    "transformer": (dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2), "model.embed_tokens.weight"),
    "rwkv7": (dict(hidden_size=64, num_layers=2, head_dim=32), "model.embeddings.weight"),
    "rwkv6": (dict(hidden_size=64, num_layers=2, head_dim=32, mix_low_rank=8, decay_low_rank=8),
              "model.embeddings.weight"),
    "gsa": (dict(hidden_size=64, num_layers=2, num_heads=2, num_slots=8), "model.embeddings.weight"),
}
HEADS = ("absent", "equal", "different")
"""What the tied folder holds as lm_head.weight: nothing, a copy of the embedding, a tensor of its own."""


def tied_folder(tmp_path, name: str, head: str):
    """An FLA folder of a random tiny flame `name` model, with tie_word_embeddings = true and lm_head.weight as
    `head` says; returns it and its tensors."""
    fields, _ = MODELS[name]
    args = model_args_class(name)(name=name, vocab_size=VOCAB, **fields)
    args.validate()
    torch.manual_seed(0)
    model = build_model(args)
    for p in model.parameters():   # every tensor random, the head unlike the embedding
        p.data.normal_(std=0.1)
    export, folder = tmp_path / f"{name}-{head}-export", tmp_path / f"{name}-{head}"
    write_export(export, ModelState(args, {k: v.clone() for k, v in model.state_dict().items()}, "test"))
    convert(export, folder, "--to", "fla")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    sd = dict(load_file(folder / "model.safetensors"))
    embed = sd[MODELS[name][1]]
    if head == "absent":
        del sd["lm_head.weight"]
    elif head == "equal":
        sd["lm_head.weight"] = embed.clone()
    assert head != "different" or not torch.equal(sd["lm_head.weight"], embed)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, sd


@pytest.mark.parametrize("head", HEADS)
def test_tied_llama_folder_gives_transformers_logits(tmp_path, head, capsys):
    from transformers import AutoModelForCausalLM

    folder, sd = tied_folder(tmp_path, "transformer", head)
    capsys.readouterr()
    convert(folder, tmp_path / "flame")
    note = "tie_word_embeddings = true, but lm_head.weight differs from the embedding" in capsys.readouterr().err
    assert note == (head == "different")
    assert read_export(tmp_path / "flame").args.tie_embeddings == (head != "different")
    ours = load_exported(tmp_path / "flame").eval()
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)

    # checkpoint.init_from the folder into a run's tied Transformer: the embedding is its output layer too
    args = read_export(tmp_path / "flame").args
    model = build_model(model_args_class("transformer")(**{**vars(args), "tie_embeddings": True}))
    if head == "different":   # a tied model cannot hold the folder's own head: one line naming it
        with pytest.raises(ValueError, match=r"model.tie_embeddings: False there, True here.*lm_head.weight"):
            load_init_weights(model, folder)
    else:
        load_init_weights(model, folder)
        assert torch.equal(model.embed.weight, sd["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", ["rwkv7", "rwkv6", "gsa"])
def test_tied_fla_folder_keeps_the_head_fla_loads(tmp_path, name):
    pytest.importorskip("fla")
    import fla  # noqa: F401  (registers FLA's models with transformers)
    from transformers import AutoModelForCausalLM

    for head in HEADS:
        folder, _ = tied_folder(tmp_path, name, head)
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).lm_head.weight.detach()
        convert(folder, tmp_path / f"flame-{head}")
        assert torch.equal(read_export(tmp_path / f"flame-{head}").state["lm_head.weight"], theirs), head
