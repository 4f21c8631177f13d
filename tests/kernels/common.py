"""Helpers the ops' kernel tests share: the error metric, stress log decays, the interpreter's Triton call, and the
test bodies RWKV-6 and RWKV-7 run alike (each op's test file passes its pieces as a ChunkOp)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

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
        assert torch.isfinite(x).all(), f"{what} {name}: non-finite values"
        err = rel_rmse(x, y)
        assert err <= tol, f"{what} {name}: RMSE/RMS = {err:.3e} > {tol:.0e}"


def rel_rmse(x, ref) -> float:
    """RMSE(x - ref) / RMS(ref), in fp64 on the CPU."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def opcheck(op, args) -> None:
    """torch.library.opcheck of a custom op's schema, autograd registration and fake against its real outputs. The AOT
    tracing check is left to each op's torch.compile test (opcheck's own takes about 10 s more)."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def log_decays(shape, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Per-step log decays (<= 0) beyond the model's range: "wide" 3e-4 .. 4.5 per step; "stress" -1e-6 (decay
    ~ 1) down to -50, mixed in every row and along time; "extreme" -50 .. -1, most near -50."""
    if kind == "wide":
        return -torch.exp(torch.empty(shape).uniform_(-8, 1.5, generator=gen))
    if kind == "extreme":   # near -50 (most steps within a few of it), a tail up to -1 so that some pairs of steps
        # still reach each other (at -50 throughout, every gradient through the decay is ~e^-50 of the terms that
        # cancel in it, and no fp32 kernel can give it to a relative error)
        return -50 + 49 * torch.rand(shape, generator=gen) ** 4
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


def run(fn, xs, h0, scale, cu_seqlens=None, seed=1, **kw):
    """(outputs, grads) of fn for a fixed random cotangent on o and on the final state."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, ht = fn(*xs, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device)
    dht = torch.randn(ht.shape, generator=gen).to(o.device)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    return [o.detach(), ht.detach()] + [x.grad for x in xs] + [None if h0 is None else h0.grad]


@dataclass(frozen=True)
class ChunkOp:
    """One chunked op's pieces, for the test bodies both RWKV ops share."""

    chunk: Callable
    """The op (Triton on CUDA tensors, the PyTorch path on CPU ones)."""
    torch_path: Callable
    """Its PyTorch chunked path, which takes compute_dtype."""
    naive_fn: Callable
    """Its token-by-token recurrence."""
    make_inputs: Callable
    """(B, T, H, K, V, *, device, dtype, decay, seed, n_seq) -> (inputs, initial states)."""
    names: tuple[str, ...]
    """Names of run()'s outputs and gradients, in its order."""

    def naive(self, xs, h0, scale, cu_seqlens=None):
        return run(self.naive_fn, xs, h0, scale, cu_seqlens)

    def fp64_chunked(self, xs, h0, scale, cu_seqlens=None):
        return run(lambda *a, **kw: self.torch_path(*a, compute_dtype=torch.float64, **kw), xs, h0, scale,
                   cu_seqlens)

    def gpu_ref(self, xs, h0, scale, cu=None):
        """fp64 naive recurrence on the GPU, or the fp64 chunked path past 4096 steps (checked against it on CPU)."""
        if xs[0].shape[1] <= 4096:
            return self.naive(xs, h0, scale, cu)
        return self.fp64_chunked(xs, h0, scale, cu)

    def assert_close(self, got, ref, tol, what=""):
        assert_close(got, ref, tol, what, self.names)


# ---------------------------------------------------------------- CPU test bodies


def torch_path_matches_naive(op: ChunkOp, B, T):
    xs, h0 = op.make_inputs(B, T, 2, 32, 32, decay="wide", seed=T)
    op.assert_close(run(op.torch_path, xs, h0, 0.5), op.naive(xs, h0, 0.5), CPU_TOL, f"T={T}")


def torch_path_varlen(op: ChunkOp):
    cu = torch.tensor([0, 5, 37, 38, 100])
    xs, h0 = op.make_inputs(1, 100, 2, 32, 16, decay="wide", n_seq=4, seed=3)
    op.assert_close(run(op.torch_path, xs, h0, 1.0, cu), op.naive(xs, h0, 1.0, cu), CPU_TOL, "varlen")


def torch_path_stress_decays_t4096(op: ChunkOp, K):
    # Log decays from -1e-6 to -50 mixed in one sequence: a factorized exp(g_t) * exp(-g_s) would overflow here.
    xs, h0 = op.make_inputs(1, 4096, 1, K, K, decay="stress", seed=4)
    got = run(op.torch_path, xs, h0, 1.0)
    with torch.no_grad():
        o_ref, ht_ref = op.naive_fn(*xs, scale=1.0, initial_state=h0, output_final_state=True)
    op.assert_close(got[:2], [o_ref, ht_ref], CPU_TOL, "stress fwd vs naive")
    # Gradients: the fp64 chunked path (checked against the naive recurrence above) is the reference at this
    # length; autograd through 4096 naive steps would take a minute of CI.
    op.assert_close(got, op.fp64_chunked(xs, h0, 1.0), CPU_TOL, "stress bwd")


def interpreter_bf16_products(op: ChunkOp, interp, settings_type, decay):
    """bf16 inputs take bf16 products in the per-chunk kernels (Settings.bf16_products); the interpreter rounds
    their operands and the bf16 stores as the GPU does (tl_utils.round_bf16, cast_for) and multiplies exactly, so
    the GPU path's bf16 error shows on the CPU: within the bf16 bar of the fp64 recurrence on the same (bf16) inputs,
    and visibly apart from the same kernel with fp32-operand products (so the bf16 ones did run)."""
    xs, h0 = op.make_inputs(1, 100, 1, 64, 64, dtype=torch.bfloat16, decay=decay, seed=21)
    ref = op.naive([x.double() for x in xs], h0.double(), 1.0)
    got = run(interp, xs, h0, 1.0)
    op.assert_close(got, ref, GPU_TOL, f"bf16 products, {decay} decays")
    fp32_products = run(interp, xs, h0, 1.0, settings=settings_type(bf16_products=False))
    assert max(rel_rmse(g, f) for g, f in zip(got, fp32_products)) > 1e-3


def interpreter_initial_state_kv_pairs(op: ChunkOp, interp, K, V):
    xs, h0 = op.make_inputs(1, 20, 1, K, V, seed=K + V)
    op.assert_close(run(interp, xs, h0, 1.0), op.naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V}")


# ---------------------------------------------------------------- GPU test bodies: the Triton kernel in bf16

GPU_SHAPES = [
    (2, 1, 4, 64, 64), (2, 15, 4, 64, 64), (2, 64, 4, 64, 64), (2, 100, 4, 64, 64), (2, 1000, 4, 64, 64),
    (2, 4096, 4, 64, 64), (1, 16384, 2, 64, 64), (2, 500, 2, 32, 32), (2, 500, 2, 128, 128),
    (2, 300, 2, 64, 128), (2, 300, 2, 128, 64)]
"""(B, T, H, K, V) of the bf16 sweep: short and long, one sequence past 4096 steps, K != V both ways."""


def settings_id(fields: dict) -> str:
    """Pytest id of a Settings-fields parameter: "chunk=16", "blocked_scan=True,block_chunks=4"."""
    return ",".join(f"{k}={v}" for k, v in fields.items())


def gpu_bf16_matches_naive(op: ChunkOp, B, T, H, K, V):
    xs, h0 = op.make_inputs(B, T, H, K, V, device="cuda", dtype=torch.bfloat16, seed=T + K)
    got = run(op.chunk, xs, h0, K ** -0.5)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32 and got[-1].dtype == torch.float32
    op.assert_close(got, op.gpu_ref(xs, h0, K ** -0.5), GPU_TOL, f"{B=} {T=} {H=} {K=} {V=}")


def gpu_varlen_many_sequences(op: ChunkOp):
    lens = [1, 15, 16, 17, 64, 100, 333, 1000, 7]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = op.make_inputs(1, sum(lens), 4, 64, 64, device="cuda", dtype=torch.bfloat16, n_seq=len(lens), seed=7)
    op.assert_close(run(op.chunk, xs, h0, 1.0, cu), op.naive(xs, h0, 1.0, cu), GPU_TOL, "varlen")


def gpu_initial_state_kv_pairs(op: ChunkOp, K, V):
    xs, h0 = op.make_inputs(1, 150, 2, K, V, device="cuda", dtype=torch.bfloat16, seed=K * V)
    op.assert_close(run(op.chunk, xs, h0, 1.0), op.naive(xs, h0, 1.0), GPU_TOL, f"{K=} {V=}")


def gpu_stress_decays_t4096(op: ChunkOp, dtype, seed, **kw):
    """Log decays -1e-6 .. -50 over 4096 steps with initial states; kw (settings) go to the op."""
    xs, h0 = op.make_inputs(1, 4096, 2, 64, 64, device="cuda", dtype=dtype, decay="stress", seed=seed)
    op.assert_close(run(op.chunk, xs, h0, 1.0, **kw), op.naive(xs, h0, 1.0), GPU_TOL, f"stress {dtype} {kw}")


def gpu_varlen_k_ne_v(op: ChunkOp, dtype, **kw):
    """Packed sequences (one token to 300) with K != V; kw (settings) go to the op."""
    lens = [1, 17, 300, 64, 90]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = op.make_inputs(1, sum(lens), 2, 32, 128, device="cuda", dtype=dtype, n_seq=len(lens), seed=11)
    op.assert_close(run(op.chunk, xs, h0, 1.0, cu, **kw), op.naive(xs, h0, 1.0, cu), GPU_TOL,
                    f"varlen K != V {dtype} {kw}")


def gpu_matches_cpu_torch_path(op: ChunkOp):
    xs, h0 = op.make_inputs(2, 300, 2, 64, 64, device="cuda", dtype=torch.float32, decay="wide", seed=9)
    got = run(op.chunk, xs, h0, 1.0)
    cpu = run(op.torch_path, [x.cpu() for x in xs], h0.cpu(), 1.0)
    op.assert_close(got, cpu, GPU_TOL, "gpu (tf32 products) vs cpu path")
