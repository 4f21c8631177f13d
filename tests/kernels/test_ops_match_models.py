"""The kernel benchmarks time what the models run: each op adapter of kernels.ops (bench_kernels' "ours" rows, the sm_90
build records) calls our op with what the model's training forward passes it, in the dtypes FSDP's mixed precision
gives (bf16 parameters), and with the settings the model's 0.6B config gives. A mismatch here (an fp32 bias where the
model passes a bf16 parameter) once timed a kernel the training step never ran."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from flame.models import build_model, model_args_class
from kernels.ops import OPS

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]

# op: (its 0.6B-class config, the model module and the name it calls the op by, the op's module)
CALLS = {
    "rwkv7": ("rwkv7_0.6B.toml", "flame.models.rwkv7", "chunk_rwkv7", "kernels.rwkv7.chunk"),
    "gsa": ("gsa_0.6B.toml", "flame.models.gsa", "chunk_gsa_from_projection", "kernels.gsa.projection"),
    "rwkv6": ("rwkv6_0.4B.toml", "flame.models.rwkv6", "chunk_rwkv6", "kernels.rwkv6.chunk"),
}
# keywords that say how to run, not what: the benchmark picks the backend and the settings it times (the settings'
# defaults are compared apart), and unpacked rows pass no cu_seqlens
HOW = ("backend", "settings", "cu_seqlens")


def describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, x.dim())
    if isinstance(x, float):
        return ("float", x)
    return type(x).__name__


def recorder(calls: list, real):
    """real, recording what each call passes; it runs on the CPU (the PyTorch path) whatever backend was asked."""
    def record(*args, **kwargs):
        calls.append(([describe(a) for a in args],
                      {k: describe(v) for k, v in kwargs.items() if k not in HOW and v is not None},
                      kwargs.get("settings")))
        kwargs.pop("backend", None)
        return real(*args, **kwargs)
    return record


def small_model(config: str):
    """The config's model at a small width (its other fields as they are), bf16 as FSDP casts it for the forward."""
    fields = tomllib.loads((REPO / "configs" / config).read_text())["model"]
    heads = fields.get("num_heads")
    hidden = 2 * fields["hidden_size"] // heads if heads else 128
    fields.update(vocab_size=256, hidden_size=hidden, num_layers=2, **({"num_heads": 2} if heads else {}))
    args = model_args_class(fields["name"])(**fields)
    args.validate()
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("name", list(CALLS))
def test_op_adapter_calls_the_op_as_the_model_does(name, monkeypatch):
    config, model_module, fn_name, op_module = CALLS[name]
    op = OPS[name]
    model_calls, bench_calls = [], []
    real = getattr(importlib.import_module(op_module), fn_name)
    monkeypatch.setattr(importlib.import_module(model_module), fn_name, recorder(model_calls, real))
    monkeypatch.setattr(importlib.import_module(op_module), fn_name, recorder(bench_calls, real))

    model = small_model(config)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids)
    shape = (1, 32, 2, 256, 64) if name == "gsa" else (1, 32, 2, 64, 64)   # the small model's heads
    op.call(shape, op.make_inputs(*shape, device="cpu"), None)

    assert len(model_calls) == 2 and model_calls[0] == model_calls[1] and len(bench_calls) == 1, (model_calls,
                                                                                                   bench_calls)
    (m_args, m_kwargs, m_settings), (b_args, b_kwargs, b_settings) = model_calls[0], bench_calls[0]
    assert b_args == m_args, f"positional arguments: the benchmark's {b_args}, the model's {m_args}"
    assert b_kwargs == m_kwargs, f"keywords: the benchmark's {b_kwargs}, the model's {m_kwargs}"
    Settings = op.settings_type()
    assert (b_settings or Settings()) == (m_settings or Settings()), "the model runs other settings than the default"
