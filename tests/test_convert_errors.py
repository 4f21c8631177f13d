"""flame.convert on bad input: one line on stderr naming the file (and the tensor), exit code 2, and no destination
(nor a temporary one) left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import flame.export
from flame.convert import main
from flame.export import ModelState, write_export
from flame.models import build_model, model_args_class
from tests.convert_helpers import x070_checkpoint
from tests.helpers import REPO, env

SMALL = {"layers": 2, "width": 64, "vocab": 50, "ranks": {"w": 8, "a": 8, "v": 8, "g": 8}}


def save_pth(path, **changes):
    sd = x070_checkpoint(**SMALL)
    for k, v in changes.items():
        if v is None:
            del sd[k]
        else:
            sd[k] = v
    torch.save(sd, path)
    return path


@pytest.fixture(scope="module")
def fla_folder(tmp_path_factory):
    """A valid FLA RWKV-7 folder (from a valid .pth)."""
    base = tmp_path_factory.mktemp("fla_ok")
    main([str(save_pth(base / "m.pth")), str(base / "fla"), "--to", "fla"])
    return base / "fla"


def gsa_export(folder, **fields):
    args = model_args_class("gsa")(name="gsa", vocab_size=50, hidden_size=64, num_layers=2, num_heads=2,
                                   num_slots=8, **fields)
    with torch.device("meta"):
        model = build_model(args)
    state = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    return write_export(folder, ModelState(args, state, "test"))


def copy_fla(src, dst, config=None, drop=None, reshape=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if drop:
        del sd[drop]
    if reshape:
        name, shape = reshape
        sd[name] = torch.zeros(shape)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


# Each case: (what to build in tmp_path -> argv tail after SRC DST, SRC, strings the one line must hold)
def case_missing_src(tmp):
    return tmp / "nothing.pth", [], ["nothing.pth", "no such file"]


def case_unknown_file(tmp):
    (tmp / "notes.txt").write_text("hello")
    return tmp / "notes.txt", [], ["notes.txt", "unknown format"]


def case_unknown_folder(tmp):
    (tmp / "folder").mkdir()
    (tmp / "folder" / "weights.npz").write_bytes(b"\0")
    return tmp / "folder", [], ["folder", "unknown format"]


def case_not_a_checkpoint(tmp):
    (tmp / "junk.pth").write_bytes(b"not a pickle")
    return tmp / "junk.pth", [], ["junk.pth", "not a readable PyTorch checkpoint"]


def case_older_rwkv(tmp):
    return save_pth(tmp / "v6.pth", **{"blocks.0.att.r_k": None, "blocks.0.att.time_faaaa": torch.zeros(1, 64)}), \
        [], ["v6.pth", "x070"]


def case_missing_tensor(tmp):
    return save_pth(tmp / "m.pth", **{"blocks.1.att.k_a": None}), [], ["m.pth", "missing tensor blocks.1.att.k_a"]


def case_extra_tensor(tmp):
    return save_pth(tmp / "m.pth", **{"blocks.1.att.s_emb.weight": torch.zeros(50, 64)}), [], \
        ["m.pth", "blocks.1.att.s_emb.weight", "not part of this model"]


def case_shape_against_config(tmp):
    return save_pth(tmp / "m.pth", **{"blocks.1.att.w1": torch.zeros(64, 16)}), [], \
        ["m.pth", "blocks.1.att.w1", "(64, 16)", "(64, 8)"]


def case_fla_unknown_model_type(tmp, fla):
    return copy_fla(fla, tmp / "mamba2", config={"model_type": "mamba2"}), [], ["config.json", "'mamba2'"]


def case_fla_missing_tensor(tmp, fla):
    return copy_fla(fla, tmp / "f", drop="model.layers.1.attn.v_lora.lora.2.bias"), [], \
        ["model.safetensors", "missing tensor model.layers.1.attn.v_lora.lora.2.bias"]


def case_fla_shape_against_config(tmp, fla):
    return copy_fla(fla, tmp / "f", config={"vocab_size": 64}), [], \
        ["model.safetensors", "model.embeddings.weight", "(50, 64)", "(64, 64)"]


def case_fla_no_weights(tmp, fla):
    (tmp / "f").mkdir()
    (tmp / "f" / "config.json").write_text((fla / "config.json").read_text())
    return tmp / "f", [], ["f", "no weights"]


def case_export_missing_tensor(tmp, fla):
    main([str(fla), str(tmp / "export")])
    sd = load_file(str(tmp / "export" / "model.safetensors"))
    del sd["layers.0.ffn.x_k"]
    save_file(sd, str(tmp / "export" / "model.safetensors"))
    return tmp / "export", [], ["model.safetensors", "missing tensor layers.0.ffn.x_k"]


def case_step_of_a_pth(tmp):
    return save_pth(tmp / "m.pth"), ["--step", "3"], ["m.pth", "--step"]


def case_missing_tokenizer(tmp):
    return save_pth(tmp / "m.pth"), ["--tokenizer", str(tmp / "no_tokenizer.json")], ["no_tokenizer.json"]


def case_gsa_to_rwkv_lm(tmp):
    return gsa_export(tmp / "gsa"), ["--to", "rwkv-lm"], ["gsa", "RWKV-7"]


def case_gsa_output_gate_to_fla(tmp):
    return gsa_export(tmp / "gsa", output_gate=True), ["--to", "fla"], ["gsa", "output_gate", "FLA"]


CASES = [case_missing_src, case_unknown_file, case_unknown_folder, case_not_a_checkpoint, case_older_rwkv,
         case_missing_tensor, case_extra_tensor, case_shape_against_config, case_step_of_a_pth,
         case_missing_tokenizer, case_gsa_to_rwkv_lm, case_gsa_output_gate_to_fla]
FLA_CASES = [case_fla_unknown_model_type, case_fla_missing_tensor, case_fla_shape_against_config,
             case_fla_no_weights, case_export_missing_tensor]


def assert_one_line_exit_2(argv, must_hold, capsys):
    dst = argv[1]
    capsys.readouterr()   # what building the case printed
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    for s in must_hold:
        assert s in err, (s, err)
    assert not dst.exists()
    assert not dst.parent.exists() or not [p for p in dst.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_bad_input(case, tmp_path, capsys):
    src, tail, must_hold = case(tmp_path)
    to = "out.pth" if "rwkv-lm" in tail else "out"
    assert_one_line_exit_2([src, tmp_path / "new" / to, *tail], must_hold, capsys)
    assert not (tmp_path / "new").exists()   # nor the folder made to hold it


@pytest.mark.parametrize("case", FLA_CASES, ids=lambda c: c.__name__[5:])
def test_bad_fla_input(case, fla_folder, tmp_path, capsys):
    src, tail, must_hold = case(tmp_path, fla_folder)
    assert_one_line_exit_2([src, tmp_path / "out", *tail], must_hold, capsys)


def test_existing_destination_is_left_alone(tmp_path, capsys):
    pth = save_pth(tmp_path / "m.pth")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as e:
        main([str(pth), str(tmp_path / "out")])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    pth = save_pth(tmp_path / "m.pth")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(flame.export, "save_file", disk_full)
    with pytest.raises(OSError):
        main([str(pth), str(tmp_path / "a" / "b" / "out"), "--to", "fla"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_command_line_prints_no_traceback(tmp_path):
    pth = save_pth(tmp_path / "m.pth", **{"head.weight": None})
    proc = subprocess.run([sys.executable, "-m", "flame.convert", str(pth), str(tmp_path / "out")], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {pth}: missing tensor head.weight"]
    assert not (tmp_path / "out").exists()
