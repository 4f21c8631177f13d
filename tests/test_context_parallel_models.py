"""Context parallelism in the recurrent models (flame.context_parallel): one forward + backward with every row split
over cp = 2 and 4 CPU gloo ranks gives, summed over the ranks, cp = 1's loss sum and every parameter's gradient on the
same global batch, to fp32 rounding: RWKV-7, GSA (short convolutions off and on) and RWKV-6, with rows of one
sequence and with packed documents that cross piece boundaries and start exactly on one (tests/cp_helpers.py)."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.multiprocessing as mp

from flame.context_parallel import ContextParallel, enable, split_batch
from tests.cp_helpers import (CHAIN, WORLD, case_names, case_of, case_run, compiled_runs, free_port, global_batch,
                              worker)
from tests.tiny_models import tiny_model

LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-5
"""Of each tensor's largest reference gradient: the worst seen is 4e-6 (a GSA convolution weight whose gradients are
500x smaller than the model's largest); a broken exchange or document mask is off by 1e-1 or more."""


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """The cp runs' results folder. Forked, not spawned: the ranks then share this process's imports (torch, the
    models and kernels: most of a spawned rank's time on the 2-core machine)."""
    out = tmp_path_factory.mktemp("cp")
    for name in ("rwkv7", "rwkv6", "gsa"):
        importlib.import_module(f"flame.models.{name}")   # the model and its kernels, before the fork
    # spawned where there is a GPU: once torch has counted the GPUs, a forked process cannot use CUDA, and a rank's
    # torch.compile asks CUDA for its RNG state
    start = "spawn" if torch.cuda.is_available() else "fork"
    mp.start_processes(worker, args=(free_port(), str(out)), nprocs=WORLD, join=True, start_method=start)
    return out


@functools.cache
def whole_rows(name: str):
    """cp = 1's result, on one thread as the ranks run (tiny ops: a second thread only waits on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return case_run(name, None)
    finally:
        torch.set_num_threads(threads)


def assert_equal_to_whole_rows(result_file, name):
    ref_loss, ref_grads = whole_rows(name)
    loss, grads = torch.load(result_file)
    assert abs(float(loss - ref_loss)) <= LOSS_RTOL * abs(float(ref_loss)), (float(loss), float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        err = float((grads[param] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert err <= GRAD_RTOL, f"{param}: gradient off by {err:.2e} of its largest"


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", case_names() + [f"{c}_chain" for c in CHAIN])
def test_cp_equals_whole_rows(cp_results, size, name):
    """The gather, and the send/recv chain (_chain)."""
    assert_equal_to_whole_rows(cp_results / f"{size}_{name}.pt", case_of(name))


@pytest.mark.parametrize("name, suffix", compiled_runs())
def test_cp_compiled_blocks_equal_whole_rows(cp_results, name, suffix):
    """Checkpointed blocks compiled whole (fullgraph) at cp = 2 give the uncompiled whole rows' loss and gradients:
    selective and full checkpointing, gather and chain (cp_helpers.VARIANTS)."""
    assert_equal_to_whole_rows(cp_results / f"2_{name}_{suffix}.pt", name)


def test_split_batch_refuses_indivisible_length():
    cp = ContextParallel(None, 0, 4)
    batch = global_batch(packed=False)
    batch = {k: v[:, :30] for k, v in batch.items()}
    with pytest.raises(ValueError, match="^context parallel: sequence length 30 is not divisible by the cp degree 4$"):
        split_batch(batch, cp)


def test_split_batch_pieces():
    """The pieces' own segments and which rows continue the previous piece's document (doc_starts at cp = 4)."""
    batch = global_batch(packed=True)
    pieces = [split_batch(batch, ContextParallel(None, r, 4)) for r in range(4)]
    assert all(torch.equal(p["input_ids"], batch["input_ids"][:, 8 * r:8 * r + 8]) for r, p in enumerate(pieces))
    assert [p["cu_seqlens"].tolist() for p in pieces] == [[0, 5, 8, 9, 16], [0, 8, 16], [0, 7, 8, 16],
                                                          [0, 3, 8, 10, 16]]
    assert [p["cp_continues"].tolist() for p in pieces] == [[False, False], [True, True], [False, True],
                                                            [True, False]]


def test_enable_refuses_transformer():
    model = tiny_model("transformer", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2)
    with pytest.raises(ValueError, match="^context parallel supports rwkv7, rwkv6, gsa, not model 'transformer'$"):
        enable(model, ContextParallel(None, 0, 2))
