"""Two nodes on one machine: two `scripts/launch.sh` with NNODES=2 and NODE_RANK 0 / 1 joining at 127.0.0.1 (one CPU
process each, gloo, HSDP dp_replicate=2) train as one node of two processes does, their checkpoint resumes on one
node, and flame.export / flame.convert read it from the shared run folder, or name the shard a node did not share.
The one-node runs are two ranks started as torchrun starts them (tests.helpers.run_train): the launcher on one node
is tested elsewhere."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from flame.convert import main as convert
from flame.export import main as export
from flame.export import read_export
from tests.helpers import REPO, env, free_port, read_checkpoint, read_metrics, run_train, write_config

HSDP = ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=1"]
ARGS = ["--training.batch_size=2", "--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_factor=1.0",
        "--checkpoint.interval=2"]
TOOLS = {"flame.export": export, "flame.convert": convert}


def launch_node(config, *overrides: str, node_rank: int, port: int) -> subprocess.Popen:
    """scripts/launch.sh as node `node_rank` of 2 nodes of one CPU process each."""
    extra = {"NPROC": "1", "NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "RDZV_ID": f"two-nodes-{port}"}
    return subprocess.Popen(["bash", "scripts/launch.sh", str(config), *ARGS, *overrides], cwd=REPO,
                            env=env(extra=extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def one_node(config, *overrides: str) -> subprocess.CompletedProcess:
    """Two processes on one node."""
    return run_train(config, *ARGS, *overrides, nproc=2, timeout=240)


def losses(dump) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}  # a resumed run's line wins over an earlier one


def test_two_nodes_train_as_one_node_then_export_and_resume_on_one_node(tmp_path, capsys):
    """One test, so that parallel test workers never run the launches twice."""
    # 2 steps on two nodes of one process each (checkpoint at step 2), beside 4 uninterrupted steps on one node of
    # two processes with the same layout and global batch
    config, dump = write_config(tmp_path, "two_nodes")
    port = free_port()
    nodes = [launch_node(config, *HSDP, "--training.steps=2", node_rank=r, port=port) for r in (0, 1)]
    straight_config, straight = write_config(tmp_path, "one_node")
    reference = one_node(straight_config, *HSDP, "--training.steps=4")
    assert reference.returncode == 0, reference.stderr[-3000:]
    outputs = ""
    for r, proc in enumerate(nodes):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"node {r}: " + out[-1500:] + err[-3000:]
        assert "on 2 node(s) x 1 process(es)" in out
        outputs += out
    assert "2 ranks on cpu (replicate x shard = (2, 1))" in outputs  # the nodes joined one job (rank 0 prints)

    expected = losses(straight)
    # the same 2 data-parallel ranks, each with its own stream, whichever node they run on: the loss (over the global
    # target tokens) differs at most by reduction order
    assert sorted(losses(dump)) == [1, 2]
    assert read_metrics(dump)[-1]["tokens_seen"] == 2 * 2 * 2 * 32  # steps x ranks x batch x seq_len
    for step in (1, 2):
        assert losses(dump)[step] == pytest.approx(expected[step], rel=1e-6, abs=0)
    assert {p.name for p in (dump / "checkpoint" / "step-2").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert sorted(p.name.rsplit("-", 1)[1] for p in (dump / "logs").iterdir()) == ["node0", "node1"]  # one a node

    exports_from_the_shared_run_folder(dump, tmp_path, capsys)

    # one node of two processes, plain FSDP now (DCP reshards): the run goes on with the uninterrupted run's losses
    resumed = one_node(config, "--training.steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(replicate x shard = (1, 2))" in resumed.stdout and "resumed from step 2" in resumed.stdout
    got = losses(dump)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=0)


def exports_from_the_shared_run_folder(dump, tmp_path, capsys):
    """flame.export and flame.convert read both nodes' shards from the run folder; without one node's shards (a run
    folder that was not shared), one line naming the missing file and exit code 2."""
    weights = read_checkpoint(dump, 2)["model"]
    for name, main in TOOLS.items():
        out = tmp_path / name
        main([str(dump), str(out)])
        state = read_export(out).state
        assert state.keys() == weights.keys() and all(state[k].equal(weights[k].float()) for k in weights)

    unshared = tmp_path / "unshared"
    shutil.copytree(dump / "checkpoint" / "step-2", unshared / "checkpoint" / "step-2")
    shutil.copy(dump / "config.toml", unshared / "config.toml")
    (unshared / "checkpoint" / "step-2" / "__1_0.distcp").unlink()
    capsys.readouterr()
    for name, main in TOOLS.items():
        out = tmp_path / f"unshared-{name}"
        with pytest.raises(SystemExit) as stop:
            main([str(unshared), str(out)])
        assert stop.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and "step-2" in line and "__1_0.distcp" in line and "share" in line, line
        assert "__0_0.distcp" not in line and not out.exists()
