"""RWKV-7 chunked kernels against the fp64 token-by-token recurrence.

CPU: the PyTorch chunked path, and the Triton kernel under TRITON_INTERPRET=1 (fp32; small shapes, the interpreter is
slow). GPU (`-m gpu`): the Triton kernel in bf16 over the broad shape sweep. Metric: RMSE(x - ref) / RMS(ref).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.rwkv7 import chunk_rwkv7, chunk_rwkv7_torch, naive_rwkv7
from kernels.rwkv7.chunk import Settings
from kernels.rwkv7.decay import log_decay
from tests.kernels import common
from tests.kernels.common import CPU_TOL, GPU_TOL, run
from tests.kernels.inputs import rwkv7_inputs, rwkv7_logit_inputs

NAMES = ("o", "ht", "dr", "dw", "dk", "dv", "da", "db", "dh0")


OP = common.ChunkOp(chunk_rwkv7, chunk_rwkv7_torch, naive_rwkv7, rwkv7_inputs, NAMES)
naive, assert_close = OP.naive, OP.assert_close


@pytest.fixture
def interp():
    return common.interpreted(chunk_rwkv7)


# ---------------------------------------------------------------- CPU: PyTorch chunked path


@pytest.mark.parametrize("B,T", [(2, 1), (2, 15), (2, 64), (2, 100), (1, 1000)])
def test_torch_path_matches_naive(B, T):
    common.torch_path_matches_naive(OP, B, T)


def test_torch_path_is_the_cpu_default():
    xs, h0 = rwkv7_inputs(1, 20, 1, 16, 16)
    o, ht = chunk_rwkv7(*xs, initial_state=h0, output_final_state=True)
    o2, ht2 = chunk_rwkv7_torch(*xs, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_torch_path_varlen():
    common.torch_path_varlen(OP)


def test_torch_path_stress_decays_t4096():
    common.torch_path_stress_decays_t4096(OP, K=32)


# ---------------------------------------------------------------- CPU: Triton kernel under the interpreter


@pytest.mark.parametrize("B,T", [(1, 1), (2, 15), (1, 64), (1, 100)])
def test_triton_interpreter_matches_naive(B, T, interp):
    xs, h0 = rwkv7_inputs(B, T, 2, 32, 32, decay="wide", seed=T)
    assert_close(run(interp, xs, h0, 0.5), naive(xs, h0, 0.5), CPU_TOL, f"T={T}")


def test_triton_interpreter_varlen_no_initial_state(interp):
    cu = torch.tensor([0, 5, 37, 38, 100])
    xs, _ = rwkv7_inputs(1, 100, 2, 32, 32, decay="wide", n_seq=4, seed=5)
    assert_close(run(interp, xs, None, 1.0, cu), naive(xs, None, 1.0, cu), CPU_TOL, "varlen")


@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("V", [32, 64, 128])
def test_triton_interpreter_initial_state_kv_pairs(K, V, interp):
    common.interpreter_initial_state_kv_pairs(OP, interp, K, V)


@pytest.mark.parametrize("K,V", [(32, 128), (128, 32)])
@pytest.mark.parametrize("bv", [16, 64])
def test_triton_interpreter_initial_state_block_sizes(K, V, bv, interp):
    xs, h0 = rwkv7_inputs(1, 20, 1, K, V, seed=bv)
    got = run(interp, xs, h0, 1.0, settings=Settings(scan_bv=bv))
    assert_close(got, naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V} BV={bv}")


@pytest.mark.parametrize("K,V,decay,T,lens", [
    (32, 32, "stress", 120, None), (32, 128, "wide", 100, None), (128, 32, "model", 70, None),
    (32, 64, "wide", None, [1, 17, 40, 9, 66])])
@pytest.mark.parametrize("scan", ["sequence", "blocked", "blocked of 2", "blocked of 4"])
def test_triton_interpreter_sequence_and_blocked_scans(scan, K, V, decay, T, lens, interp):
    # The same results whether the scans walk every chunk of a sequence in order or run blocked (per-block maps,
    # one product per block in order, then the per-block fill): T not a multiple of a block, a short last block,
    # packed sequences shorter than a chunk or a block (spare block programs), K != V both ways (two M tiles).
    # One head (the interpreter's time goes with the programs), two in the stress case: every scan crosses heads.
    settings = Settings(blocked_scan=scan != "sequence")
    if scan.startswith("blocked of"):
        settings = Settings(blocked_scan=True, block_chunks=int(scan.split()[-1]))
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0)
    T = T or sum(lens)
    H = 2 if decay == "stress" else 1
    xs, h0 = rwkv7_inputs(1, T, H, K, V, decay=decay, n_seq=1 if lens is None else len(lens), seed=K + T)
    got = run(interp, xs, h0, 0.7, cu, settings=settings)
    assert_close(got, naive(xs, h0, 0.7, cu), CPU_TOL, f"{scan} K={K} V={V} lens={lens}")


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("dh_chunks", [2, 6])
def test_triton_interpreter_backward_in_groups_of_chunks(blocked, dh_chunks, interp):
    # The backward over equal rows holding the chunk-end state gradients for a few chunks at a time, the scan and
    # the per-chunk gradients in turn: 2 rows of 7 chunks, sequence scans in segments of 1 or 3 chunks of each row
    # (3, 3 and a short first one), blocked scans (blocks of 2 chunks, the last of a row short) in runs of 1 or 3
    # blocks (runs crossing from one row to the next).
    settings = Settings(blocked_scan=blocked, block_chunks=2, bwd_dh_chunks=dh_chunks)
    xs, h0 = rwkv7_inputs(2, 100, 1, 32, 32, decay="wide", seed=dh_chunks)
    got = run(interp, xs, h0, 0.7, settings=settings)
    assert_close(got, naive(xs, h0, 0.7), CPU_TOL, f"{blocked=} {dh_chunks=}")


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("lens", [None, [1, 17, 40, 9, 66]])
def test_triton_interpreter_backward_from_chunk_states_alone(blocked, lens, interp):
    # keep_chunk_tensors=False: the forward keeps the chunk states alone (and the block maps) and the backward forms
    # U, the chunk matrices and w by chunk again from the inputs and the states: equal rows and packed sequences
    # (spare chunks), two V tiles per chunk (chunk_bv 32 at V = 64), sequence and blocked scans (blocks of 2).
    settings = Settings(blocked_scan=blocked, block_chunks=2, chunk_bv=32, keep_chunk_tensors=False)
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0)
    xs, h0 = rwkv7_inputs(1, 100 if lens is None else sum(lens), 1, 32, 64, decay="wide",
                          n_seq=1 if lens is None else len(lens), seed=5)
    got = run(interp, xs, h0, 0.7, cu, settings=settings)
    assert_close(got, naive(xs, h0, 0.7, cu), CPU_TOL, f"{blocked=} {lens=}")


def test_triton_interpreter_bf16_backward_from_chunk_states_alone(interp):
    # the states kept in bf16 (chunk.kept_dtype), U formed again from them: within the bf16 bar (interpreter with the
    # GPU's rounding, model decays)
    xs, h0 = rwkv7_inputs(1, 100, 1, 64, 64, dtype=torch.bfloat16, decay="model", seed=21)
    ref = naive([x.double() for x in xs], h0.double(), 1.0)
    got = run(interp, xs, h0, 1.0, settings=Settings(keep_chunk_tensors=False))
    assert_close(got, ref, GPU_TOL, "bf16, chunk states alone kept")


def test_forward_keeps_chunk_states_alone(interp):
    from kernels.rwkv7.chunk import _forward_op
    from kernels.settings import to_text

    xs, _ = rwkv7_inputs(1, 40, 1, 32, 32, decay="wide", seed=3)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    kept = {keep: _forward_op(*xs[:1], xs[1].float(), None, *xs[2:], 1.0, None, False, cu, 40,
                              to_text(Settings(keep_chunk_tensors=keep, blocked_scan=False)))[2:]
            for keep in (True, False)}
    per_chunk = slice(1, 7)   # U, A_rb, A_rk, A_ak, T, w by chunk
    assert all(x.numel() > 0 for x in kept[True][per_chunk]) and all(x.numel() == 0 for x in kept[False][per_chunk])
    assert torch.equal(kept[True][0], kept[False][0])   # the chunk states


def test_blocked_scans_are_chosen_for_few_sequences():
    # the benchmark's B=2 T=16384 and B=8 T=4096 (H=16, V=64)
    assert Settings().blocked(2, 16, 64) and not Settings().blocked(8, 16, 64)
    assert not Settings(blocked_scan=False).blocked(2, 16, 64) and Settings(blocked_scan=True).blocked(8, 16, 64)


def test_triton_interpreter_stress_decays(interp):
    xs, h0 = rwkv7_inputs(1, 200, 1, 32, 32, decay="stress", seed=6)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, "stress")


@pytest.mark.parametrize("K,V", [(256, 64), (0, 64), (64, 0)])
def test_unsupported_head_sizes_refused_in_one_line(K, V):
    # before anything launches (meta tensors: no kernel could run), one line naming the sizes and what is supported
    xs = [torch.empty(1, 8, 1, D, device="meta") for D in (K, K, K, V, K, K)]
    with pytest.raises(ValueError, match=rf"^chunk_rwkv7: head size K={K}, V={V} is not supported .*K from 1 to "
                                         r"128, any V >= 1[^\n]*$"):
        chunk_rwkv7(*xs, backend="triton")


@pytest.mark.parametrize("decay", ["model", "stress"])
def test_triton_interpreter_bf16_products(decay, interp):
    # (with bf16 products, h and U are also kept for the backward in bf16)
    common.interpreter_bf16_products(OP, interp, Settings, decay)


def test_triton_kernel_under_torch_compile(interp):
    # The models compile their blocks (training.compile): the kernel call is the custom op flame::chunk_rwkv7, which
    # Dynamo traces as one node instead of into the launches, with the same output and gradients as eager.
    from tests.helpers import assert_compiled_matches_eager

    def f(r, w, k, v, a, b):
        return (interp(r * 2, w, k, v, a, b, scale=0.5)[0] * 3).sum()

    xs, _ = rwkv7_inputs(1, 20, 1, 16, 16, decay="wide", seed=1)
    assert_compiled_matches_eager(f, [x.requires_grad_(True) for x in xs])


@pytest.mark.parametrize("blocked", [False, True])
def test_triton_interpreter_varlen_computes_no_invalid_value(blocked, interp):
    # A packed batch launches an upper bound of chunks (kernels.utils.chunk_tables); the spare programs return at
    # once instead of computing on unwritten state memory: no overflow or NaN anywhere, masked or not.
    import numpy as np

    lens = [1, 17, 30, 64, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    xs, h0 = rwkv7_inputs(1, sum(lens), 1, 32, 64, n_seq=len(lens), seed=11)
    with np.errstate(all="raise"):
        got = run(interp, xs, h0, 1.0, cu, settings=Settings(blocked_scan=blocked))
    assert_close(got, naive(xs, h0, 1.0, cu), CPU_TOL, f"varlen blocked={blocked}")


# ---------------------------------------------------------------- the decay from its logits (w_bias)

LOGIT_NAMES = ("o", "ht", "dr", "dz", "dw_bias", "dk", "dv", "da", "db", "dh0")


def run_logits(fn, xs, z, bias, h0, scale, cu=None, **kw):
    """(outputs, gradients) of fn(r, z, k, v, a, b, w_bias=bias) for fixed random cotangents, in LOGIT_NAMES order."""
    r, k, v, a, b = (x.detach().clone().requires_grad_(True) for i, x in enumerate(xs) if i != 1)
    z, bias = z.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    h0 = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, ht = fn(r, z, k, v, a, b, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu, w_bias=bias,
               **kw)
    gen = torch.Generator().manual_seed(1)
    do, dht = (torch.randn(x.shape, generator=gen).to(x.device) for x in (o, ht))
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    return [o.detach(), ht.detach(), r.grad, z.grad, bias.grad, k.grad, v.grad, a.grad, b.grad,
            None if h0 is None else h0.grad]


def logits_reference(xs, z, bias, h0, scale, cu=None):
    """The fp64 recurrence on log_decay(z, bias), differentiated through the sigmoid by autograd."""
    def fn(r, z, k, v, a, b, w_bias, **kw):
        return naive_rwkv7(r, log_decay(z.double(), w_bias.double()), k, v, a, b, **kw)
    return run_logits(fn, [x.double() for x in xs], z.double(), bias.double(), None if h0 is None else h0.double(),
                      scale, cu)


def test_log_decay_is_rwkv7s():
    # RWKV-LM's x070: w = -softplus(-(w0 + lora)) - 0.5, decay = exp(-exp(w)) = exp(-e^{-0.5} sigmoid(w0 + lora))
    z = torch.linspace(-30, 30, 101, dtype=torch.float64)[:, None, None].expand(101, 1, 4)
    bias = torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    rwkv_lm = -torch.exp(-F.softplus(-(z + bias), threshold=100) - 0.5)   # (no linear tail: exact to 1e-12)
    assert torch.allclose(log_decay(z, bias), rwkv_lm, rtol=1e-12, atol=0)
    assert log_decay(z.float(), bias).dtype == torch.float32 and log_decay(z.bfloat16(), bias).dtype == torch.float32


@pytest.mark.parametrize("T,lens", [(100, None), (None, [1, 17, 64, 9])])
def test_torch_path_decay_from_logits(T, lens):
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0)
    xs, z, bias, h0 = rwkv7_logit_inputs(1, T or sum(lens), 2, 32, 32, n_seq=1 if lens is None else len(lens), seed=3)
    got = run_logits(chunk_rwkv7, xs, z, bias, h0, 0.5, cu)
    common.assert_close(got, logits_reference(xs, z, bias, h0, 0.5, cu), CPU_TOL, "torch path", LOGIT_NAMES)


@pytest.mark.parametrize("T,lens", [(100, None), (None, [1, 17, 64, 9])])
@pytest.mark.parametrize("w_formed", [False, True])
def test_triton_interpreter_decay_from_logits(T, lens, w_formed, interp, monkeypatch):
    # fp32: the log decay formed in _fwd_prep (padded rows stay at w = 0) and the logits' gradient through the sigmoid
    # in _bwd_chunk, against autograd through the fp64 recurrence; the bias's gradient is their sum over tokens.
    # w_formed: the op keeps no w by chunk and the backward's _bwd_scan and _bwd_chunk form w from the logits (on a
    # GPU where the CUDA scans serve the call, chunk._forms_w; the Triton scan where the CUDA one turns a call down),
    # in segments of 2 chunks.
    from kernels.rwkv7 import chunk

    if w_formed:
        monkeypatch.setattr(chunk, "_forms_w", lambda r, w, w_bias, v, blocked, s: w_bias is not None)
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0)
    xs, z, bias, h0 = rwkv7_logit_inputs(1, T or sum(lens), 1, 32, 64, n_seq=1 if lens is None else len(lens), seed=4)
    got = run_logits(interp, xs, z, bias, h0, 0.5, cu, settings=Settings(blocked_scan=False, bwd_dh_chunks=2))
    common.assert_close(got, logits_reference(xs, z, bias, h0, 0.5, cu), CPU_TOL, f"interpreter, {w_formed=}",
                        LOGIT_NAMES)


def test_triton_interpreter_decay_from_bf16_logits(interp):
    # As the model calls it: bf16 inputs and logits, bf16 products; the logits' gradient comes back in bf16.
    xs, z, bias, h0 = rwkv7_logit_inputs(1, 100, 1, 64, 64, dtype=torch.bfloat16, seed=5)
    got = run_logits(interp, xs, z, bias, h0, 1.0)
    assert got[3].dtype == torch.bfloat16 and got[4].dtype == torch.float32
    common.assert_close(got, logits_reference(xs, z, bias, h0, 1.0), GPU_TOL, "bf16 logits", LOGIT_NAMES)


# ---------------------------------------------------------------- GPU: the Triton kernel in bf16

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("B,T,H,K,V", common.GPU_SHAPES)
def test_gpu_bf16_matches_naive(B, T, H, K, V):
    common.gpu_bf16_matches_naive(OP, B, T, H, K, V)


@gpu
def test_gpu_varlen_many_sequences():
    common.gpu_varlen_many_sequences(OP)


@gpu
@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("V", [32, 64, 128])
def test_gpu_initial_state_kv_pairs(K, V):
    common.gpu_initial_state_kv_pairs(OP, K, V)


@gpu
@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (32, 32)])
@pytest.mark.parametrize("bv", [16, 64])
def test_gpu_initial_state_block_sizes(K, V, bv):
    xs, h0 = rwkv7_inputs(1, 150, 2, K, V, device="cuda", dtype=torch.bfloat16, seed=bv)
    got = run(chunk_rwkv7, xs, h0, 1.0, settings=Settings(scan_bv=bv))
    assert_close(got, naive(xs, h0, 1.0), GPU_TOL, f"{K=} {V=} {bv=}")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_stress_decays_t4096(dtype):
    common.gpu_stress_decays_t4096(OP, dtype, seed=8)


@gpu
@pytest.mark.parametrize("B,T,H,lens", [(8, 512, 20, None), (1, None, 4, [1, 15, 100, 333, 64])])
def test_gpu_decay_from_logits(B, T, H, lens):
    # bf16 logits (the 0.6B layer's heads, and packed sequences) against the fp64 recurrence on their log decays
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0).cuda()
    xs, z, bias, h0 = rwkv7_logit_inputs(B, T or sum(lens), H, 64, 64, device="cuda", dtype=torch.bfloat16, seed=6,
                                   n_seq=None if lens is None else len(lens))
    got = run_logits(chunk_rwkv7, xs, z, bias, h0, 1.0, cu)
    common.assert_close(got, logits_reference(xs, z, bias, h0, 1.0, cu), GPU_TOL, "gpu logits", LOGIT_NAMES)


@gpu
def test_gpu_matches_cpu_torch_path():
    common.gpu_matches_cpu_torch_path(OP)


# Non-default settings, in bf16 on the GPU: stress decays at T = 4096 with initial states, and packed
# sequences with K != V (the backward holding dh for 5 or 16 chunks at a time, or for all; the chunk states alone
# kept).
VARIANTS = [dict(cuda_prep=False), dict(cuda_prep=False, prep_maxnreg=None), dict(cuda_prep=False, prep_maxnreg=128),
            dict(blocked_scan=False),
            dict(blocked_scan=False, cuda_scan=False),
            dict(blocked_scan=False, bwd_dh_chunks=5), dict(blocked_scan=False, bwd_dh_chunks=0),
            dict(blocked_scan=True, block_chunks=8), dict(blocked_scan=True, block_chunks=8, bwd_dh_chunks=20),
            dict(blocked_scan=False, keep_chunk_tensors=False), dict(blocked_scan=True, keep_chunk_tensors=False)]


@gpu
@pytest.mark.parametrize("fields", VARIANTS, ids=common.settings_id)
def test_gpu_variants_match_naive(fields):
    settings = Settings(**fields)
    common.gpu_stress_decays_t4096(OP, torch.bfloat16, seed=10, settings=settings)
    common.gpu_varlen_k_ne_v(OP, torch.bfloat16, settings=settings)


# ---------------------------------------------------------------- the CUDA kernels (scan.cu, bwd_scan.cu, prep.cu)


def test_cuda_kernels_build_for_an_h100():
    # built for sm_90 without a GPU (NVRTC): the blocks an SM each kernel is built for fit an SM's registers and its
    # shared memory, nothing spills but what is allowed, and the size the launch gives is the kernel's Shared (a
    # static_assert in the build)
    import platform

    from kernels import cuda_rtc
    from kernels.rwkv7 import scan_cuda

    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("NVRTC is a test requirement on Linux x86_64 only (pyproject.toml)")
    assert cuda_rtc._nvrtc() is not None, "NVRTC (nvidia-cuda-nvrtc-cu12, a test requirement) is not installed"
    for kernel in (scan_cuda.FORWARD, scan_cuda.FORWARD_LOGITS, scan_cuda.BACKWARD, scan_cuda.BACKWARD_LOGITS,
                   scan_cuda.PREP):
        built = kernel.resources("sm_90")
        assert kernel.blocks * kernel.threads * built["registers"] <= 64 * 1024, (kernel.name, built)
        assert built["spilled_bytes"] <= kernel.spill_bytes, (kernel.name, built)
        assert kernel.blocks * (kernel.shared_bytes + 1024) <= 228 * 1024, kernel.name   # (1 KiB an SM keeps a block)


SEQUENCE_SCANS = Settings(blocked_scan=False)


@gpu
@pytest.mark.parametrize("B,T,H,V,lens", [
    (8, 512, 20, 64, None),                       # the 0.6B layer's heads
    (1, None, 4, 64, [1, 15, 16, 17, 100, 333]),  # packed, chunks cut short
    (2, 300, 3, 128, None),                       # two passes of 64 value columns
])
def test_gpu_cuda_prep_matches_triton_prep(B, T, H, V, lens):
    # every output of prep.cu against the Triton _fwd_prep's on the same bf16 logits (what the scans and the
    # backward read): W, Uv, A_rb, A_rk, A_ak, T, and w by chunk bit for bit (both form it by the same operations, as
    # the backward's kernels do from the logits)
    from kernels.rwkv7 import scan_cuda
    from kernels.rwkv7.chunk import _prep, _tables
    from kernels.utils import packed_rows

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("prep.cu needs sm_90")
    T = T or sum(lens)
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0).cuda()
    xs, z, bias, _ = rwkv7_logit_inputs(B, T, H, 64, V, device="cuda", dtype=torch.bfloat16, seed=23,
                                        n_seq=None if lens is None else len(lens))
    cu_, flat = packed_rows(B, T, H, cu, "cuda")
    r, k, v, a, b = (flat(x) for x in (xs[0], *xs[2:]))
    assert scan_cuda.runs(scan_cuda.PREP, r, v, (r, k, v, a, b), True)
    tables, _ = _tables(cu_, B * T, T if cu is None else 0, H, V, Settings())
    got, ref = (_prep(r, flat(z), bias, k, v, a, b, cu_, tables, Settings(cuda_prep=c)) for c in (True, False))
    for name, x, y, tol in zip(["W", "Uv", "A_rb", "A_rk", "A_ak", "T", "w by chunk"], got, ref,
                               [2e-3, 5e-3, 5e-3, 5e-3, 1e-2, 2e-3, 0.]):
        x, y = x.float(), y.float()
        assert torch.isfinite(x).all(), name
        err = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
        assert err <= tol, (name, err)


@gpu
def test_gpu_cuda_kernels_run_where_built_for():
    # on a Hopper GPU the model's calls take the CUDA kernels (a failed NVRTC lookup would otherwise fall back unseen);
    # before sm_90 (no stmatrix) they take the Triton kernels
    from kernels.rwkv7 import scan_cuda

    x = torch.zeros(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    kernels = (scan_cuda.FORWARD, scan_cuda.FORWARD_LOGITS, scan_cuda.BACKWARD, scan_cuda.BACKWARD_LOGITS,
               scan_cuda.PREP)
    if torch.cuda.get_device_capability()[0] < 9:
        assert not any(scan_cuda.runs(scan, x, x, (x,), True) or scan.kernel(x.device) for scan in kernels)
        return
    shifted = torch.zeros(x.numel() + 8, device="cuda", dtype=torch.bfloat16)[1:x.numel() + 1].view(x.shape)
    for scan in kernels:
        assert scan_cuda.runs(scan, x, x, (x, x), True)
        assert not scan_cuda.runs(scan, x.float(), x.float(), (x,), False)
        assert not scan_cuda.runs(scan, x[..., :32], x, (x,), True)
        assert not scan_cuda.runs(scan, x, x, (x, shifted), True)   # 2 bytes past an aligned start
        assert scan.kernel(x.device).spilled_bytes <= scan.spill_bytes


@gpu
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fields,cuda", [
    (dict(), True), (dict(keep_chunk_tensors=False), True),   # the layer's two settings
    (dict(prec="ieee"), False), (dict(bf16_products=False), False),   # products the CUDA kernels do not take
])
def test_gpu_layer_call_takes_the_cuda_kernels(bias_dtype, fields, cuda, monkeypatch):
    # the 0.6B layer's call (bf16 logits; its bias bf16 as FSDP's mixed precision gives it, or fp32) runs every CUDA
    # kernel in a fwd+bwd (a condition the call misses would otherwise fall back to the Triton kernels unseen), the
    # scans forming w from the logits (their LOGITS builds: given the bias) and prep.cu storing no w by chunk; settings
    # that ask for other products run none
    from kernels.rwkv7 import scan_cuda

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the CUDA kernels need sm_90")
    calls = {}
    for name in ("fwd_prep", "fwd_scan", "bwd_scan"):
        real = getattr(scan_cuda, name)
        monkeypatch.setattr(scan_cuda, name, lambda *a, _real=real, _name=name: (calls.setdefault(_name, a),
                                                                                 _real(*a))[1])
    xs, z, bias, _ = rwkv7_logit_inputs(8, 256, 20, 64, 64, device="cuda", dtype=torch.bfloat16, seed=41)
    run_logits(chunk_rwkv7, xs, z, bias.to(bias_dtype), None, 1.0, settings=Settings(**fields))
    assert set(calls) == ({"fwd_prep", "fwd_scan", "bwd_scan"} if cuda else set()), list(calls)
    if cuda:   # fwd_scan(r, w, w_bias, ...), bwd_scan(r, w, w_bias, ...), fwd_prep(..., Tinv, wf, ...)
        assert calls["fwd_scan"][2] is not None and calls["bwd_scan"][2] is not None and calls["fwd_prep"][15] is None


@gpu
@pytest.mark.parametrize("B,T,H,V,lens,with_h0", [
    (8, 512, 20, 64, None, True),                       # the 0.6B layer's heads
    (1, None, 4, 64, [1, 15, 16, 17, 100, 333], True),  # packed, chunks cut short
    (2, 300, 3, 128, None, False),                      # two blocks of 64 columns per head, no initial state
])
def test_gpu_cuda_scan_matches_naive_and_triton_scan(B, T, H, V, lens, with_h0):
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0).cuda()
    xs, h0 = rwkv7_inputs(B, T or sum(lens), H, 64, V, device="cuda", dtype=torch.bfloat16, seed=21,
                          n_seq=None if lens is None else len(lens))
    h0 = h0 if with_h0 else None
    got = run(chunk_rwkv7, xs, h0, 0.5, cu, settings=SEQUENCE_SCANS)
    assert_close(got, naive(xs, h0, 0.5, cu), GPU_TOL, "cuda scan vs fp64")
    triton_scan = run(chunk_rwkv7, xs, h0, 0.5, cu, settings=Settings(blocked_scan=False, cuda_scan=False))
    assert_close(got, triton_scan, GPU_TOL, "cuda scan vs the Triton scan")
