"""What the tests of the fused elementwise ops (rwkv7_key, rwkv7_out, silu_rms_norm) share: outputs and every
gradient for fixed random cotangents, the same from an fp64 reference, and the skip of the Triton backend on CPU
without the interpreter."""

from __future__ import annotations

import os

import pytest
import torch


def outputs_and_grads(fn, xs, seed):
    """fn's outputs and the gradients of every input for fixed random cotangents (rounded to each output's dtype)."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, xs, cots)
    return [o.detach() for o in outs] + list(grads)


def reference(ref_fn, xs, seed, *args):
    """ref_fn in fp64 on the same (rounded) inputs, cotangents as outputs_and_grads draws them, rounded as the op's
    outputs are (each output's dtype follows k or g, i.e. xs[0] or xs[-1])."""
    dtype = xs[0].dtype
    xs64 = [x.double().requires_grad_(True) for x in xs]
    outs = ref_fn(*xs64, *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen).to(o.device, dtype).double() for o in outs]
    grads = torch.autograd.grad(outs, xs64, cots)
    return [o.detach() for o in outs] + list(grads)


def skip_without_interpreter(backend):
    if backend == "triton" and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    if backend == "triton":
        pytest.importorskip("triton")
