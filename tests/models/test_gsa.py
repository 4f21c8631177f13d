"""GSA model: meta-device init, fresh-init loss, packed documents, CPU path vs GPU kernel path, configs, a short
training run on the bundled sample."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flame.config import load_config
from flame.models import build_model, model_args_class
from tests.helpers import REPO, assert_gpu_path_matches_cpu_path, read_metrics, run_train


def tiny(vocab=512, hidden=64, layers=2, heads=2, slots=16, conv=True, seed=0, device="meta", output_gate=False):
    """Built as the trainer builds it: on the meta device, materialized, then init_weights()."""
    args = model_args_class("gsa")(name="gsa", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                                   num_heads=heads, num_slots=slots, use_short_conv=conv, output_gate=output_gate)
    args.validate()
    torch.manual_seed(seed)
    with torch.device(device):
        model = build_model(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))   # whatever init_weights misses stays NaN
    model.init_weights()
    return model


@pytest.mark.parametrize("output_gate", [False, True])
def test_init_weights_sets_every_parameter(output_gate):
    model = tiny(output_gate=output_gate)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"{name} not initialized by init_weights()"


def test_first_loss_is_near_ln_vocab():
    model = tiny(vocab=50304, hidden=128)
    ids = torch.randint(0, 50304, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids).item() / ids.numel()
    assert abs(loss - math.log(50304)) < 0.3, loss


@pytest.mark.parametrize("output_gate", [False, True])
def test_loss_sum_equals_cross_entropy_and_gradients_flow(output_gate):
    model = tiny(output_gate=output_gate)
    x, y = torch.randint(0, 512, (2, 40)), torch.randint(0, 512, (2, 40))
    y[0, 7:] = -100
    total = model(x, labels=y)
    ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-4)
    total.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name}: no gradient reaches it"


@pytest.mark.parametrize("conv", [False, True])
def test_packed_documents_equal_separate_runs(conv):
    model = tiny(conv=conv)
    a, b = torch.randint(0, 512, (1, 23)), torch.randint(0, 512, (1, 41))
    packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 23, 64]))
    torch.testing.assert_close(packed[:, :23], model(a), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[:, 23:], model(b), rtol=1e-4, atol=1e-4)
    # without cu_seqlens the second document sees the first: the check above is not vacuous
    assert not torch.allclose(model(torch.cat([a, b], 1))[:, 23:], model(b), rtol=1e-4, atol=1e-4)


def test_varlen_batch_rows_are_segments():
    # flame.data.packing's varlen batches: [B, T] rows with cu_seqlens over the flattened B*T tokens
    model = tiny()
    ids = torch.randint(0, 512, (2, 30))
    cu = torch.tensor([0, 12, 30, 41, 60])          # a segment starts at each row start and inside each row
    got = model(ids, cu_seqlens=cu)
    assert got.shape == (2, 30, 512)
    flat = ids.reshape(-1)
    ref = torch.cat([model(flat[a:b][None])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(got.reshape(60, -1), ref, rtol=1e-4, atol=1e-4)
    loss = model(ids, labels=ids, cu_seqlens=cu)
    ce = F.cross_entropy(got.flatten(0, 1), ids.flatten(), reduction="sum")
    torch.testing.assert_close(loss, ce, rtol=1e-5, atol=1e-4)


def test_flops_per_token_and_configs():
    for size, lo, hi in (("tiny", 5e6, 3e7), ("0.1B", 0.15e9, 0.18e9), ("0.4B", 0.38e9, 0.45e9),
                         ("0.6B", 0.58e9, 0.66e9)):
        cfg = load_config(REPO / f"configs/gsa_{size}.toml")
        with torch.device("meta"):
            model = build_model(cfg.model)
        assert lo < model.num_params() < hi, (size, model.num_params())
        # linear-time model: the same FLOPs per token at any length, above 6 x the matmul weights
        assert model.flops_per_token(1024) == model.flops_per_token(16384)
        assert model.flops_per_token(4096) > 6 * model.num_params(exclude_embedding=True)


@pytest.mark.gpu
def test_gpu_kernel_path_matches_cpu_path():
    model = tiny(hidden=256, layers=3, heads=2, slots=64, device="cpu")
    assert_gpu_path_matches_cpu_path(model, torch.randint(0, 512, (2, 300)))


@pytest.mark.gpu
def test_gpu_bf16_packed_training_step_is_finite():
    model = tiny(hidden=256, layers=2, heads=1, slots=64, device="cpu").cuda().bfloat16()
    ids = torch.randint(0, 512, (1, 2048), device="cuda")
    cu = torch.tensor([0, 100, 1500, 2048], device="cuda", dtype=torch.int32)
    model(ids, labels=ids, cu_seqlens=cu).backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n


def test_loss_falls_on_sample_data(tmp_path):
    # the trainer on the config as shipped (the launcher's part: tests/test_launch.py)
    dump = tmp_path / "run"
    proc = run_train(REPO / "configs/gsa_tiny.toml", "--training.steps=12", f"--job.dump_folder={dump}",
                     "--metrics.log_freq=1", "--checkpoint.enable=false", "--validation.enable=false",
                     "--training.seq_len=64", "--training.batch_size=4", "--lr_scheduler.warmup_steps=2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(dump) if "loss" in r]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert "FIRST LOSS" not in proc.stderr
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3   # single steps are noisy: means of three
    assert last < first - 1.0, losses
