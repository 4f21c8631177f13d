"""flame.lm_eval without network (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE): the local task in docs/lm_eval_task runs and
scores every item of its items.jsonl; a task whose data lives on the Hub stops with one line and exit code 2 that
names the dataset and the local task, not a traceback."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from flame.export import ModelState, write_export
from flame.models import build_model, model_args_class
from tests.helpers import REPO, run_script

pytest.importorskip("lm_eval", reason="lm-eval is not installed (flame's test extra installs it)")

TASK_DIR = REPO / "docs" / "lm_eval_task"
ITEMS = [json.loads(line) for line in (TASK_DIR / "items.jsonl").read_text().splitlines()]
# lm-eval's CLI in a process of its own (forked from the train_forks server, which has imported neither lm-eval nor
# huggingface_hub), run from FOLDER (its first argument) without network: the offline switches are set before
# lm-eval is imported, as the environment would set them. Its task index is limited to --include_path: indexing its
# thousands of built-in task files takes ~10 s and neither test uses them.
HARNESS = """
import os, sys
folder = sys.argv.pop(1)
os.chdir(folder)
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=os.path.join(folder, "hf_home"))
from lm_eval import tasks

class LocalTasksOnly(tasks.TaskManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "include_defaults": False})

tasks.TaskManager = LocalTasksOnly
from flame.lm_eval import main
main(sys.argv[1:])
"""
HUB_TASK = """task: flame_hub_only
dataset_path: flame-tests/not-cached-anywhere
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Transformer with the bundled GPT-NeoX tokenizer, as a fresh clone has it."""
    args = model_args_class("transformer")(name="transformer", vocab_size=50304, hidden_size=32, num_layers=1,
                                           num_heads=2)
    torch.manual_seed(0)
    m = build_model(args)
    m.init_weights()
    tokenizer = REPO / "data" / "tokenizer" / "gpt-neox-20b" / "tokenizer.json"
    return write_export(tmp_path_factory.mktemp("lm_eval_offline") / "export",
                        ModelState(args, dict(m.state_dict()), "test", tokenizer={"tokenizer.json": tokenizer}))


def harness(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return run_script(HARNESS, str(tmp_path), *args)


def test_the_local_task_runs_offline_on_every_item(model, tmp_path):
    assert len(ITEMS) >= 12 and {item["answer"] for item in ITEMS} == {0, 1, 2, 3}   # no position favoured
    proc = harness(tmp_path, "--model", "flame", "--model_args", f"pretrained={model}", "--device", "cpu",
                   "--tasks", "flame_sample_mc", "--include_path", str(TASK_DIR), "--output_path",
                   str(tmp_path / "out"), "--log_samples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_flame_sample_mc_*.jsonl")).open()]
    assert sorted(s["doc"]["question"] for s in samples) == sorted(item["question"] for item in ITEMS)
    # the harness's accuracy is the share of items whose highest log-likelihood is the target's
    picked = [max(range(len(s["resps"])), key=lambda i: float(s["resps"][i][0][0])) == s["doc"]["answer"]
              for s in samples]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["flame_sample_mc"]
    assert results["acc,none"] == pytest.approx(sum(picked) / len(ITEMS))


def test_a_hub_task_offline_is_one_line_and_exit_2(model, tmp_path):
    (tmp_path / "hub_task").mkdir()
    (tmp_path / "hub_task" / "hub.yaml").write_text(HUB_TASK)
    proc = harness(tmp_path, "--model", "flame", "--model_args", f"pretrained={model}", "--device", "cpu",
                   "--tasks", "flame_hub_only", "--include_path", str(tmp_path / "hub_task"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    assert "flame-tests/not-cached-anywhere" in errors[0]
    assert f"--include_path {TASK_DIR} --tasks flame_sample_mc" in errors[0]
