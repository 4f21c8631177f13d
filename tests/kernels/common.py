"""Helpers both ops' kernel tests share: the error metric, stress log decays, the interpreter's Triton call."""

from __future__ import annotations

import math
import os

import pytest
import torch

CPU_TOL = 1e-5   # fp32 kernels and paths against the fp64 recurrence
GPU_TOL = 5e-3   # bf16 inputs on the GPU


def assert_close(got, ref, tol, what, names):
    """Each tensor within RMSE(x - ref) / RMS(ref) <= tol and finite; None where the reference has None."""
    for name, x, y in zip(names, got, ref):
        if y is None:
            assert x is None, f"{what} {name}: expected None"
            continue
        x, y = x.double().cpu(), y.double().cpu()
        assert torch.isfinite(x).all(), f"{what} {name}: non-finite values"
        err = ((x - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt().clamp_min(1e-30)).item()
        assert err <= tol, f"{what} {name}: RMSE/RMS = {err:.3e} > {tol:.0e}"


def log_decays(shape, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Per-step log decays (<= 0) beyond the model's range: "wide" 3e-4 .. 4.5 per step; "stress" -1e-6 (decay
    ~ 1) down to -50, mixed in every row and along time."""
    if kind == "wide":
        return -torch.exp(torch.empty(shape).uniform_(-8, 1.5, generator=gen))
    if kind == "stress":
        w = -torch.exp(torch.empty(shape).uniform_(math.log(1e-6), math.log(50.0), generator=gen))
        w[:, ::7] = -1e-6
        w[:, 3::11] = -50.0
        return w
    raise ValueError(kind)


def interpreted(chunk_fn):
    """chunk_fn with backend='triton' on CPU tensors: needs TRITON_INTERPRET=1 from before Triton's import
    (tests/conftest.py sets it on machines without CUDA); skips elsewhere."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines (TRITON_INTERPRET=1)")
    return lambda *a, **kw: chunk_fn(*a, backend="triton", **kw)
