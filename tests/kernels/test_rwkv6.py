"""RWKV-6 chunked kernels against the fp64 token-by-token recurrence.

CPU: the naive recurrence against the attention-form definition, the PyTorch chunked path, the one-token step, and
the Triton kernel under TRITON_INTERPRET=1 (fp32; small shapes, the interpreter is slow). GPU (`-m gpu`): the
Triton kernel in bf16. Metric: RMSE(x - ref) / RMS(ref).
"""

from __future__ import annotations

import pytest
import torch

from kernels.rwkv6 import chunk_rwkv6, chunk_rwkv6_torch, naive_rwkv6, recurrent_step
from kernels.rwkv6.chunk import Settings
from tests.kernels import common
from tests.kernels.common import CPU_TOL, run
from tests.kernels.inputs import rwkv6_inputs

NAMES = ("o", "ht", "dr", "dk", "dv", "dw", "du", "dh0")


OP = common.ChunkOp(chunk_rwkv6, chunk_rwkv6_torch, naive_rwkv6, rwkv6_inputs, NAMES)
naive, assert_close = OP.naive, OP.assert_close


@pytest.fixture
def interp():
    return common.interpreted(chunk_rwkv6)


# ---------------------------------------------------------------- CPU: the reference and the PyTorch path


def test_naive_matches_attention_form_definition():
    # o_t = scale (r_t^T (prod_{j<t} e^{w_j}) S_0 + sum_{s<t} (r_t * prod_{s<j<t} e^{w_j} * k_s) . 1 v_s
    #              + (r_t . (u * k_t)) v_t), written as explicit products over the sequence
    xs, h0 = rwkv6_inputs(2, 9, 2, 4, 3, decay="wide")
    r, k, v, w, u = (x.double() for x in xs)
    h0 = h0.double()
    o = torch.zeros_like(v)
    for t in range(9):
        o[:, t] = torch.einsum("bhk,bhkv->bhv", r[:, t] * w[:, :t].sum(1).exp(), h0)
        for s in range(t):
            o[:, t] += (r[:, t] * w[:, s + 1:t].sum(1).exp() * k[:, s]).sum(-1, keepdim=True) * v[:, s]
        o[:, t] += (r[:, t] * u * k[:, t]).sum(-1, keepdim=True) * v[:, t]
    ht = torch.einsum("bhk,bhkv->bhkv", w.sum(1).exp(), h0) + sum(
        torch.einsum("bhk,bhv->bhkv", w[:, s + 1:].sum(1).exp() * k[:, s], v[:, s]) for s in range(9))
    got, got_ht = naive_rwkv6(*xs, scale=0.5, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(got, 0.5 * o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_ht, ht, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B,T", [(2, 1), (2, 15), (2, 64), (2, 100), (1, 1000)])
def test_torch_path_matches_naive(B, T):
    common.torch_path_matches_naive(OP, B, T)


def test_torch_path_is_the_cpu_default_and_scale_defaults_to_k():
    xs, h0 = rwkv6_inputs(1, 20, 1, 16, 16)
    o, ht = chunk_rwkv6(*xs, initial_state=h0, output_final_state=True)
    o2, ht2 = chunk_rwkv6_torch(*xs, scale=16 ** -0.5, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_torch_path_varlen():
    common.torch_path_varlen(OP)


def test_torch_path_stress_decays_t4096():
    common.torch_path_stress_decays_t4096(OP, K=16)


def test_step_matches_naive():
    xs, h0 = rwkv6_inputs(2, 12, 2, 16, 8, decay="wide", seed=5)
    r, k, v, w, u = xs
    o_ref, ht_ref = naive_rwkv6(*xs, initial_state=h0, output_final_state=True)
    state, outs = h0.clone(), []
    for t in range(12):
        given = state.clone()
        o, new = recurrent_step(r[:, t], k[:, t], v[:, t], w[:, t], u, given)
        assert torch.equal(given, state)   # the given state is not modified in place
        state = new
        outs.append(o)
    assert_close([torch.stack(outs, 1), state], [o_ref, ht_ref], CPU_TOL, "step")


# ---------------------------------------------------------------- CPU: Triton kernel under the interpreter


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 15), (1, 64), (1, 100)])
def test_triton_interpreter_matches_naive(B, T, chunk, interp):
    xs, h0 = rwkv6_inputs(B, T, 2, 32, 32, decay="wide", seed=T)
    got = run(interp, xs, h0, 0.5, settings=Settings(chunk=chunk))
    assert_close(got, naive(xs, h0, 0.5), CPU_TOL, f"T={T} chunk={chunk}")


@pytest.mark.parametrize("chunk", [16, 32])
def test_triton_interpreter_varlen(chunk, interp):
    # sequences shorter than a chunk, exactly a chunk and longer; the spare chunk programs of a packed batch
    cu = torch.tensor([0, 5, 37, 38, 70])
    xs, h0 = rwkv6_inputs(1, 70, 1, 32, 32, decay="wide", n_seq=4, seed=5)
    got = run(interp, xs, h0, 1.0, cu, settings=Settings(chunk=chunk))
    assert_close(got, naive(xs, h0, 1.0, cu), CPU_TOL, "varlen")
    assert_close(run(interp, xs, None, 1.0, cu, settings=Settings(chunk=chunk)), naive(xs, None, 1.0, cu),
                 CPU_TOL, "varlen, no initial state")


@pytest.mark.parametrize("K", [32, 64, 128])
@pytest.mark.parametrize("V", [32, 64, 128])
def test_triton_interpreter_initial_state_kv_pairs(K, V, interp):
    common.interpreter_initial_state_kv_pairs(OP, interp, K, V)


@pytest.mark.parametrize("K,V", [(32, 128), (128, 32)])
@pytest.mark.parametrize("scan_bv,chunk_bv", [(16, 16), (32, 32), (64, 64)])
def test_triton_interpreter_initial_state_v_tiles(K, V, scan_bv, chunk_bv, interp):
    # every V tile of the scans and of the per-chunk kernels' V loops, K != V both ways
    xs, h0 = rwkv6_inputs(1, 20, 1, K, V, seed=scan_bv + K)
    got = run(interp, xs, h0, 1.0, settings=Settings(scan_bv=scan_bv, chunk_bv=chunk_bv))
    assert_close(got, naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V} scan_bv={scan_bv} chunk_bv={chunk_bv}")


@pytest.mark.parametrize("K,V", [(256, 256), (128, 256)])
def test_triton_interpreter_wide_heads(K, V, interp):
    # K x V past 128 x 128: the per-chunk kernels loop over narrower V tiles (Settings.chunk_tile), so that their
    # shared memory fits an H100 block (the sm_90 compile test builds these)
    assert Settings().chunk_tile(K, V) == 8192 // K
    xs, h0 = rwkv6_inputs(1, 20, 1, K, V, seed=K + V)
    assert_close(run(interp, xs, h0, 1.0), naive(xs, h0, 1.0), CPU_TOL, f"K={K} V={V}")


@pytest.mark.parametrize("K,V", [(512, 64), (0, 64), (64, 0)])
def test_unsupported_head_sizes_refused_in_one_line(K, V):
    # before anything launches (meta tensors: no kernel could run), one line naming the sizes and what is supported
    xs = [torch.empty(1, 8, 1, D, device="meta") for D in (K, K, V, K)] + [torch.empty(1, K, device="meta")]
    with pytest.raises(ValueError, match=rf"^chunk_rwkv6: head size K={K}, V={V} is not supported .*K from 1 to "
                                         r"256, any V >= 1[^\n]*$"):
        chunk_rwkv6(*xs, backend="triton")


@pytest.mark.parametrize("decay", ["model", "stress"])
def test_triton_interpreter_bf16_products(decay, interp):
    common.interpreter_bf16_products(OP, interp, Settings, decay)


@pytest.mark.parametrize("chunk", [16, 32])
def test_triton_interpreter_stress_decays(chunk, interp):
    # log decays -1e-6 .. -50: no overflow or invalid value anywhere, masked or not
    import numpy as np

    xs, h0 = rwkv6_inputs(1, 200, 1, 32, 32, decay="stress", seed=6)
    with np.errstate(over="raise", invalid="raise"):
        got = run(interp, xs, h0, 1.0, settings=Settings(chunk=chunk))
    assert_close(got, naive(xs, h0, 1.0), CPU_TOL, "stress")


@pytest.mark.parametrize("block_chunks,with_h0", [(1, True), (2, False)])
def test_triton_interpreter_blocked_scan(block_chunks, with_h0, interp):
    # two sequences of 40 tokens, chunks of 16: blocks of 1 chunk, or of 2 with a short last block and chunk
    xs, h0 = rwkv6_inputs(2, 40, 1, 32, 32, decay="wide", seed=20 + block_chunks)
    h0 = h0 if with_h0 else None
    s = Settings(chunk=16, blocked_scan=True, block_chunks=block_chunks, block_bv=16)
    assert_close(run(interp, xs, h0, 0.5, settings=s), naive(xs, h0, 0.5), CPU_TOL, f"blocks of {block_chunks}")


def test_triton_interpreter_blocked_scan_varlen_stress(interp):
    # packed sequences (a spare block, sequences of one and of several blocks), log decays -1e-6 .. -50, K != V
    import numpy as np

    cu = torch.tensor([0, 5, 37, 38, 110])
    xs, h0 = rwkv6_inputs(1, 110, 1, 32, 64, decay="stress", n_seq=4, seed=23)
    s = Settings(chunk=16, blocked_scan=True, block_chunks=2, block_bv=32, scan_bv=16)
    with np.errstate(over="raise", invalid="raise"):
        got = run(interp, xs, h0, 1.0, cu, settings=s)
    assert_close(got, naive(xs, h0, 1.0, cu), CPU_TOL, "blocked varlen stress")


def test_blocked_scan_is_chosen_for_few_long_sequences():
    s = Settings()
    assert s.blocked(2, 16, 64) and not s.blocked(8, 16, 64)
    assert not Settings(blocked_scan=False).blocked(2, 16, 64) and Settings(blocked_scan=True).blocked(8, 16, 64)


def test_settings_refuse_a_chunk_without_a_kernel():
    with pytest.raises(ValueError, match="rwkv6 Settings.chunk must be 16 or 32, got 64"):
        Settings(chunk=64)


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
@pytest.mark.parametrize("K,V", [(256, 256), (128, 256), (256, 64)])
def test_gpu_wide_heads(K, V):
    common.gpu_initial_state_kv_pairs(OP, K, V)


@gpu
@pytest.mark.parametrize("fields", [dict(chunk=16), dict(chunk=32), dict(scan_bv=16), dict(scan_bv=64),
                                    dict(chunk_bv=32), dict(prec="ieee"), dict(bf16_products=False),
                                    dict(blocked_scan=True, block_chunks=4),
                                    dict(blocked_scan=False)], ids=common.settings_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_stress_decays_t4096(fields, dtype):
    common.gpu_stress_decays_t4096(OP, dtype, seed=8, settings=Settings(**fields))
    common.gpu_varlen_k_ne_v(OP, dtype, settings=Settings(**fields))


@gpu
def test_gpu_matches_cpu_torch_path():
    common.gpu_matches_cpu_torch_path(OP)
