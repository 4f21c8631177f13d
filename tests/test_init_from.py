"""checkpoint.init_from a run folder and an FLA / Hugging Face folder (a flame Transformer converted --to fla: a Llama
that transformers loads without FLA): the new run starts from exactly the source's weights, and its first loss is
the source model's loss on that first batch: flame's model for the run folder, transformers' Llama for the FLA one."""

import pytest
import torch
import torch.nn.functional as F

from flame.convert import read_model
from flame.data.synthetic import SyntheticLoader
from flame.loss import IGNORE_INDEX
from flame.models import build_model
from tests.helpers import read_checkpoint, read_metrics, run_script, run_train, write_config

SEED, SEQ_LEN, BATCH, VOCAB = 7, 32, 4, 512   # tests/helpers.py's TINY run
VANISHING_LR = "--optimizer.lr=1e-30"   # the new run's one step leaves its weights as it started


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A run folder whose weights are 2 steps away from the init that any run with this seed starts from."""
    path, dump = write_config(tmp_path_factory.mktemp("source"))
    proc = run_train(path, "--training.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump


def first_batch() -> dict[str, torch.Tensor]:
    """The synthetic batch of a TINY run's first step (one rank)."""
    loader = SyntheticLoader(seq_len=SEQ_LEN, batch_size=BATCH, grad_accum=1, dp_rank=0, dp_world=1, seed=SEED,
                             vocab_size=VOCAB)
    return next(loader)


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=IGNORE_INDEX).item()


def start_from(tmp_path, source) -> tuple[dict[str, torch.Tensor], float]:
    """A new run initialized from `source`: its weights as it started, and its first loss."""
    path, dump = write_config(tmp_path, "child")
    proc = run_train(path, "--training.steps=1", f"--checkpoint.init_from={source}", VANISHING_LR)
    assert proc.returncode == 0 and f"initialized from {source}" in proc.stdout, proc.stderr[-3000:]
    return read_checkpoint(dump, 1)["model"], read_metrics(dump)[0]["loss"]


def test_init_from_a_run_folder(tmp_path, source):
    weights, loss = start_from(tmp_path, source)
    trained = read_checkpoint(source, 2)["model"]
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in trained)

    # flame's model with the source's weights, on the first batch of the new run
    loaded = read_model(source)
    model = build_model(loaded.args)
    model.load_state_dict(loaded.state)
    batch = first_batch()
    with torch.no_grad():
        want = mean_loss(model(batch["input_ids"]), batch["labels"])
    assert loss == pytest.approx(want, rel=1e-5)
    assert loss != pytest.approx(read_metrics(source)[0]["loss"], rel=1e-3)   # not the fresh init's first loss


def test_init_from_an_fla_folder(tmp_path, source):
    from transformers import AutoModelForCausalLM

    fla = tmp_path / "llama"
    # flame.convert's command line (its main, as python -m runs it), forked from the train_forks server
    proc = run_script("from flame.convert import main; main()", str(source), str(fla), "--to", "fla", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights, loss = start_from(tmp_path, fla)
    trained = read_checkpoint(source, 2)["model"]   # the conversion is exact: the same tensors come back
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in trained)

    # transformers' own Llama on the folder, on the first batch of the new run (labels already shifted)
    llama = AutoModelForCausalLM.from_pretrained(fla, dtype=torch.float32).eval()
    batch = first_batch()
    with torch.no_grad():
        want = mean_loss(llama(batch["input_ids"]).logits, batch["labels"])
    assert loss == pytest.approx(want, rel=1e-5)
