"""GSA's fused output norm (kernels.silu_rms_norm) against an fp64 reference written here from the math (not
naive.py's code): y and the gradients of o and w, fp32 and bf16, with extreme rows (all zero, so the norm divides
by sqrt(eps); large positive and negative o, where silu is linear or vanishes).

CPU: the Triton kernels under TRITON_INTERPRET=1 and the PyTorch path the op takes on CPU; opcheck of both custom
ops; torch.compile(fullgraph=True) through the op. GPU (`-m gpu`): Triton in bf16 at the 0.6B model's shape.
Metric: RMSE(x - ref) / RMS(ref) (tests/kernels/common.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.silu_rms_norm import silu_rms_norm
from kernels.silu_rms_norm.op import Settings
from tests.kernels.common import assert_close, opcheck
from tests.kernels.fused import outputs_and_grads, reference, skip_without_interpreter
from tests.kernels.offline_build import in_compiling_process, skip_without_cuda_backend

EPS = 1e-5
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
NAMES = ("y", "do", "dw")


def ref_norm(o, w, eps):
    """fp64: u = o sigmoid(o); u / sqrt(mean(u^2) + eps) w."""
    u = o / (1 + torch.exp(-o))
    return u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps) * w


def norm_inputs(B, T, C, dtype, gen):
    o = 2 * torch.randn(B, T, C, generator=gen)
    o[:, 2] = 0.0                      # a zero row: rms 0, scaled by 1 / sqrt(eps)
    o[:, 3, : C // 2] = 40.0           # silu(x) = x
    o[:, 4] = -40.0                    # silu(x) ~ -1.7e-16: the row's norm is eps-dominated
    w = 1 + 0.3 * torch.randn(C, generator=gen)
    return [o.to(dtype), w]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("C", [96, 40])          # 40: channels below the power-of-two tile (masked)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_fp64_reference(backend, C, dtype):
    skip_without_interpreter(backend)
    B, T = 2, 19                       # 38 rows: partial row tiles and a partial last program of the backward
    xs = norm_inputs(B, T, C, dtype, torch.Generator().manual_seed(0))
    s = Settings(fwd_rows=4, bwd_rows=2, bwd_tiles=3, warps=4)
    got = outputs_and_grads(lambda *x: silu_rms_norm(*x, EPS, backend=backend, settings=s), xs, seed=1)
    ref = reference(ref_norm, xs, 1, EPS)
    assert got[0].dtype == dtype and got[0].shape == (B, T, C)
    assert got[2].dtype == torch.float32
    assert_close(got, ref, TOL[dtype], f"silu_rms_norm {backend} {dtype} C={C}", NAMES)
    assert (got[0][:, 2] == 0).all() and all(x.isfinite().all() for x in got)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    # schema, autograd registration and the fakes against each path's real outputs
    skip_without_interpreter(backend)

    gen = torch.Generator().manual_seed(2)
    o, w = norm_inputs(1, 6, 32, torch.float32, gen)
    o = torch.cat((o, o), -1)[..., 16:48]              # strided input: contiguous outputs, as the fakes
    o, w = o.detach().requires_grad_(True), w.detach().requires_grad_(True)
    settings = Settings().encode()
    opcheck(torch.ops.flame.silu_rms_norm.default, (o, w, EPS, backend, settings))
    dy = torch.randn(o.shape, generator=gen)
    opcheck(torch.ops.flame.silu_rms_norm_bwd.default, (o.detach(), w.detach(), dy, EPS, backend, settings))


def test_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(3)
    o, w = (x.requires_grad_(True) for x in norm_inputs(1, 7, 24, torch.float32, gen))

    def layer(o, w):
        return silu_rms_norm(o * 2, w).square().sum()

    eager = torch.autograd.grad(layer(o, w), (o, w))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for e, c in zip(eager, torch.autograd.grad(compiled(o, w), (o, w))):
        torch.testing.assert_close(c, e)


@pytest.mark.gpu
def test_gpu_model_shape_bf16():
    B, T, C = 2, 4096, 1280
    xs = [x.cuda() for x in norm_inputs(B, T, C, torch.bfloat16, torch.Generator().manual_seed(4))]
    got = outputs_and_grads(lambda *x: silu_rms_norm(*x, EPS), xs, seed=5)
    assert_close(got, reference(ref_norm, xs, 5, EPS), TOL[torch.bfloat16], "silu_rms_norm GPU bf16", NAMES)


def test_kernels_compile_for_h100_without_spills():
    # offline sm_90 builds of the launches at GSA 0.6B's shape (C = 1280, a 2048-channel tile) and at C = 2048
    skip_without_cuda_backend()
    found = in_compiling_process(
        "import json, torch\nfrom kernels import sm90\nfrom kernels.launch import record, distinct\n"
        "from kernels.silu_rms_norm.op import Settings, _fwd_triton, _bwd_triton\n"
        "out = {}\nfor C in (1280, 2048):\n"
        "    with record() as launches:\n"
        "        o = torch.empty(8, 4096, C, device='meta', dtype=torch.bfloat16)\n"
        "        w = torch.empty(C, device='meta')\n"
        "        _fwd_triton(o, w, 1e-5, Settings())\n        _bwd_triton(o, w, o, 1e-5, Settings())\n"
        "    for name, b in distinct(launches).items():\n"
        "        out[f'{name} C={C}'] = sm90.resources(sm90.build(b))\n"
        "print(json.dumps(out))")
    assert len(found) == 4, found
    for name, res in found.items():
        assert res["stack"] == 0, f"{name} spills: {res}"
