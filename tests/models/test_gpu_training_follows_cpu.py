"""Training on a GPU as users train (bf16 compute, compiled blocks, our Triton kernels, fused loss) against the CPU
path (fp32, the models' PyTorch ops: the reference), 200 steps of the bundled sample from the same initial weights
(drawn once, exported, given to both as checkpoint.init_from) and the same batches. Two checks:

- the loss: its mean over the last 100 steps agrees within TOLERANCE. The curves part early by bf16 noise that the
  high learning rate and Adam's eps 1e-18 amplify (the CPU's own curve moves by up to 0.02 with its thread count), so
  the bound catches a curve that ends worse, not a small drift;
- the weights: every parameter moved on the GPU by 1/2 to 2 times its CPU move (|W_200 - W_0|). A gradient that is
  dead on one path (a kernel that drops its decay gradient, a parameter cut from the graph) leaves the loss curve
  within noise at this size, but its parameter where it started.

The per-step gradient comparisons (assert_gpu_path_matches_cpu_path) judge each gradient's direction; these judge
the whole step over a run. On CPU they collect and skip."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flame.config import load_config
from flame.export import ModelState, read_run, write_export
from flame.models import build_model
from tests.helpers import REPO, env, read_metrics

STEPS = 200
LAST = 100
TOLERANCE = {"rwkv7_tiny": 0.05, "gsa_tiny": 0.05, "rwkv6_tiny": 0.08}
"""Largest allowed |GPU - CPU| of the mean loss over the last LAST steps (nats). One H200: 0.005 (RWKV-7), 0.003
(GSA), 0.011 (RWKV-6); RWKV-6 with its chunk op forced to the PyTorch path, or eager, about 0.02 and 0.05; RWKV-7 with
its decay logits' gradient zeroed 0.009 (which the loss does not see, and MOVED does)."""
MOVED = (0.5, 2.0)
"""Allowed |W_200 - W_0| on the GPU over the same on the CPU, every parameter. One H200: 0.79 to 1.17 (RWKV-7), 0.92
to 1.05 (GSA), 0.77 to 1.40 (RWKV-6); RWKV-7 with its decay logits' gradient zeroed: 0.00 for w1 and w2."""
CPU_THREADS = "4"   # the CPU's curve depends a little on its thread count


def initial_weights(config: str, folder):
    """The config's initial weights drawn on the CPU, as an export folder for checkpoint.init_from."""
    cfg = load_config(str(REPO / "configs" / f"{config}.toml"))
    model = build_model(cfg.model)
    torch.manual_seed(cfg.training.seed)
    model.init_weights()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_export(folder, ModelState(model.args, state, "initial weights"))
    return state


def train(config: str, device: str, dump, init) -> subprocess.Popen:
    """STEPS steps of `config` from `init` on `device`, a checkpoint at the end; "cpu" hides the GPU."""
    args = ["--config", str(REPO / "configs" / f"{config}.toml"), f"--training.steps={STEPS}",
            f"--job.dump_folder={dump}", "--metrics.log_freq=1", f"--checkpoint.interval={STEPS}",
            "--validation.enable=false", f"--checkpoint.init_from={init}",
            f"--training.compile={str(device == 'cuda').lower()}"]
    extra = dict(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=CPU_THREADS) if device == "cpu" else {}
    return subprocess.Popen([sys.executable, "-m", "flame.train", *args], cwd=REPO, env=env(extra=extra),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(TOLERANCE))
def test_gpu_training_follows_the_cpu(config, tmp_path):
    init = initial_weights(config, tmp_path / "init")
    runs = {device: train(config, device, tmp_path / device, tmp_path / "init") for device in ("cpu", "cuda")}
    try:
        for device, proc in runs.items():
            _, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"{device}: {err[-3000:]}"
    finally:   # a failed or timed-out run does not leave the other one training
        for proc in runs.values():
            proc.kill()
            proc.wait()
    losses = {d: [r["loss"] for r in read_metrics(tmp_path / d)] for d in runs}
    assert all(len(x) == STEPS for x in losses.values()), {d: len(x) for d, x in losses.items()}
    cpu, gpu = (sum(losses[d][-LAST:]) / LAST for d in ("cpu", "cuda"))
    assert cpu < losses["cpu"][0] - 1.0   # it learns: flat curves would agree trivially
    assert abs(gpu - cpu) <= TOLERANCE[config], (cpu, gpu)
    moved = {}
    final = {d: read_run(tmp_path / d).state for d in runs}
    for name, w0 in init.items():
        cpu_move = (final["cpu"][name] - w0).norm().item()
        if cpu_move > 0:
            moved[name] = (final["cuda"][name] - w0).norm().item() / cpu_move
    print(f"{config}: mean loss over the last {LAST} steps cpu {cpu:.4f} gpu {gpu:.4f}; GPU / CPU move "
          f"{min(moved.values()):.2f} to {max(moved.values()):.2f}")
    stuck = {n: round(r, 3) for n, r in moved.items() if not MOVED[0] <= r <= MOVED[1]}
    assert not stuck, stuck
