"""Context parallelism through scripts/launch.sh: 20 steps of the tiny GSA (short convolutions on: both the state and
the convolution's previous tokens cross the piece boundary) at training.seq_len 512 on packed text documents
(data.varlen: documents cross the boundary) repeat one process's losses with 2 ranks at context_parallel_degree 2;
SIGKILL and relaunch resume them bit for bit; the checkpoint resumes on one process (cp 1) with its data position;
resuming it as plain data parallelism stops with one line. Elsewhere: the model math (RWKV-7, RWKV-6, GSA,
gradients) against cp 1 in tests/test_context_parallel_models.py, cp x dp ranks against a plain PyTorch reference in
tests/test_loss_normalization.py, the config errors (also flame.check_config --world-size, launch.sh's check) in
tests/test_config.py.

The tiny config at a 512-token vocabulary (a byte BPE trained here on the sample's eval documents, so the embedding
and the head do not dominate the CPU time), one row per micro-batch, data read in the training process. The cp runs go
through the launcher; the others start flame.train directly (fewer processes to start on a 2-core machine).
"""

import json
import math
import os
import shutil
import signal
import time

import pytest

from tests.helpers import REPO, byte_bpe, launch_sh, read_metrics, run_processes, run_train, wait_for_step

CONFIG = REPO / "configs/gsa_tiny.toml"
RWKV7 = REPO / "configs/rwkv7_tiny.toml"
STEPS = 20
REL = 1e-5
"""cp 2 against cp 1 over 20 AdamW steps: the pieces' states meet in another order (fp32 rounding; measured at most
2e-7 relative on the losses, 6e-7 on the gradient norms); consecutive steps' losses differ by 1e-3 or more, so a
batch read twice or skipped shows."""


def tiny(dump, tokenizer, *overrides) -> list[str]:
    return [f"--job.dump_folder={dump}", f"--data.tokenizer={tokenizer}", "--model.vocab_size=512",
            "--model.hidden_size=64", "--model.num_slots=16", "--data.varlen=true", "--data.num_workers=0",
            "--training.batch_size=1", "--training.seq_len=512", f"--training.steps={STEPS}",
            "--checkpoint.interval=10", "--metrics.log_freq=1", f"--validation.freq={STEPS}", "--validation.steps=2",
            *overrides]


def launch(dump, *overrides, nproc, tokenizer, wait=True):
    return launch_sh(CONFIG, *tiny(dump, tokenizer, *overrides), nproc=nproc, wait=wait)


def by_step(dump) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump)}


def assert_close(got: dict, want: dict, steps) -> None:
    for s in steps:
        for key in ("loss", "grad_norm"):
            assert math.isclose(got[s][key], want[s][key], rel_tol=REL), \
                f"step {s}: {key} {got[s][key]} with cp, {want[s][key]} without"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    docs = [json.loads(line)["text"] for line in (REPO / "data/sample/eval/eval-00.jsonl").read_text().splitlines()]
    byte_bpe(docs, path, vocab_size=512)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer):
    """One process, cp 1."""
    dump = tmp_path_factory.mktemp("reference") / "run"
    proc = run_train(CONFIG, *tiny(dump, tokenizer))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump


@pytest.fixture(scope="module")
def cp2(tmp_path_factory, tokenizer):
    """2 ranks at cp 2, killed (SIGKILL, the whole job) two steps after its step-10 checkpoint, then launched again
    to the end. Returns its folder, a copy of the folder as the kill left it and the killed launch's metrics."""
    base = tmp_path_factory.mktemp("cp2")
    dump, killed = base / "run", base / "killed"
    job = launch(dump, "--parallelism.context_parallel_degree=2", nproc=2, tokenizer=tokenizer, wait=False)
    try:
        wait_for_step(dump, job, 12)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher; torchrun, the ranks and their workers end with it
        job.wait()
    start = time.time()
    while run_processes(dump):
        assert time.time() - start < 30, "the ranks outlived the launcher"
        time.sleep(0.1)
    assert not (dump / "checkpoint" / "step-20").exists()  # it really died mid-run
    shutil.copytree(dump, killed, ignore=shutil.ignore_patterns("logs"))
    before_kill = by_step(killed)
    again = launch(dump, "--parallelism.context_parallel_degree=2", nproc=2, tokenizer=tokenizer)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 10" in again.stdout
    return dump, killed, before_kill


def test_cp2_repeats_one_process_and_resumes_after_sigkill(reference, cp2):
    dump, _, before_kill = cp2
    want, got = by_step(reference), by_step(dump)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_close(got, want, range(1, STEPS + 1))
    # the steps after the checkpoint that the killed launch had logged come again, bit for bit
    for step in (11, 12):
        assert (got[step]["loss"], got[step]["grad_norm"]) == (before_kill[step]["loss"],
                                                               before_kill[step]["grad_norm"])
    # each target token counted once over the pieces; a rank that shares a row does not widen the global batch
    for step in got:
        assert got[step]["target_tokens"] == want[step]["target_tokens"]
        assert got[step]["tokens_seen"] == want[step]["tokens_seen"] == 512 * step
    (ev,), (ev_ref,) = read_metrics(dump, "eval_loss"), read_metrics(reference, "eval_loss")
    assert math.isclose(ev["eval_loss"], ev_ref["eval_loss"], rel_tol=REL)


def test_cp2_checkpoint_resumes_on_one_process_and_not_as_data_parallel(reference, cp2, tokenizer):
    _, killed, _ = cp2
    # cp 2 -> 2 data-parallel ranks: two data streams where the checkpoint has one: one line with the ways out
    proc = run_train(CONFIG, *tiny(killed, tokenizer), nproc=2)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line]  # (both ranks' stderr)
    assert line.startswith("error: checkpoint ") and "written by 1 data-parallel ranks" in line
    assert "this run has 2" in line and "--checkpoint.data_state=restart" in line
    # cp 2 -> one process: model and optimizer reshard, the one data stream continues where it was
    proc = run_train(CONFIG, *tiny(killed, tokenizer))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 10" in proc.stdout and "context_parallel_degree: 2" in proc.stdout
    assert_close(by_step(killed), by_step(reference), range(11, STEPS + 1))



def test_rwkv7_gather_repeats_one_process(tmp_path, tokenizer):
    """RWKV-7 with parallelism.context_parallel_exchange = "gather" (each rank computes its piece's transition and
    all-gathers states and last tokens; the other tests here run the default, the chain) and a unit per block
    (parallelism.fsdp_wrap = "blocks"; with cp the default is the whole model one unit): 2 ranks at cp 2 repeat one
    process's losses and gradient norms over 6 steps of packed documents crossing the boundary."""
    common = [f"--data.tokenizer={tokenizer}", "--model.vocab_size=512", "--data.varlen=true", "--data.num_workers=0",
              "--training.batch_size=1", "--training.seq_len=512", "--training.steps=6", "--checkpoint.enable=false",
              "--metrics.log_freq=1", "--validation.enable=false"]
    one = run_train(RWKV7, f"--job.dump_folder={tmp_path / 'one'}", *common)
    assert one.returncode == 0, one.stderr[-3000:]
    gather = run_train(RWKV7, f"--job.dump_folder={tmp_path / 'gather'}", *common,
                       "--parallelism.context_parallel_degree=2", "--parallelism.context_parallel_exchange=gather",
                       "--parallelism.fsdp_wrap=blocks", nproc=2)
    assert gather.returncode == 0, gather.stderr[-3000:]
    assert_close(by_step(tmp_path / "gather"), by_step(tmp_path / "one"), range(1, 7))
