"""RWKV-6 on a GPU: the model's Triton path against its PyTorch path on the CPU (logits, loss, every gradient), and the
model through RWKV-LM's format and back: bit-exact weights, the same GPU logits, and the rwkv package's own x060 math
(plain PyTorch, on the GPU) on the converted .pth giving flame's GPU logits. On CPU these tests collect and skip."""

from __future__ import annotations

import pytest
import torch

from flame.export import ModelState, load_exported, write_export
from tests.convert_helpers import assert_same_export, convert, rwkv_package_x060
from tests.helpers import assert_gpu_path_matches_cpu_path
from tests.tiny_models import tiny_model, wake_branches

VOCAB = 512
T = 300   # not a multiple of any chunk size: the last chunk is partial


def tiny(hidden=256, layers=3, head_dim=64, seed=0):
    """A random RWKV-6 whose every branch matters: the output projections, channel-mix gate and low-rank paths,
    zero at init, made small random."""
    return wake_branches(tiny_model("rwkv6", seed, vocab_size=VOCAB, hidden_size=hidden, num_layers=layers,
                                    head_dim=head_dim), 0.02)


def rwkv_lm_round_trip(model, tmp_path, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`model` exported, converted to an RWKV-LM .pth and back; returns its logits on `device`, the round-tripped
    model's there, and the rwkv package's on the .pth there (one row of T tokens)."""
    export = tmp_path / "export"
    write_export(export, ModelState(model.args, {k: v.detach().clone() for k, v in model.state_dict().items()},
                                    "test"))
    convert(export, tmp_path / "model.pth", "--to", "rwkv-lm")
    convert(tmp_path / "model.pth", tmp_path / "back")
    assert_same_export(export, tmp_path / "back")   # every tensor bit-exact
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.to(device).eval()(ids.to(device))[0].cpu()
        back = load_exported(tmp_path / "back").to(device).eval()(ids.to(device))[0].cpu()
        package = rwkv_package_x060(tmp_path / "model.pth", f"{device} fp32")
        theirs, _ = package.forward(ids[0].tolist(), None, full_output=True)
    return ours, back, theirs.float().cpu()


@pytest.mark.gpu
def test_gpu_kernel_path_matches_cpu_path():
    assert_gpu_path_matches_cpu_path(tiny(), torch.randint(0, VOCAB, (2, T)))


@pytest.mark.gpu
def test_rwkv_lm_round_trip_gives_the_same_gpu_logits(tmp_path):
    ours, back, theirs = rwkv_lm_round_trip(tiny(), tmp_path, "cuda")
    torch.testing.assert_close(back, ours)   # the same weights through the same kernels
    err = ((theirs - ours).norm() / ours.norm()).item()   # tf32 products in flame's kernels, fp32 in the package's
    assert err < 2e-3, err
