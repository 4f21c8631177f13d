"""tl_utils.exp (PTX ex2.approx.ftz on the GPU, tl.exp under the interpreter), which every decay factor of our Triton
kernels goes through, against torch.exp in fp64: within 1e-5 where the result is a normal fp32 number (the argument is
scaled by log2(e) in fp32 first, as tl.exp does: up to 2^-17 of an exponent below 128 in magnitude), 0 where it is below
2^-126 (flushed), never inf or NaN for the arguments the kernels give it (<= 0) nor for positive ones up to 80."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.tl_utils import exp

TINY = 2.0 ** -126   # the smallest normal fp32 number


@triton.jit
def _exp_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, exp(tl.load(x + i, mask=i < n, other=0.)), mask=i < n)


def exp_of(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _exp_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y


def check(x: torch.Tensor):
    y = exp_of(x).double().cpu()
    want = torch.exp(x.double().cpu())
    assert torch.isfinite(y).all()
    normal = want >= 2 * TINY
    rel = ((y - want).abs() / want)[normal]
    assert rel.max().item() < 1e-5, rel.max().item()
    flushed = want < TINY / 2
    assert (y[flushed] <= TINY).all()   # 0 on the GPU (flushed); the interpreter's tl.exp may keep a denormal


def arguments(device) -> torch.Tensor:
    """The log decays' range (-1e-6 .. -50, and their sums down to a chunk's -800), 0, both sides of fp32's denormal
    boundary (e^-87.3 = 2^-126), and positive arguments."""
    return torch.cat([-torch.logspace(-6, torch.log10(torch.tensor(800.)).item(), 3000), torch.zeros(1),
                      torch.linspace(-90, -85, 1001), torch.linspace(0, 80, 500)]).to(device)


def test_exp_matches_torch_interpreted():
    check(arguments("cpu"))


@pytest.mark.gpu
def test_gpu_exp_matches_torch_and_flushes_denormals():
    x = arguments("cuda")
    check(x)
    y = exp_of(x)
    assert (y[x < -88.] == 0).all()   # e^x < 2^-126.9: flushed, not a denormal
