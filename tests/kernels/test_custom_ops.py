"""The Triton chunk kernels as custom ops (flame::chunk_rwkv7 (also with the decay from its logits), flame::chunk_gsa
(also with the stacked projection y whose gradient its backward returns), flame::chunk_rwkv6 and their _bwd):
torch.library.opcheck of each operator on tiny inputs through the kernel under the interpreter (schema, fake against
the real outputs, autograd registration, AOT dispatch with dynamic shapes against eager), and one
torch.compile(fullgraph=True) of a whole RWKV-7 block on the Triton path: one graph, eager's outputs and gradients."""

from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest
import torch

from kernels.gsa import feature_maps
from kernels.gsa.chunk import chunk_gsa_bwd_op, chunk_gsa_op
from kernels.rwkv6.chunk import chunk_rwkv6_bwd_op, chunk_rwkv6_op
from kernels.rwkv7.chunk import chunk_rwkv7, chunk_rwkv7_bwd_op, chunk_rwkv7_op
from kernels.settings import from_text, to_text
from tests.kernels import common
from tests.kernels.inputs import gsa_inputs, rwkv6_inputs, rwkv7_inputs, rwkv7_logit_inputs

# Equal rows (two sequences of 16, initial and final states) and packed sequences of unknown lengths (cu_seqlens,
# seq_len 0, no states) with the op's other scan regime forced through its settings text.
CASES = {
    "rwkv7": [(2, 16, False, ""), (1, 32, True, "blocked_scan=True,block_chunks=1")],
    # the decay from its logits and bias (w_bias): the backward returns the logits' gradient
    "rwkv7_logits": [(2, 16, False, ""), (1, 32, True, "blocked_scan=True,block_chunks=1")],
    "gsa": [(2, 16, False, "stateless_forward=False"), (1, 32, True, "stateless_forward=True")],
    # the features from the stacked projection y (chunk_gsa_from_projection): the backward returns y's gradient
    "gsa_projection": [(2, 16, False, "stateless_forward=False"), (1, 32, True, "stateless_forward=True")],
    "rwkv6": [(2, 16, False, "chunk=16"), (1, 32, True, "chunk=16,blocked_scan=True,block_chunks=1,block_bv=16")],
}
PACKED = torch.tensor([0, 5, 32], dtype=torch.int32)


def op_inputs(name, B, T, packed, settings):
    """The forward op's arguments as the public call passes them: rows packed into [1, B*T, H, *], fp32 decays."""
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:]).contiguous().requires_grad_(True)  # noqa: E731
    cu = PACKED if packed else torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
    seq_len = 0 if packed else T
    if name.startswith("rwkv7"):
        if name == "rwkv7":
            xs, h0 = rwkv7_inputs(B, T, 1, 16, 16)
            bias = None
        else:
            xs, xs[1], bias, h0 = rwkv7_logit_inputs(B, T, 1, 16, 16)
            bias = bias.requires_grad_(True)
        h0 = None if packed else h0.requires_grad_(True)
        r, w, *rest = map(flat, xs)
        return [r, w, bias, *rest, 0.5, h0, True, cu, seq_len, settings]
    if name == "gsa":
        xs, (hk0, hv0) = gsa_inputs(B, T, 1, 16, 16, 16)
        states = [None, None] if packed else [hk0.transpose(-1, -2).contiguous().requires_grad_(True),
                                              hv0.requires_grad_(True)]
        return [*map(flat, xs), 0.25, *states, True, cu, seq_len, settings, None, 1.0]
    if name == "gsa_projection":   # y = (q | k | v | f) for one head of 16, 16 slots; its features are y's
        y = torch.randn(B * T, 64, generator=torch.Generator().manual_seed(T))
        q, k, v, s, g = feature_maps(*y.split(16, dim=-1), 8.0)
        xs = [x.reshape(1, B * T, 1, 16).detach().requires_grad_(True) for x in (q, k, v, s, g)]
        return [*xs, 1.0, None, None, False, cu, seq_len, settings, y.requires_grad_(True), 0.125]
    xs, h0 = rwkv6_inputs(B, T, 1, 16, 16)
    r, k, v, w, u = xs
    h0 = None if packed else h0.requires_grad_(True)
    return [*map(flat, (r, k, v, w)), u.requires_grad_(True), 0.25, h0, True, cu, seq_len, settings]


def bwd_inputs(name, args):
    """The backward op's arguments after a forward: the saved outputs and random output gradients."""
    with torch.no_grad():
        fwd = FORWARD[name](*args)
    detach = [x.detach() if isinstance(x, torch.Tensor) else x for x in args]
    n_out = 3 if name.startswith("gsa") else 2           # o and the final state(s)
    grads = [None if x is None else torch.randn_like(x) for x in fwd[:n_out]]
    want_ht = {"rwkv6": 7, "rwkv7": 9, "rwkv7_logits": 9}.get(name, 8)
    inputs = detach[:want_ht] + detach[want_ht + 1:]   # the backward takes no want_ht
    if name.startswith("gsa"):   # y and inv_norm come last
        return [*inputs[:-2], *fwd[n_out:], *grads, *inputs[-2:]]
    return [*inputs, *fwd[n_out:], *grads]


FORWARD = {"rwkv7": chunk_rwkv7_op, "rwkv7_logits": chunk_rwkv7_op, "gsa": chunk_gsa_op,
           "gsa_projection": chunk_gsa_op, "rwkv6": chunk_rwkv6_op}
BACKWARD = {"rwkv7": chunk_rwkv7_bwd_op, "rwkv7_logits": chunk_rwkv7_bwd_op, "gsa": chunk_gsa_bwd_op,
            "gsa_projection": chunk_gsa_bwd_op, "rwkv6": chunk_rwkv6_bwd_op}

CHANGED = {"rwkv7": dict(prec="ieee", scan_bv=32, prep_maxnreg=None, blocked_scan=True),
           "gsa": dict(prec="ieee", chunk=16, dkvsg_maxnreg=None, stateless_forward=False),
           "rwkv6": dict(prec="ieee", chunk=16, blocked_scan=False)}


@pytest.mark.parametrize("name", list(CHANGED))
def test_settings_travel_as_text(name):
    # the ops take their Settings as a string: changed fields only, "" for the defaults, parsed back to equal Settings
    default = importlib.import_module(f"kernels.{name}.chunk").Settings()
    changed = dataclasses.replace(default, **CHANGED[name])
    assert to_text(default) == "" and from_text(name, "") == default
    assert len(to_text(changed).split(",")) == len(CHANGED[name])
    assert from_text(name, to_text(changed)) == changed


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name):
    common.interpreted(chunk_rwkv7)   # skips unless the interpreter runs the kernels on CPU
    forward, backward = FORWARD[name], BACKWARD[name]
    rows, packed = (op_inputs(name, *case) for case in CASES[name])
    # every check on equal rows: the AOT one runs forward and backward compiled against eager
    torch.library.opcheck(forward, rows)
    # fakes against the real outputs' shapes, dtypes and strides in the other regime too (values are not compared:
    # the spare chunks a packed batch's upper bound allots are never written)
    torch.library.opcheck(forward, packed, test_utils="test_faketensor")
    torch.library.opcheck(backward, bwd_inputs(name, rows), test_utils=("test_schema", "test_faketensor"))


def test_opcheck_rwkv7_chunk_states_alone_kept():
    # keep_chunk_tensors=False: the forward returns empty per-chunk tensors, the backward forms them again
    common.interpreted(chunk_rwkv7)
    rows = op_inputs("rwkv7_logits", 2, 16, False, "keep_chunk_tensors=False")
    torch.library.opcheck(chunk_rwkv7_op, rows)
    torch.library.opcheck(chunk_rwkv7_bwd_op, bwd_inputs("rwkv7_logits", rows),
                          test_utils=("test_schema", "test_faketensor"))


def test_rwkv7_block_compiles_as_one_graph_on_the_triton_path(monkeypatch):
    # A whole block of the tiny config (narrowed to 2 heads of 16 for the interpreter), its chunk call forced onto
    # the Triton path: Dynamo must trace it without a graph break (fullgraph) and match eager in outputs and
    # gradients. aot_eager runs AOTAutograd's forward and backward graphs without code generation.
    import flame.models.rwkv7 as model_module
    from flame.config import load_config
    from flame.models import build_model

    common.interpreted(chunk_rwkv7)
    monkeypatch.setattr(model_module, "chunk_rwkv7", functools.partial(chunk_rwkv7, backend="triton"))
    cfg = load_config("configs/rwkv7_tiny.toml", ["--model.vocab_size=64", "--model.hidden_size=32",
                                                  "--model.head_dim=16"])
    torch.manual_seed(0)
    block = build_model(cfg.model).layers[0]
    for p in block.parameters():       # random weights: the zero-initialized output projections would hide gradients
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 16, 32)

    def grads(fn):
        block.zero_grad()
        xx = x.clone().requires_grad_(True)
        y, v_first = fn(xx, None, None, None)
        (y.sin().sum() + v_first.square().sum()).backward()
        return [y.detach(), xx.grad] + [p.grad for p in block.parameters()]

    graphs = []

    def aot_eager(gm, example_inputs):
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    eager = grads(block)
    torch._dynamo.reset()
    compiled = grads(torch.compile(block, fullgraph=True, backend=aot_eager))
    assert len(graphs) == 1 and "flame.chunk_rwkv7" in graphs[0], graphs
    for name, a, b in zip(["y", "dx", *(n for n, _ in block.named_parameters())], compiled, eager):
        assert b is not None and b.abs().sum() > 0, f"{name}: no gradient"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
