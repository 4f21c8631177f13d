"""Config errors stop the run with exit code 2 and one line naming the file and the key; good configs round-trip."""

import subprocess

import pytest

from flame.config import ConfigError, load_config, parse_overrides, to_toml
from flame.train import main
from tests.helpers import REPO, env, exit_line, write_config


@pytest.mark.parametrize("override,key,expected", [
    ("--training.stepz=5", "training.stepz", "a known key"),
    ("--trainin.steps=5", "trainin", "a known section"),
    ("--training.steps=ten", "training.steps", "an integer"),
    ("--training.steps=2.5", "training.steps", "an integer"),
    ("--training.compile=1", "training.compile", "true or false"),
    ("--training.seq_len=0", "training.seq_len", "an integer >= 1"),
    ("--optimizer.lr=-1e-3", "optimizer.lr", "a number > 0"),
    ("--lr_scheduler.decay_type=exp", "lr_scheduler.decay_type", "one of 'linear', 'cosine', 'sqrt'"),
    ("--model.name=mamba", "model.name", "one of"),
    ("--model.num_heads=5", "model.num_heads", "a divisor of model.hidden_size"),
    ("--model.hidden_sise=64", "model.hidden_sise", "a known key"),
    ("--parallelism.dp_replicate=2", "parallelism", "dp_replicate * dp_shard = number of processes (1)"),
    ("--parallelism.context_parallel_degree=0", "parallelism.context_parallel_degree", "an integer >= 1"),
    ("--parallelism.context_parallel_exchange=ring", "parallelism.context_parallel_exchange",
     "one of 'gather', 'chain'"),
    ("--parallelism.context_parallel_degree=2", "parallelism.context_parallel_degree",
     "1 with model.name = 'transformer': context parallelism needs a recurrent model (rwkv7, rwkv6, gsa), got 2"),
])
def test_bad_value_exits_2_naming_file_and_key(tmp_path, capsys, override, key, expected):
    path, _ = write_config(tmp_path)
    line = exit_line(capsys, main, ["--config", str(path), override])
    assert str(path) in line and f" {key}: expected {expected}" in line


def test_bad_toml_and_missing_file(tmp_path, capsys):
    path, _ = write_config(tmp_path, text="[training]\nsteps = \n")
    assert "valid TOML" in exit_line(capsys, main, ["--config", str(path)])
    assert "an existing TOML file" in exit_line(capsys, main, ["--config", str(tmp_path / "nope.toml")])
    path, _ = write_config(tmp_path, text="[training]\nsteps = 10\n")  # no data source
    assert "data.sources: expected at least one" in exit_line(capsys, main, ["--config", str(path)])


def test_override_forms_and_types():
    assert parse_overrides(["--training.steps=100", "--optimizer.lr", "3e-4", "--job.name", "x y",
                            "--training.compile=true"]) == [
        ("training.steps", 100), ("optimizer.lr", 3e-4), ("job.name", "x y"), ("training.compile", True)]
    with pytest.raises(ConfigError):
        parse_overrides(["--training.steps"])


def test_int_accepted_for_float_and_resolved_config_round_trips(tmp_path):
    path, _ = write_config(tmp_path)
    cfg = load_config(path, ["--optimizer.lr=1", "--training.steps", "50", "--lr_scheduler.decay_ratio=0.2"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float) and cfg.training.steps == 50
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg


def test_every_shipped_config_is_valid():
    for path in sorted((REPO / "configs").glob("*.toml")):
        load_config(path)


def test_launcher_rejects_bad_config_before_starting(tmp_path):
    path, dump = write_config(tmp_path)
    proc = subprocess.run(["bash", "scripts/launch.sh", str(path), "--training.seq_len=0"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "training.seq_len: expected an integer >= 1, got 0" in proc.stderr
    assert not dump.exists()


@pytest.mark.parametrize("config,override,key,limit", [
    ("configs/rwkv7_0.6B.toml", "--model.head_dim=256", "model.head_dim", "chunk_rwkv7"),
    ("configs/rwkv6_1.5B.toml", "--model.head_dim=512", "model.head_dim", "chunk_rwkv6"),
    ("configs/gsa_tiny.toml", "--model.num_slots=512", "model.num_slots", "chunk_gsa"),
])
def test_head_sizes_beyond_the_kernels_stop_at_the_config(capsys, config, override, key, limit):
    """The config refuses what the Triton kernel would refuse at the first step, with the kernel's own limit."""
    from kernels.gsa.chunk import MAX_SLOTS
    from kernels.rwkv6.chunk import MAX_K as RWKV6_MAX_K
    from kernels.rwkv7.chunk import MAX_K as RWKV7_MAX_K

    most = {"chunk_rwkv7": RWKV7_MAX_K, "chunk_rwkv6": RWKV6_MAX_K, "chunk_gsa": MAX_SLOTS}[limit]
    line = exit_line(capsys, main, ["--config", str(REPO / config), override])
    assert line.endswith(f" {key}: expected at most {most} (the largest the Triton kernel builds), got "
                         f"{override.split('=')[1]}"), line


@pytest.mark.parametrize("overrides,world,expected", [
    (["--training.seq_len=320"], None,
     "training.seq_len: expected a multiple of 128 (context_parallel_degree 2 x 64: every rank's piece holds whole "
     "chunks), got 320"),
    ([], None, "parallelism: expected dp_replicate * dp_shard * context_parallel_degree = number of processes (1), "
     "got '1 * -1 (the rest) * 2'"),
    (["--parallelism.dp_shard=2"], "6", "parallelism: expected dp_replicate * dp_shard * context_parallel_degree = "
     "number of processes (6), got '1 * 2 * 2'"),
])
def test_context_parallel_layout_errors(capsys, monkeypatch, overrides, world, expected):
    """cp must cut seq_len into whole chunks and fit the processes with the data-parallel degrees: one line from
    flame.train and from flame.check_config --world-size (what launch.sh runs before any process starts)."""
    from flame.check_config import main as check_config

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", str(REPO / "configs/gsa_tiny.toml"), "--parallelism.context_parallel_degree=2", *overrides]
    want = f"config error: {REPO / 'configs/gsa_tiny.toml'}: {expected}"
    if world is None:
        assert exit_line(capsys, main, argv) == want
    assert exit_line(capsys, check_config, [*argv, "--no-data-check", "--world-size", world or "1"]) == want
