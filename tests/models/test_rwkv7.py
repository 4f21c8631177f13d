"""RWKV-7 model: fresh-init loss, packed documents, CPU path vs GPU kernel path, a short training run on the bundled
sample."""

from __future__ import annotations

import math

import pytest
import torch

from flame.models import build_model, model_args_class
from tests.helpers import REPO, assert_gpu_path_matches_cpu_path, read_metrics, run_train


def tiny(vocab=512, hidden=128, layers=2, seed=0):
    args = model_args_class("rwkv7")(name="rwkv7", vocab_size=vocab, hidden_size=hidden, num_layers=layers)
    args.validate()
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    return model


def test_first_loss_is_near_ln_vocab():
    # The RWKV-LM init (tiny embeddings, LayerNorm, orthogonal head of gain 0.5 sqrt(V/C)) starts at ~ln(V).
    model = tiny(vocab=50304)
    ids = torch.randint(0, 50304, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids).item() / ids.numel()
    assert abs(loss - math.log(50304)) < 0.3, loss


def test_decay_and_gradients_are_finite_and_flow():
    model = tiny()
    ids = torch.randint(0, 512, (2, 40))
    model(ids, labels=ids).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # the zero-initialized output projections receive gradient, so every branch can start learning
    assert model.layers[1].attn.o_proj.weight.grad.abs().sum() > 0
    assert model.layers[1].ffn.value.weight.grad.abs().sum() > 0


def test_joined_value_product_equals_the_two_products():
    # training joins v_proj and v1 into one product (TimeMix.value_and_gate_input); eval and decoding run them apart
    attn = tiny().layers[1].attn
    attn.v1.data.normal_(std=0.1)                      # zero at init: make the low-rank input non-trivial
    xv = torch.randn(2, 7, 128, requires_grad=True)
    v, v_low = attn.value_and_gate_input(xv)
    (v.square().sum() + (v_low ** 3).sum()).backward()
    with torch.no_grad():
        v_apart, v_low_apart = attn.value_and_gate_input(xv)
    torch.testing.assert_close(v, attn.v_proj(xv))
    torch.testing.assert_close(v_low, xv @ attn.v1)
    torch.testing.assert_close(v_apart, v.detach())
    torch.testing.assert_close(v_low_apart, v_low.detach())
    # xv's gradient: both products' gradients
    xv2 = xv.detach().requires_grad_(True)
    (attn.v_proj(xv2).square().sum() + ((xv2 @ attn.v1) ** 3).sum()).backward()
    torch.testing.assert_close(xv.grad, xv2.grad)


def test_packed_documents_equal_separate_runs():
    model = tiny()
    model.layers[0].attn.o_proj.weight.data.normal_(std=0.02)   # make the time-mix branch matter
    model.layers[1].attn.o_proj.weight.data.normal_(std=0.02)
    a, b = torch.randint(0, 512, (1, 23)), torch.randint(0, 512, (1, 41))
    packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 23, 64]))
    torch.testing.assert_close(packed[:, :23], model(a), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[:, 23:], model(b), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_kernel_path_matches_cpu_path():
    model = tiny(hidden=256, layers=3)
    for block in model.layers:
        block.attn.o_proj.weight.data.normal_(std=0.02)
        block.ffn.value.weight.data.normal_(std=0.02)
    assert_gpu_path_matches_cpu_path(model, torch.randint(0, 512, (2, 300)))


def test_loss_falls_on_sample_data(tmp_path):
    # the trainer on the config as shipped (the launcher's part: tests/test_launch.py)
    dump = tmp_path / "run"
    proc = run_train(REPO / "configs/rwkv7_tiny.toml", "--training.steps=12", f"--job.dump_folder={dump}",
                     "--metrics.log_freq=1", "--checkpoint.enable=false", "--validation.enable=false",
                     "--training.seq_len=64", "--lr_scheduler.warmup_steps=2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(dump) if "loss" in r]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert "FIRST LOSS" not in proc.stderr
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, losses
