"""Lesson 1 of the field: the same global batch, split any way, gives the same loss and the same update.

A global batch of 16 synthetic sequences whose numbers of ignored labels differ per sequence is trained for two steps
as (micro 16, GA 1, 1 rank), (micro 4, GA 4, 1 rank), (micro 2, GA 4, 2 ranks FSDP) and (micro 2, GA 4, 2 ranks
HSDP); and, cutting every row into pieces (context parallelism, a GSA with short convolutions: the ignored labels
fall unevenly on the pieces), as (micro 4, GA 2, 4 ranks: dp_replicate 2 x cp 2, HSDP over 2 x 2 shards). Each run's
logged loss, gradient norm and parameters are compared with a plain single-process PyTorch reference: mean cross
entropy over every target token, clipped AdamW steps.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from flame.config import load_config
from flame.data.synthetic import synthetic_sample
from flame.loss import IGNORE_INDEX
from flame.models import build_model
from tests.helpers import TINY, read_checkpoint, read_metrics, run_train, write_config

GLOBAL_BATCH = 16
CP_TINY = re.sub(r"\[model\].*?\n\n", """[model]
name = "gsa"
vocab_size = 512
hidden_size = 64
num_layers = 2
num_heads = 2
num_slots = 16
use_short_conv = true

""", TINY, flags=re.S).replace("seq_len = 32", "seq_len = 128")
"""A recurrent model (context parallelism needs one) at a seq_len cp 2 cuts into whole chunks; GSA keeps AdamW's
plain parameter groups, which the reference uses."""


STEPS = 2


def reference(cfg):
    """Per-step losses and gradient norms (before clipping) of the global batches and the parameters after STEPS
    clipped AdamW steps, computed with no trainer code but the model itself; also what a trainer averaging
    micro-batch means would log at the last step."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    torch.manual_seed(cfg.training.seed)
    model.init_weights()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0)
    losses, grad_norms = [], []
    for step in range(STEPS):
        pairs = [synthetic_sample(cfg.training.seed, step, i, cfg.training.seq_len, cfg.model.vocab_size)
                 for i in range(GLOBAL_BATCH)]
        inputs, labels = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        logits = model(inputs)  # the logits path: independent of the trainer's chunked loss
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        micro_means = [F.cross_entropy(logits[i:i + 4].flatten(0, 1), labels[i:i + 4].flatten(),
                                       ignore_index=IGNORE_INDEX) for i in range(0, GLOBAL_BATCH, 4)]
        mean_of_means = torch.stack(micro_means).mean().item()
        opt.zero_grad()
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm).item())
        opt.step()
        losses.append(loss.item())
    return losses, grad_norms, mean_of_means, {k: v.detach().clone() for k, v in model.state_dict().items()}


# a constant lr, so the reference needs no schedule
OVERRIDES = [f"--training.steps={STEPS}", "--lr_scheduler.decay_type=linear",
             "--lr_scheduler.min_lr_factor=1.0"]

SPLITS = [  # (micro batch, accumulation steps, ranks, dp_replicate)
    (16, 1, 1, 1),
    (4, 4, 1, 1),
    (2, 4, 2, 1),
    (2, 4, 2, 2),
]
CP_SPLITS = [  # (micro batch, accumulation steps, ranks, dp_replicate, context_parallel_degree)
    (4, 2, 4, 2, 2),  # cp 2 on 2 ranks alone: tests/test_context_parallel_train.py
]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    path, _ = write_config(tmp_path_factory.mktemp("ref"))
    cfg = load_config(path, OVERRIDES)
    return reference(cfg)


@pytest.fixture(scope="module")
def cp_ref(tmp_path_factory):
    path, _ = write_config(tmp_path_factory.mktemp("cp_ref"), text=CP_TINY)
    return reference(load_config(path, OVERRIDES))


@pytest.mark.parametrize("micro,ga,ranks,replicate", SPLITS, ids=lambda v: str(v))
def test_split_gives_reference_loss_and_update(tmp_path, ref, micro, ga, ranks, replicate):
    ref_losses, ref_grad_norms, mean_of_means, ref_params = ref
    # the setup can catch the bug: averaging micro-batch means (GA 4) is off by over 20x the tolerance (1e-6)
    assert abs(mean_of_means - ref_losses[-1]) / ref_losses[-1] > 20e-6
    assert abs(ref_losses[0] - math.log(512)) / math.log(512) < 0.1
    assert_run_gives_reference(tmp_path, ref, TINY, micro, ga, ranks, f"--parallelism.dp_replicate={replicate}")


@pytest.mark.parametrize("micro,ga,ranks,replicate,cp", CP_SPLITS, ids=lambda v: str(v))
def test_context_parallel_split_gives_reference_loss_and_update(tmp_path, cp_ref, micro, ga, ranks, replicate, cp):
    """Each target is counted on the one rank whose piece holds it, and the pieces' gradients sum to the row's."""
    assert_run_gives_reference(tmp_path, cp_ref, CP_TINY, micro, ga, ranks, f"--parallelism.dp_replicate={replicate}",
                               f"--parallelism.context_parallel_degree={cp}")


def assert_run_gives_reference(tmp_path, ref, text, micro, ga, ranks, *overrides):
    ref_losses, ref_grad_norms, _, ref_params = ref
    path, dump = write_config(tmp_path, text=text)
    seq_len = load_config(path).training.seq_len
    proc = run_train(path, *OVERRIDES, f"--training.batch_size={micro}", f"--training.gradient_accumulation_steps={ga}",
                     *overrides, nproc=ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record, ref_loss, ref_grad_norm in zip(records, ref_losses, ref_grad_norms):
        assert record["target_tokens"] < GLOBAL_BATCH * seq_len  # ignored labels really were excluded
        assert record["loss"] == pytest.approx(ref_loss, rel=1e-6)
        # the gradients' scale itself (clipping and AdamW would hide a gradient summed or averaged once too often)
        assert record["grad_norm"] == pytest.approx(ref_grad_norm, rel=1e-5)

    params = read_checkpoint(dump, STEPS)["model"]
    assert params.keys() == ref_params.keys()
    for name, expected in ref_params.items():
        got = params[name]
        err = (got - expected).norm() / expected.norm()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
