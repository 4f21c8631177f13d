"""training.activation_checkpoint: none, selective and full give the same loss and gradients; selective's backward
repeats no matmul of the forward (full's repeats them all) but does recompute the cheap ops, and its wrapped blocks
compile without a graph break; a short training run under selective checkpointing logs the losses of a run without
(and its time to first step once); a bad value stops with one line."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flame.activation_checkpoint import saves_output, wrap_blocks
from flame.config import ConfigError, load_config
from flame.models import build_model
from tests.helpers import read_metrics, run_train, write_config

MODES = ("none", "selective", "full")
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (matmuls apart) while it is active."""

    def __init__(self):
        super().__init__()
        self.matmuls = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "aten":
            self.ops += 1
            self.matmuls += func._opname in MATMULS
        return func(*args, **(kwargs or {}))


def forward_backward(config: str, mode: str, compile_blocks=None):
    """Loss, gradients by parameter name, and the ops counted in backward, of one step of a tiny model (its wrapped
    blocks compiled by `compile_blocks`, if given)."""
    cfg = load_config(f"configs/{config}.toml", ["--model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights()
    wrap_blocks(model, mode)
    if compile_blocks is not None:
        compile_blocks(model)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids)
    with OpCounter() as backward_ops:
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, backward_ops


@pytest.mark.parametrize("config", ["rwkv7_tiny", "gsa_tiny", "transformer_tiny"])
def test_checkpointing_changes_what_backward_runs_not_its_results(config):
    runs = {mode: forward_backward(config, mode) for mode in MODES}
    loss, grads, plain = runs["none"]
    for mode in ("selective", "full"):
        other_loss, other_grads, _ = runs[mode]
        torch.testing.assert_close(other_loss, loss, rtol=1e-6, atol=0)
        assert other_grads.keys() == grads.keys(), mode
        for name, g in grads.items():
            torch.testing.assert_close(other_grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    selective, full = runs["selective"][2], runs["full"][2]
    assert full.matmuls > plain.matmuls, f"{config}: full checkpointing reran no matmul"
    assert selective.matmuls == plain.matmuls, \
        f"{config}: selective backward ran {selective.matmuls - plain.matmuls} matmuls of the forward again"
    assert selective.ops > plain.ops, f"{config}: selective checkpointing recomputed nothing"
    assert selective.ops < full.ops


def test_selective_keeps_the_registered_chunk_kernels():
    # On the GPU the kernels run as custom ops (on the CPU their PyTorch path runs outside the op): the policy must
    # know them by their registered names (and still recompute elementwise ops).
    import kernels.gsa  # noqa: F401  (each registers its flame:: ops)
    import kernels.rwkv6  # noqa: F401
    import kernels.rwkv7  # noqa: F401

    for name in ("chunk_rwkv7", "chunk_gsa", "chunk_rwkv6"):
        assert saves_output(getattr(torch.ops.flame, name).default), name
        assert not saves_output(getattr(torch.ops.flame, f"{name}_bwd").default), name
    assert saves_output(torch.ops.aten.mm.default) and not saves_output(torch.ops.aten.mul.Tensor)
    assert saves_output(torch.ops._c10d_functional.all_gather_into_tensor.default)  # cp exchanges: not repeated
    # of the fused glue ops, RWKV-7's output epilogue (the output projection's input) is kept; the others recomputed
    import kernels.rwkv7_key  # noqa: F401
    import kernels.rwkv7_out  # noqa: F401
    import kernels.token_shift  # noqa: F401

    assert saves_output(torch.ops.flame.rwkv7_out.default)
    assert not saves_output(torch.ops.flame.rwkv7_out_bwd.default)
    assert not saves_output(torch.ops.flame.rwkv7_key.default)
    assert not saves_output(torch.ops.flame.norm_shift_mix.default)


def test_selective_blocks_compile_whole(monkeypatch):
    # parallelize's order for selective: wrap, then compile the wrapper. Dynamo must capture each wrapped RWKV-7
    # block (chunk kernel and glue ops included) with no graph break, else the whole block would run eager.
    import torch._dynamo as dynamo

    from flame.parallel import compile_blocks

    loss, grads, _ = forward_backward("rwkv7_tiny", "selective")
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compile_(self, backend="eager"))
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled_loss, compiled_grads, _ = forward_backward("rwkv7_tiny", "selective", compile_blocks)
    assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])
    assert 1 <= dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # RWKV-7's first block differs (v_first)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(compiled_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_selective_training_run_logs_the_losses_of_a_plain_run(tmp_path):
    config, _ = write_config(tmp_path)  # the tiny transformer on synthetic tokens
    losses = {}
    for mode in ("none", "selective"):
        dump = tmp_path / mode
        started = time.perf_counter()
        proc = run_train(config, f"--job.dump_folder={dump}", f"--training.activation_checkpoint={mode}",
                         "--training.steps=3", "--checkpoint.enable=false")
        wall = time.perf_counter() - started
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[mode] = [r["loss"] for r in read_metrics(dump)]
        # the start-up figure benchmarks/bench_train.py reports: logged once, at the first step, within the run's time
        (first,) = read_metrics(dump, "time_to_first_step_sec")
        assert first["step"] == 1 and 0 < first["time_to_first_step_sec"] < wall
    assert len(losses["none"]) == 3
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-6)


def test_unknown_choice_is_one_line_naming_the_key(tmp_path):
    config, _ = write_config(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(config, ["--training.activation_checkpoint=partial"])
    line = str(e.value)
    assert "training.activation_checkpoint" in line and "'selective'" in line and "\n" not in line
