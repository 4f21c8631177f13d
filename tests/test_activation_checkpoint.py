"""training.activation_checkpoint: none, selective and full give the same loss and gradients; selective's backward
repeats no matmul of the forward (full's repeats them all) but does recompute the cheap ops, and its wrapped blocks
compile without a graph break; a short training run under selective checkpointing logs the losses of a run without
(and its time to first step once); a bad value stops with one line. training.recompute: the MLP's input matmuls
and the low-rank up matmuls run again and nothing else, RWKV-7's chunk op is told to keep its states alone, results
unchanged."""

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


def forward_backward(config: str, mode: str, compile_blocks=None, recompute=(), overrides=()):
    """Loss, gradients by parameter name, and the ops counted in backward, of one step of a tiny model (its wrapped
    blocks compiled by `compile_blocks`, if given)."""
    cfg = load_config(f"configs/{config}.toml", ["--model.vocab_size=512", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights()
    wrap_blocks(model, mode, recompute)
    if compile_blocks is not None:
        compile_blocks(model)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids)
    with OpCounter() as backward_ops:
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, backward_ops


def named_weights_per_layer(config: str, attribute: str) -> list[int]:
    """How many weights each block's modules name in `attribute` (a recompute part's: one matmul each)."""
    model = build_model(load_config(f"configs/{config}.toml").model)
    return [sum(getattr(m, name, None) is not None for m in block.modules() for name in getattr(m, attribute, ()))
            for block in model.layers]


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
    for mode, *recompute in (("none",), ("selective",), ("selective", '--training.recompute=["mlp_hidden"]')):
        dump = tmp_path / f"{mode}{len(recompute)}"
        started = time.perf_counter()
        proc = run_train(config, f"--job.dump_folder={dump}", f"--training.activation_checkpoint={mode}",
                         "--training.steps=3", "--checkpoint.enable=false", *recompute)
        wall = time.perf_counter() - started
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[dump] = [r["loss"] for r in read_metrics(dump)]
        # the start-up figure benchmarks/bench_train.py reports: logged once, at the first step, within the run's time
        (first,) = read_metrics(dump, "time_to_first_step_sec")
        assert first["step"] == 1 and 0 < first["time_to_first_step_sec"] < wall
    plain, selective, lean = losses.values()
    assert len(plain) == 3
    assert selective == pytest.approx(plain, rel=1e-6) and lean == pytest.approx(plain, rel=1e-6)


def test_unknown_choice_is_one_line_naming_the_key(tmp_path):
    config, _ = write_config(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(config, ["--training.activation_checkpoint=partial"])
    line = str(e.value)
    assert "training.activation_checkpoint" in line and "'selective'" in line and "\n" not in line


@pytest.mark.parametrize("config, part, attribute", [
    ("rwkv7_tiny", "mlp_hidden", "mlp_input_projections"), ("rwkv6_tiny", "mlp_hidden", "mlp_input_projections"),
    ("gsa_tiny", "mlp_hidden", "mlp_input_projections"), ("transformer_tiny", "mlp_hidden", "mlp_input_projections"),
    ("rwkv7_tiny", "low_rank", "low_rank_up_projections"), ("rwkv6_tiny", "low_rank", "low_rank_up_projections"),
])
def test_a_recomputed_part_reruns_its_matmuls_alone(config, part, attribute):
    loss, grads, selective = forward_backward(config, "selective")
    lean_loss, lean_grads, lean = forward_backward(config, "selective", recompute=[part])
    torch.testing.assert_close(lean_loss, loss, rtol=0, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(lean_grads[name], g, rtol=0, atol=0, msg=name)
    per_layer = named_weights_per_layer(config, attribute)
    named = sum(per_layer)
    assert all(per_layer)
    assert lean.matmuls == selective.matmuls + named, (lean.matmuls, selective.matmuls, named)


@pytest.mark.parametrize("config, part, attribute", [
    ("rwkv7_tiny", "mlp_hidden", "mlp_input_projections"), ("rwkv7_tiny", "low_rank", "low_rank_up_projections"),
    ("transformer_tiny", "mlp_hidden", "mlp_input_projections"),
])
def test_compiled_backward_holds_the_parts_matmuls(config, part, attribute, monkeypatch):
    # Compiled, the policy's choices go through AOTAutograd's min-cut partitioner (Inductor's), which may keep or
    # recompute on its own: each block's backward graph must hold one more matmul per named weight, and no other.
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    import torch._dynamo as dynamo
    from flame.parallel import compile_blocks

    matmuls = []

    def count(gm, _):
        matmuls.append(sum(n.op == "call_function" and getattr(n.target, "_opname", "") in MATMULS
                           for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=count,
                           partition_fn=min_cut_rematerialization_partition)
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compile_(self, backend=backend))
    totals = []
    for recompute in ([], [part]):
        dynamo.reset()
        matmuls.clear()
        forward_backward(config, "selective", compile_blocks, recompute=recompute)
        totals.append(sum(matmuls))
    per_layer = named_weights_per_layer(config, attribute)
    # RWKV-7's first layer compiles a graph of its own (v_first); the Transformer's layers share one
    graphs = {"rwkv7_tiny": per_layer, "transformer_tiny": per_layer[:1]}[config]
    assert len(matmuls) == len(graphs), matmuls
    assert totals[1] == totals[0] + sum(graphs), (totals, graphs)


@pytest.mark.parametrize("config", ["gsa_tiny", "transformer_tiny"])
def test_low_rank_without_low_rank_projections_is_refused(config):
    with pytest.raises(ConfigError) as e:
        forward_backward(config, "selective", recompute=["low_rank"])
    assert "'low_rank'" in str(e.value) and "\n" not in str(e.value)


def test_mlp_hidden_refuses_a_width_another_matmul_has():
    # the policy knows the MLP's matmuls by their shapes: an attention projection of the same shape would be
    # recomputed too, so such a model is refused with one line
    with pytest.raises(ConfigError) as e:
        forward_backward("transformer_tiny", "selective", recompute=["mlp_hidden"],
                         overrides=["--model.intermediate_size=128"])
    line = str(e.value)
    assert "training.recompute" in line and "128" in line and "\n" not in line


def test_chunk_tensors_tells_rwkv7s_chunk_op_to_keep_its_states_alone(monkeypatch):
    import flame.models.rwkv7 as rwkv7

    seen = []
    real = rwkv7.chunk_rwkv7
    monkeypatch.setattr(rwkv7, "chunk_rwkv7", lambda *a, settings=None, **k: seen.append(settings) or real(*a, **k))
    forward_backward("rwkv7_tiny", "selective")
    assert seen and all(s is None for s in seen)
    seen.clear()
    loss, grads, _ = forward_backward("rwkv7_tiny", "selective", recompute=["chunk_tensors"])
    assert seen and all(s is not None and not s.keep_chunk_tensors for s in seen)


@pytest.mark.parametrize("config, recompute, mode, expected", [
    ("rwkv7_tiny", '["mlp_hidden"]', "none", "'selective'"),
    ("rwkv7_tiny", '["chunk_tensors"]', "full", "'selective'"),
    ("gsa_tiny", '["chunk_tensors"]', "selective", "model.name = 'gsa'"),
    ("transformer_tiny", '["low_rank"]', "selective", "model.name = 'transformer'"),
    ("rwkv7_tiny", '["everything"]', "selective", "'mlp_hidden'"),
    ("rwkv7_tiny", '["low_rank", "mlp_hidden", "low_rank"]', "selective", "each part named once"),
])
def test_recompute_that_cannot_apply_is_one_line(config, recompute, mode, expected):
    with pytest.raises(ConfigError) as e:
        load_config(f"configs/{config}.toml", [f"--training.recompute={recompute}",
                                               f"--training.activation_checkpoint={mode}"])
    line = str(e.value)
    assert "training.recompute" in line and expected in line and "\n" not in line, line


@pytest.mark.gpu
def test_gpu_recompute_keeps_selectives_gradients(monkeypatch):
    # compiled RWKV-7 blocks on the GPU, where the chunk op is the Triton kernel: with every part recomputed the
    # kernel's backward forms its per-chunk tensors again, and loss and gradients stay selective's
    import torch._dynamo as dynamo

    import kernels.rwkv7.chunk as chunk
    from flame.parallel import compile_blocks

    formed_again = []
    real = chunk._chunk_tensors_again
    monkeypatch.setattr(chunk, "_chunk_tensors_again", lambda *a: formed_again.append(1) or real(*a))
    runs = {}
    for recompute in ((), ("mlp_hidden", "low_rank", "chunk_tensors")):
        cfg = load_config("configs/rwkv7_tiny.toml", ["--model.vocab_size=512"])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        model.init_weights()
        for block in model.layers:   # the zero-initialized output projections would hide the branches' gradients
            block.attn.o_proj.weight.data.normal_(std=0.02)
            block.ffn.value.weight.data.normal_(std=0.02)
        model.cuda()
        wrap_blocks(model, "selective", recompute)
        dynamo.reset()
        dynamo.utils.counters.clear()
        compile_blocks(model)
        ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
        loss = model(ids, labels=ids)
        loss.backward()
        assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])
        runs[recompute] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
        assert len(formed_again) == (len(model.layers) if recompute else 0), (recompute, len(formed_again))
    (loss, grads), (lean_loss, lean_grads) = runs.values()
    torch.testing.assert_close(lean_loss, loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        gap = (lean_grads[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert gap < 1e-4, (name, gap.item())
