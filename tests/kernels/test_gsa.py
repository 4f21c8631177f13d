"""GSA chunked kernels against the fp64 token-by-token recurrence.

CPU: the PyTorch chunked path, and the Triton kernel under TRITON_INTERPRET=1 (fp32; small shapes, the interpreter is
slow). GPU (`-m gpu`): the Triton kernel in bf16 over the broad shape sweep. Metric: RMSE(x - ref) / RMS(ref) for the
output, both final states and the gradients of q, k, v, s, g and both initial states.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gsa import chunk_gsa, naive_gsa
from kernels.gsa.chunk import Settings
from kernels.gsa.torch_chunk import chunk_gsa_torch
from tests.kernels import common
from tests.kernels.common import CPU_TOL, GPU_TOL
from tests.kernels.inputs import gsa_inputs

NAMES = ("o", "hk", "hv", "dq", "dk", "dv", "ds", "dg", "dhk0", "dhv0")


def run(fn, xs, h0, scale, cu_seqlens=None, seed=1, final=True, final_used=(True, True), **kw):
    """(outputs, grads) of fn for a fixed random cotangent on o and on the final states (those in final_used)."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    h0 = None if h0 is None else tuple(x.detach().clone().requires_grad_(True) for x in h0)
    o, ht = fn(*xs, scale=scale, initial_state=h0, output_final_state=final, cu_seqlens=cu_seqlens, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device)
    loss = (o.double() * do.double()).sum()
    if final:
        for h, used in zip(ht, final_used):
            cot = torch.randn(h.shape, generator=gen).to(o.device).double()
            if used:
                loss = loss + (h.double() * cot).sum()
    loss.backward()
    hs = [h.detach() for h in ht] if final else [None, None]
    grads = [x.grad for x in xs] + ([None, None] if h0 is None else [h.grad for h in h0])
    return [o.detach()] + hs + grads


def naive(xs, h0, scale, cu_seqlens=None, final=True):
    return run(naive_gsa, xs, h0, scale, cu_seqlens, final=final)


def assert_close(got, ref, tol, what="", names=NAMES):
    common.assert_close(got, ref, tol, what, names)


@pytest.fixture
def interp():
    return common.interpreted(chunk_gsa)


def test_naive_fp64_matches_the_definition_step_by_step():
    # Three steps of the recurrence written out by hand, one head: guards the reference itself.
    xs, (hk0, hv0) = gsa_inputs(1, 3, 1, 4, 3, 5, decay="wide", seed=11)
    q, k, v, s, g = (x[0, :, 0].double() for x in xs)
    hk, hv = hk0[0, 0].double(), hv0[0, 0].double()
    outs = []
    for t in range(3):
        hk = hk @ torch.diag(g[t].exp()) + torch.outer(k[t], s[t])
        p = torch.softmax(0.7 * q[t] @ hk, dim=0)
        hv = torch.diag(g[t].exp()) @ hv + torch.outer(s[t], v[t])
        outs.append(hv.t() @ p)
    o, (hk_n, hv_n) = naive_gsa(*xs, scale=0.7, initial_state=(hk0, hv0), output_final_state=True)
    torch.testing.assert_close(o[0, :, 0], torch.stack(outs), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hk_n[0, 0], hk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hv_n[0, 0], hv, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- CPU: PyTorch chunked path


@pytest.mark.parametrize("B,T", [(2, 1), (2, 15), (2, 64), (2, 100), (1, 1000)])
def test_torch_path_matches_naive(B, T):
    xs, h0 = gsa_inputs(B, T, 2, 32, 32, 16, decay="wide", seed=T)
    assert_close(run(chunk_gsa_torch, xs, h0, 0.5), naive(xs, h0, 0.5), CPU_TOL, f"T={T}")


def test_torch_path_odd_sizes_default_scale():
    xs, h0 = gsa_inputs(1, 45, 2, 20, 12, 24, seed=2)
    assert_close(run(chunk_gsa_torch, xs, h0, None), naive(xs, h0, None), CPU_TOL, "odd sizes")


def test_torch_path_is_the_cpu_default():
    xs, h0 = gsa_inputs(1, 20, 1, 16, 16, 16)
    o, ht = chunk_gsa(*xs, initial_state=h0, output_final_state=True)
    o2, ht2 = chunk_gsa_torch(*xs, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht[0], ht2[0]) and torch.equal(ht[1], ht2[1])


def test_torch_path_varlen():
    cu = torch.tensor([0, 5, 37, 38, 100])
    xs, h0 = gsa_inputs(1, 100, 2, 32, 16, 16, decay="wide", n_seq=4, seed=3)
    assert_close(run(chunk_gsa_torch, xs, h0, 1.0, cu), naive(xs, h0, 1.0, cu), CPU_TOL, "varlen")


def test_torch_path_stress_decays_t4096():
    # Log gates from -1e-6 to -50 mixed in one sequence: a factorized exp(G_t) * exp(-G_s) would overflow here.
    xs, h0 = gsa_inputs(1, 4096, 1, 16, 16, 16, decay="stress", seed=4)
    got = run(chunk_gsa_torch, xs, h0, 1.0)
    with torch.no_grad():
        o_ref, (hk_ref, hv_ref) = naive_gsa(*xs, scale=1.0, initial_state=h0, output_final_state=True)
    assert_close(got[:3], [o_ref, hk_ref, hv_ref], CPU_TOL, "stress fwd vs naive")
    # Gradients: the fp64 chunked path (checked against the naive recurrence above) is the reference at this
    # length; autograd through 4096 naive steps would take a minute of CI.
    ref = run(lambda *a, **kw: chunk_gsa_torch(*a, compute_dtype=torch.float64, **kw), xs, h0, 1.0)
    assert_close(got, ref, CPU_TOL, "stress bwd")


# ---------------------------------------------------------------- CPU: Triton kernel under the interpreter


@pytest.mark.parametrize("B,T", [(1, 1), (2, 15), (1, 64), (1, 100)])
def test_triton_interpreter_matches_naive(B, T, interp):
    xs, h0 = gsa_inputs(B, T, 2, 32, 32, 16, decay="wide", seed=T)
    assert_close(run(interp, xs, h0, 0.5), naive(xs, h0, 0.5), CPU_TOL, f"T={T}")


def test_triton_interpreter_varlen_no_states(interp):
    # no initial state and no final state: the backward runs without dht and stores no dh0
    cu = torch.tensor([0, 5, 37, 38, 100])
    xs, _ = gsa_inputs(1, 100, 2, 32, 32, 16, decay="model", n_seq=4, seed=5)
    assert_close(run(interp, xs, None, 1.0, cu, final=False), naive(xs, None, 1.0, cu, final=False), CPU_TOL,
                 "varlen")


def test_triton_interpreter_final_state_without_initial_state(interp):
    xs, _ = gsa_inputs(2, 40, 1, 16, 32, 16, decay="wide", seed=12)
    assert_close(run(interp, xs, None, 1.0), naive(xs, None, 1.0), CPU_TOL, "no h0, final states")


@pytest.mark.parametrize("final_used", [(True, False), (False, True)])
def test_triton_interpreter_one_final_state_in_the_loss(final_used, interp):
    # autograd hands the backward None for the unused final state's gradient; both states scan in one launch
    xs, h0 = gsa_inputs(2, 40, 1, 16, 32, 16, decay="wide", seed=13)
    assert_close(run(interp, xs, h0, 1.0, final_used=final_used),
                 run(naive_gsa, xs, h0, 1.0, final_used=final_used), CPU_TOL, f"final states used: {final_used}")


def test_triton_interpreter_varlen_computes_no_invalid_value(interp):
    # A packed batch launches an upper bound of chunks (kernels.utils.chunk_tables); the spare programs return at
    # once instead of computing on unwritten state memory: no overflow or NaN anywhere, masked or not.
    import numpy as np

    lens = [1, 17, 30, 64, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    xs, h0 = gsa_inputs(1, sum(lens), 1, 32, 64, 32, n_seq=len(lens), seed=12)
    with np.errstate(all="raise"):
        got = run(interp, xs, h0, 1.0, cu)
    assert_close(got, naive(xs, h0, 1.0, cu), CPU_TOL, "varlen")


def test_triton_interpreter_varlen_initial_state(interp):
    cu = torch.tensor([0, 33, 40, 90])
    xs, h0 = gsa_inputs(1, 90, 1, 16, 32, 32, decay="wide", n_seq=3, seed=6)
    assert_close(run(interp, xs, h0, 1.0, cu), naive(xs, h0, 1.0, cu), CPU_TOL, "varlen h0")


@pytest.mark.parametrize("K,V,M", [(20, 12, 24), (72, 40, 100)])
def test_triton_interpreter_odd_sizes_default_scale(K, V, M, interp):
    # K, V, M between the power-of-two tiles (and M above 64, one slot tile): padded slots stay out of the softmax
    xs, h0 = gsa_inputs(1, 45, 2, K, V, M, seed=2)
    assert_close(run(interp, xs, h0, None), naive(xs, h0, None), CPU_TOL, "odd sizes")


@pytest.mark.parametrize("K,V", [(32, 32), (32, 128), (128, 32), (128, 128)])
@pytest.mark.parametrize("M", [16, 64, 128])
def test_triton_interpreter_initial_state_kvm(K, V, M, interp):
    xs, h0 = gsa_inputs(1, 20, 1, K, V, M, seed=K + V + M)
    assert_close(run(interp, xs, h0, None), naive(xs, h0, None), CPU_TOL, f"K={K} V={V} M={M}")


@pytest.mark.parametrize("chunk,bd", [(16, 16), (32, 64), (32, 16)])
def test_triton_interpreter_block_sizes(chunk, bd, interp):
    # chunk sizes change the number of pairwise levels; D tiles smaller than K or V split the state scans
    xs, h0 = gsa_inputs(1, 80, 1, 32, 128, 32, decay="wide", seed=chunk + bd)
    assert_close(run(interp, xs, h0, 1.0, settings=Settings(chunk=chunk, scan_bd=bd)), naive(xs, h0, 1.0), CPU_TOL,
                 f"chunk={chunk} BD={bd}")


def test_triton_interpreter_stress_decays(interp):
    xs, h0 = gsa_inputs(1, 200, 1, 32, 32, 32, decay="stress", seed=7)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, "stress")


def test_triton_kernel_under_torch_compile(interp):
    # the models compile their blocks: the kernel call is the custom op flame::chunk_gsa, same output and gradients
    from tests.helpers import assert_compiled_matches_eager

    def f(q, k, v, s, g):
        return (interp(q * 2, k, v, s, g, scale=0.5)[0] * 3).sum()

    xs, _ = gsa_inputs(1, 20, 1, 16, 16, 16, decay="wide", seed=1)
    assert_compiled_matches_eager(f, [x.requires_grad_(True) for x in xs])


def test_triton_interpreter_packed_stress_decays(interp):
    # g slot-major by chunk (the per-chunk kernels' copy, padded past short last chunks) and the backward's
    # pairwise-decay work apart (A1, A2 kept by _fwd_out, D2 by _bwd_dz): packed sequences with short last chunks,
    # stress decays, initial states
    cu = torch.tensor([0, 5, 45, 64])
    xs, h0 = gsa_inputs(1, 64, 2, 32, 32, 32, decay="stress", n_seq=3, seed=15)
    assert_close(run(interp, xs, h0, 1.0, cu), run(naive_gsa, xs, h0, 1.0, cu), CPU_TOL, "packed stress")


@pytest.mark.parametrize("case", ["stress", "varlen, one final state", "D tiles", "bf16"])
def test_triton_interpreter_stateless_forward(case, interp):
    # the forward that stores no chunk state (chosen for many sequence-heads, forced here): the key scan alone forms
    # the slot logits' parts, the value scan forms the output
    settings = Settings(stateless_forward=True)
    cu, final_used, K, V, dtype = None, (True, True), 32, 32, torch.float32
    if case == "varlen, one final state":
        cu, final_used = torch.tensor([0, 33, 40, 90]), (False, True)
    if case == "D tiles":   # several parts of the logits, several output tiles
        settings = Settings(stateless_forward=True, key_scan_bd=16, out_scan_bd=16)
        K, V = 48, 64
    if case == "bf16":
        dtype, cu = torch.bfloat16, torch.tensor([0, 33, 40, 90])
    xs, h0 = gsa_inputs(1, 200 if case == "stress" else 90, 1, K, V, 32, dtype=dtype,
                         decay="stress" if case == "stress" else "wide", n_seq=3 if cu is not None else None, seed=16)
    got = run(interp, xs, h0, 1.0, cu, final_used=final_used, settings=settings)
    if dtype == torch.bfloat16:   # the final states keep fp32 accuracy; the rest meets the bf16 bar
        ref = run(naive_gsa, [x.double() for x in xs], tuple(h.double() for h in h0), 1.0, cu)
        assert_close(got[1:3], ref[1:3], CPU_TOL, "final states, bf16", names=NAMES[1:3])
        assert_close(got, ref, GPU_TOL, "bf16")
    else:
        assert_close(got, run(naive_gsa, xs, h0, 1.0, cu, final_used=final_used), CPU_TOL, case)


def test_triton_interpreter_bf16_split_scans(interp):
    # bf16 inputs: the scans' weights travel as bf16 halves hi + lo (fp32 inputs, every other interpreter test, take
    # one tf32 product). The final states come from the forward scan alone (decayed weights and bf16 k, v): they
    # must keep fp32 accuracy; a plain bf16 rounding of the weights is ~3e-3 off (dropping lo). Everything else is
    # bf16 and meets the bf16 bar. Stored-state forward here (few sequence-heads).
    cu = torch.tensor([0, 33, 40, 100])
    xs, h0 = gsa_inputs(1, 100, 1, 32, 32, 32, dtype=torch.bfloat16, decay="wide", n_seq=3, seed=14)
    got = run(interp, xs, h0, 1.0, cu)
    ref = run(naive_gsa, [x.double() for x in xs], tuple(h.double() for h in h0), 1.0, cu)
    assert_close(got[1:3], ref[1:3], CPU_TOL, "final states, bf16", names=NAMES[1:3])
    assert_close(got, ref, GPU_TOL, "bf16")


def test_triton_interpreter_bf16_products_stress(interp):
    # bf16 inputs take bf16 products where the kernel allows them; the interpreter rounds their operands as the GPU
    # does (tl_utils.round_bf16) and multiplies exactly, so their error shows on CPU: within the bf16 bar under the
    # stress gates (and visibly apart from the same kernel's fp32-operand products, so they did run)
    xs, h0 = gsa_inputs(1, 200, 1, 64, 64, 64, dtype=torch.bfloat16, decay="stress", seed=17)
    ref = run(naive_gsa, [x.double() for x in xs], tuple(h.double() for h in h0), 1.0)
    got = run(interp, xs, h0, 1.0)
    assert_close(got, ref, GPU_TOL, "bf16 products, stress")
    fp32_products = run(interp, xs, h0, 1.0, settings=Settings(bf16_products=False))
    assert max(common.rel_rmse(g, f) for g, f in zip(got, fp32_products) if f is not None) > 1e-3


@pytest.mark.parametrize("K,V,M", [(64, 64, 512), (64, 64, 0), (0, 64, 64)])
def test_unsupported_head_sizes_refused_in_one_line(K, V, M):
    # before anything launches (meta tensors: no kernel could run), one line naming the sizes and what is supported
    xs = [torch.empty(1, 8, 1, D, device="meta") for D in (K, K, V, M, M)]
    with pytest.raises(ValueError, match=rf"^chunk_gsa: head size K={K}, V={V}, M={M} is not supported .*any K >= 1, "
                                         r"any V >= 1, M from 1 to 256\)[^\n]*$"):
        chunk_gsa(*xs, scale=1.0, backend="triton")


def test_triton_interpreter_bf16_gate_gradient_extreme_decays(interp):
    # log gates near -50, no initial state: dg is what is left where each pair's decay enters row t (+G_t, through
    # the logits and p) and row s (-G_s, through ds) and cancels. ds's within-chunk levels take fp32 operands as the
    # logits' do: with bf16 ones (the interpreter rounds them as the GPU does) dg was 9.9e-3 off fp64 here, 1.8e-3 now
    xs, _ = gsa_inputs(1, 64, 1, 32, 64, 64, dtype=torch.bfloat16, decay="extreme", seed=96)
    ref = run(naive_gsa, [x.double() for x in xs], None, 1.0)
    got = run(interp, xs, None, 1.0)
    assert_close(got, ref, GPU_TOL, "bf16, extreme gates")
    assert common.rel_rmse(got[NAMES.index("dg")], ref[NAMES.index("dg")]) < 3e-3


@pytest.mark.parametrize("v_scale", [1.0, 1e-30, 1e30])
def test_triton_interpreter_fp16_states(v_scale, interp):
    # bf16 data: the chunk states between kernels travel as fp16 with a power of two per slot row and D tile
    # (scan_bd 32 here spans the readers' tiles, so the scaled path runs; both forward regimes store or read
    # states: the stored-state forward here, the backward's rescan and reverse scan). Values of any range keep
    # their 11 significant bits: v at 1e-30 (fp16 would flush the value states to 0) and 1e30 (fp16 would overflow)
    # meet the bf16 bar as at 1, and against the same kernel with fp32 states the errors are the same size.
    xs, h0 = gsa_inputs(1, 100, 1, 32, 32, 32, dtype=torch.bfloat16, decay="wide", seed=18)
    xs[2], h0 = (xs[2] * v_scale).to(torch.bfloat16), (h0[0], h0[1] * v_scale)
    ref = run(naive_gsa, [x.double() for x in xs], tuple(h.double() for h in h0), 1.0)
    settings = dict(scan_bd=32, stateless_forward=False)
    got = run(interp, xs, h0, 1.0, settings=Settings(**settings))
    assert_close(got, ref, GPU_TOL, f"fp16 states, v x {v_scale}")
    if v_scale == 1.0:
        fp32 = run(interp, xs, h0, 1.0, settings=Settings(fp16_states=False, **settings))
        for name, g, f, r in zip(NAMES, got, fp32, ref):
            assert common.rel_rmse(g, r) <= 1.2 * common.rel_rmse(f, r) + 1e-4, name
        assert max(common.rel_rmse(g, f) for g, f in zip(got, fp32)) > 0   # the two formats did differ


# ---------------------------------------------------------------- GPU: the Triton kernel in bf16

gpu = pytest.mark.gpu
EXTREME_TOL = 1e-2   # bf16 on the GPU under log gates near -50, every gradient (the gate's is the largest)


def gpu_ref(xs, h0, scale, cu=None):
    """fp64 naive recurrence on the GPU, or the fp64 chunked path past 4096 steps (checked against it on CPU)."""
    if xs[0].shape[1] <= 4096:
        return naive(xs, h0, scale, cu)
    return run(lambda *a, **kw: chunk_gsa_torch(*a, compute_dtype=torch.float64, **kw), xs, h0, scale, cu)


@gpu
@pytest.mark.parametrize("B,T,H,K,V,M", [
    (2, 1, 4, 64, 64, 64), (2, 15, 4, 64, 64, 64), (2, 64, 4, 64, 64, 64), (2, 100, 4, 64, 64, 64),
    (2, 1000, 4, 64, 64, 64), (2, 4096, 2, 64, 64, 64), (1, 4096, 2, 256, 256, 64), (1, 16384, 2, 64, 64, 64)])
def test_gpu_bf16_matches_naive(B, T, H, K, V, M):
    xs, h0 = gsa_inputs(B, T, H, K, V, M, device="cuda", dtype=torch.bfloat16, seed=T + K)
    got = run(chunk_gsa, xs, h0, None)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32 and got[-1].dtype == torch.float32
    assert_close(got, gpu_ref(xs, h0, K ** -0.5), GPU_TOL, f"{B=} {T=} {H=} {K=} {V=} {M=}")


@gpu
@pytest.mark.parametrize("K,V,M", [   # every K x V pair once, each M three times (a cold compile per triple)
    (64, 64, 32), (64, 128, 64), (64, 256, 128), (128, 64, 128), (128, 128, 32), (128, 256, 64),
    (256, 64, 64), (256, 128, 128), (256, 256, 32)])
def test_gpu_initial_state_kvm(K, V, M):
    xs, h0 = gsa_inputs(1, 300, 2, K, V, M, device="cuda", dtype=torch.bfloat16, seed=K * V + M)
    assert_close(run(chunk_gsa, xs, h0, None), naive(xs, h0, None), GPU_TOL, f"{K=} {V=} {M=}")


@gpu
@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("bd", [16, 32, 64])
def test_gpu_block_sizes(chunk, bd):
    xs, h0 = gsa_inputs(1, 300, 2, 128, 64, 64, device="cuda", dtype=torch.bfloat16, seed=chunk + bd)
    assert_close(run(chunk_gsa, xs, h0, None, settings=Settings(chunk=chunk, scan_bd=bd)), naive(xs, h0, None),
                 GPU_TOL, f"{chunk=} {bd=}")


@gpu
def test_gpu_varlen_many_sequences():
    lens = [1, 15, 16, 17, 64, 100, 333, 1000, 7]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = gsa_inputs(1, sum(lens), 4, 64, 64, 64, device="cuda", dtype=torch.bfloat16, n_seq=len(lens), seed=8)
    assert_close(run(chunk_gsa, xs, h0, None, cu), naive(xs, h0, None, cu), GPU_TOL, "varlen")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_stress_decays_t4096(dtype):
    xs, h0 = gsa_inputs(1, 4096, 2, 64, 64, 64, device="cuda", dtype=dtype, decay="stress", seed=9)
    assert_close(run(chunk_gsa, xs, h0, None), naive(xs, h0, None), GPU_TOL, f"stress {dtype}")


@gpu
@pytest.mark.parametrize("T", [64, 100, 257, 1000])
@pytest.mark.parametrize("K", [32, 64])
def test_gpu_extreme_decays_no_initial_state(T, K):
    # log gates near -50: the gate's gradient is what is left of terms that cancel (every pair's decay reaches row t
    # with +G_t and row s with -G_s), so it is the first to show products that round the two sides apart
    xs, _ = gsa_inputs(2, T, 2, K, 64, 64, device="cuda", dtype=torch.bfloat16, decay="extreme", seed=T + K)
    assert_close(run(chunk_gsa, xs, None, 1.0), naive(xs, None, 1.0), EXTREME_TOL, f"extreme {T=} {K=}")


@gpu
def test_gpu_matches_cpu_torch_path():
    xs, h0 = gsa_inputs(2, 300, 2, 64, 64, 32, device="cuda", dtype=torch.float32, decay="wide", seed=10)
    got = run(chunk_gsa, xs, h0, None)
    cpu = run(chunk_gsa_torch, [x.cpu() for x in xs], tuple(h.cpu() for h in h0), None)
    assert_close(got, cpu, GPU_TOL, "gpu (tf32 products) vs cpu path")


# Both forward regimes, other scan tiles and fp32-operand products, in bf16 on the GPU.
# scan_bd=64 spans the readers' 64-wide tiles: fp16 states (Settings.fp16_states), in both forward regimes.
VARIANTS = [dict(stateless_forward=True), dict(stateless_forward=False), dict(scan_bd=16), dict(scan_bd=64),
            dict(scan_bd=64, stateless_forward=False), dict(scan_bd=64, fp16_states=False),
            dict(stateless_forward=True, key_scan_bd=32, out_scan_bd=32), dict(bf16_products=False)]


@gpu
@pytest.mark.parametrize("fields", VARIANTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_gpu_settings_match_naive(fields):
    settings = Settings(**fields)
    xs, h0 = gsa_inputs(1, 4096, 2, 64, 64, 64, device="cuda", dtype=torch.bfloat16, decay="stress", seed=11)
    assert_close(run(chunk_gsa, xs, h0, 1.0, settings=settings), naive(xs, h0, 1.0), GPU_TOL, f"stress {fields}")
    lens = [1, 17, 300, 64, 90]
    cu = torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = gsa_inputs(1, sum(lens), 2, 64, 128, 32, device="cuda", dtype=torch.bfloat16, n_seq=len(lens), seed=12)
    assert_close(run(chunk_gsa, xs, h0, 1.0, cu, final_used=(False, True), settings=settings),
                 run(naive_gsa, xs, h0, 1.0, cu, final_used=(False, True)), GPU_TOL, f"varlen {fields}")
