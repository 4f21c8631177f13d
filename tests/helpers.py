"""Shared test helpers: tiny run configs and reading a run folder back."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
SMALL_TOKENIZER = REPO / "tests/assets/sample_bpe512.json"
"""byte_bpe(the sample's eval documents, vocab_size=512), saved (tests/data/test_data_tokenizer.py checks it). Tests of
the trainer's mechanics on the sample text use it: at GPT-NeoX's 50k vocabulary the tiny configs' embedding and head
are most of their parameters, so of every step, FSDP gather, optimizer update and checkpoint on the CPU."""
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun tells a rank; without them flame.train is a job of one rank."""
SMALL_VOCAB = [f"--data.tokenizer={SMALL_TOKENIZER}", "--model.vocab_size=512"]
"""Overrides: a tiny config on the sample text at SMALL_TOKENIZER's 512 tokens."""

TINY = """
[job]
name = "test"
dump_folder = "{dump}"

[model]
name = "transformer"
vocab_size = 512
hidden_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2

[data]
synthetic = true

[optimizer]
lr = 1e-3
weight_decay = 0.0

[lr_scheduler]
warmup_steps = 0

[training]
batch_size = 4
gradient_accumulation_steps = 1
seq_len = 32
steps = 1
max_norm = 1.0
seed = 7

[checkpoint]
enable = true
interval = 1000

[metrics]
log_freq = 1
"""


@contextlib.contextmanager
def one_rank(monkeypatch):
    """A job of one process (gloo on the CPU), as flame.train becomes without torchrun; yields its flame Dist."""
    import torch.distributed as dist

    from flame.config import ParallelismConfig
    from flame.parallel import init_distributed

    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    d = init_distributed(ParallelismConfig())
    try:
        yield d
    finally:
        dist.destroy_process_group()
        for k in DIST_ENV:
            os.environ.pop(k, None)


@pytest.fixture
def single_process(monkeypatch):
    """A Trainer built in the test's own process is a job of one rank; the env variables it sets are removed
    afterwards."""
    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    for k in DIST_ENV:
        os.environ.pop(k, None)


def write_config(tmp_path: Path, name: str = "run", text: str = TINY) -> tuple[Path, Path]:
    dump = tmp_path / name
    path = tmp_path / f"{name}.toml"
    path.write_text(text.format(dump=dump))
    return path, dump


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Imported by a test module (`from tests.helpers import one_thread`), it runs the module's tests on one torch
    thread: recurrences, decoding and the rwkv package's RNN mode are thousands of tiny ops, for which a second thread
    only adds overhead (10x on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def exit_line(capsys, main, argv) -> str:
    """The one stderr line of main(argv) exiting with code 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def one_error_line(capsys, main, argv, module: str | None = None) -> str:
    """main(argv) (with `module`: `python -m module` in a subprocess, the real entry point) exits 2 with one stderr
    line "error: ..." and nothing on stdout; returns stderr."""
    if module:
        r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=REPO, env=env(),
                           timeout=120)
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        code, (out, err) = exit_info.value.code, capsys.readouterr()
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert out == ""
    return err


def byte_bpe(texts, path: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on `texts` with EOS as its special token, saved as `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok


JOBS_SEE_GPUS = torch.cuda.is_available()
"""Whether the processes a test starts see this machine's GPUs: tests/conftest.py sets it for each test (on a GPU
machine, for the tests marked gpu only)."""


def env(without: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> dict:
    """A subprocess's environment: this one's, less the variables in `without`, plus `extra`."""
    # the repository first; what the caller's PYTHONPATH holds (packages installed to a --target folder) after it
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    e = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    if not JOBS_SEE_GPUS:  # as on a CPU-only machine (tests/conftest.py)
        e.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    for k in (*DIST_ENV, *without):
        e.pop(k, None)
    return dict(e, **(extra or {}))


def ranks_env(nproc: int) -> dict[str, str]:
    """What a job of `nproc` ranks adds to its environment: on a machine with a GPU but fewer than `nproc` of them (two
    ranks on a one-GPU machine), its ranks run on the CPU (gloo, Triton's interpreter), as on a CPU-only machine."""
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        return {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    return {}


def run_train(config: Path, *overrides: str, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """One training job of `nproc` ranks (gloo on CPU). On CPU its processes are `python -m flame.train` forked from
    this test process's tests/train_forks.py server, which has imported torch and flame once (seconds a rank), the
    ranks joined as torchrun joins them (env://); where its jobs see a GPU, a fresh process or torchrun."""
    cmd = [sys.executable, "-m", "flame.train", "--config", str(config), *overrides]
    if not JOBS_SEE_GPUS:
        return forked_train(cmd, timeout, nproc)
    if nproc > 1:  # a fork after CUDA's driver was touched cannot use it
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "flame.train"]
    return subprocess.run(cmd, cwd=REPO, env=env(extra=ranks_env(nproc)), capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TRAIN_SERVERS: dict[tuple[str, ...], subprocess.Popen] = {}


def train_server(without: tuple[str, ...] = ()) -> subprocess.Popen:
    """This process's tests/train_forks.py (started at first use, again if it has ended); with `without`, one of its
    own started in env(without) (TRITON_INTERPRET, say: Triton chooses interpreter or compiler at its import)."""
    server = _TRAIN_SERVERS.get(without)
    if server is None or server.poll() is not None:
        server = _TRAIN_SERVERS[without] = subprocess.Popen(
            [sys.executable, "-m", "tests.train_forks"], cwd=REPO, env=env(without), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, bufsize=0)
    return server


def read_line(stream, timeout: float) -> str | None:
    """One line of an unbuffered binary pipe, or None after `timeout` seconds."""
    line, deadline = b"", time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            return None
        byte = os.read(stream.fileno(), 1)
        if not byte:
            raise RuntimeError("tests/train_forks.py ended")
        line += byte
    return line.decode()


def run_script(script: str, *args: str, nproc: int = 1, timeout: int = 300, without: tuple[str, ...] = (),
               extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -c script ARGS` in a process of its own, or as a job of `nproc` ranks joined as torchrun joins them, in
    env(without) plus `extra`: on CPU forked from train_server(without) (torch and flame imported already), with
    GPUs in view a fresh process or torchrun."""
    cmd = [sys.executable, "-c", script, *args]
    if not JOBS_SEE_GPUS:
        return forked_train(cmd, timeout, nproc, script=script, without=without, extra=extra)
    e = env(without, {**ranks_env(nproc), **(extra or {})})
    if nproc == 1:
        return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as tmp:  # torchrun runs a file, not -c
        path = Path(tmp) / "script.py"
        path.write_text(script)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path),
               *args]
        return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)


def forked_train(cmd: list[str], timeout: float, nproc: int = 1, script: str | None = None,
                 without: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """cmd (`python -m flame.train ARGS`, or with `script`, `python -c script ARGS`) as a job of `nproc` ranks of
    train_server(without) in env(without) plus `extra`: the exit code (a failed rank's, or 0), and the ranks'
    stdout and stderr, one after the other."""
    server = train_server(without)
    base = env(without, extra)
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(free_port())}
        ranks = [{"stdout": f"{tmp}/stdout{r}", "stderr": f"{tmp}/stderr{r}",
                  "env": base if nproc == 1 else dict(base, RANK=str(r), LOCAL_RANK=str(r), **rendezvous)}
                 for r in range(nproc)]
        job = {"args": cmd[3:], "ranks": ranks, **({} if script is None else {"script": script})}
        server.stdin.write((json.dumps(job) + "\n").encode())
        # the pids come once the server has imported torch and flame: slow on a loaded machine, so the job's timeout
        started = read_line(server.stdout, timeout)
        if started is None:  # dropped: a late answer would be read as the next job's
            server.kill()
            _TRAIN_SERVERS.pop(without, None)
            raise subprocess.TimeoutExpired(cmd, timeout, "", "the tests' train server started no job")
        pids = [int(pid) for pid in started.split()]
        line = read_line(server.stdout, timeout)

        def output(name):
            return "".join(Path(r[name]).read_text() for r in ranks)

        if line is None:
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # this rank had ended
                    pass
            read_line(server.stdout, 60)
            raise subprocess.TimeoutExpired(cmd, timeout, output("stdout"), output("stderr"))
        code = next((int(c) for c in line.split()[1:] if c != "0"), 0)
        return subprocess.CompletedProcess(cmd, code, output("stdout"), output("stderr"))


def launch_sh(config, *args: str, nproc: int, wait: bool = True, timeout: int = 300, **extra_env: str):
    """scripts/launch.sh CONFIG ARGS with NPROC ranks, in a session of its own (so that a test can signal its whole
    process group): its CompletedProcess once it ends, or with wait=False the running Popen."""
    cmd = ["bash", "scripts/launch.sh", str(config), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(extra={"NPROC": str(nproc), **ranks_env(nproc), **extra_env}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_metrics(dump: Path, key: str = "loss") -> list[dict]:
    """The metrics.jsonl records that carry `key` (training steps by default; eval and checkpoint lines apart)."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if key in r]


def last_step(dump: Path) -> int:
    """The newest training step in a (running) run's metrics.jsonl; 0 before the first."""
    try:
        return max((r["step"] for r in read_metrics(dump)), default=0)
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return 0


def wait_for_step(dump, proc, step, timeout=240):
    """Wait until the run `proc` (still running) has logged `step`."""
    start = time.time()
    while last_step(dump) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - start < timeout, f"step {step} never came"
        time.sleep(0.05)


def run_processes(dump: Path) -> set[int]:
    """Every live process whose command line names the run folder: launcher, torchrun, ranks, data workers."""
    needle = f"--job.dump_folder={dump}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in cmdline and state != "Z":  # a zombie has ended; only its parent has not read its status
                pids.add(int(entry.name))
    return pids


def read_checkpoint(dump: Path, step: int) -> dict:
    """A DCP checkpoint as one plain dict of full tensors."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = dump / f"step-{step}.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", out)
    return torch.load(out, weights_only=False)


def assert_compiled_matches_eager(f, xs):
    """torch.compile (eager backend) of f gives f's output and gradients on xs (tensors requiring grad)."""
    import torch
    import torch._dynamo

    ref = f(*xs)
    ref_grads = torch.autograd.grad(ref, xs)
    torch._dynamo.reset()
    out = torch.compile(f, backend="eager")(*xs)
    grads = torch.autograd.grad(out, xs)
    torch.testing.assert_close(out, ref)
    for g, g0 in zip(grads, ref_grads):
        torch.testing.assert_close(g, g0)


def fla_logits_error(exported: Path, fla_dir: Path, vocab: int, dtype) -> float:
    """Relative error of FLA's own model (transformers' AutoModelForCausalLM on CUDA, in `dtype`) on the --to fla
    conversion of `exported`, against flame's fp32 logits from its PyTorch path on the CPU. 48 tokens: FLA runs its
    step-by-step (fused recurrent) kernels below 64, which keep fp32 exact."""
    import fla  # noqa: F401  (registers FLA's models with transformers)
    from transformers import AutoModelForCausalLM

    from flame.convert import main as convert
    from flame.export import load_exported

    convert([str(exported), str(fla_dir), "--to", "fla"])
    theirs = AutoModelForCausalLM.from_pretrained(fla_dir).cuda().to(dtype).eval()
    ours = load_exported(exported).eval()
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(ids)
        got = theirs(ids.cuda()).logits.float().cpu()
    err = ((got - want).norm() / want.norm()).item()
    print(f"{dtype}: FLA vs flame logits, relative error {err:.2e}")
    return err


def assert_gpu_path_matches_cpu_path(model, ids):
    """A CPU model (its PyTorch paths) moved to the GPU (its Triton kernels) gives the same logits (2e-3 relative),
    loss (1e-3) and per-parameter gradients (2e-2) on token ids `ids`."""
    cpu_logits = model(ids)
    cpu_loss = model(ids, labels=ids)
    cpu_loss.backward()
    cpu_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.cuda()
    gpu_logits = model(ids.cuda())
    gpu_loss = model(ids.cuda(), labels=ids.cuda())
    gpu_loss.backward()
    err = ((gpu_logits.cpu() - cpu_logits).norm() / cpu_logits.norm()).item()
    assert err < 2e-3, err
    assert abs(gpu_loss.item() - cpu_loss.item()) < 1e-3 * abs(cpu_loss.item())
    for n, p in model.named_parameters():
        g = cpu_grads[n]
        rel = ((p.grad.cpu() - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 2e-2, (n, rel)
