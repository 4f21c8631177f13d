"""scripts/slurm.sbatch under a real Slurm (tests/slurm_cluster.py: one node on this machine; the tiny config, two CPU
ranks with gloo, the bundled sample text): USR1 to the batch script (Slurm's preemption notice) stops every rank after
its step with a checkpoint, the job requeues itself, the requeued start resumes and ends the job without another
requeue, and the job's losses are a plain scripts/launch.sh run's, step for step."""

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, SMALL_VOCAB, env, read_metrics
from tests.slurm_cluster import SlurmCluster, start_cluster

CONFIG = "configs/transformer_tiny.toml"
STEPS = 20
"""The notice comes after step 2 and takes a step or two to reach every rank: at 5 steps the run could end first
(the tiny steps are fast on an idle machine), and the job then completed without its requeue."""
ARGS = [*SMALL_VOCAB, f"--training.steps={STEPS}", "--training.seq_len=64", "--training.batch_size=2", "--validation.enable=false", "--metrics.log_freq=1",
        "--lr_scheduler.warmup_steps=1", "--data.num_workers=1", "--checkpoint.interval=1000"]
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def slurm():
    cluster = start_cluster()
    if isinstance(cluster, str):
        pytest.skip(f"no test Slurm: {cluster}")
    yield cluster
    cluster.stop()


def cpu_env() -> dict:
    return env(extra=dict(NPROC="2", CUDA_VISIBLE_DEVICES=""))


def submit(slurm: SlurmCluster, dump: Path, out: Path) -> str:
    with socket.socket() as s:  # the job's rendezvous port: not the default 29500 another test may hold
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job_env = dict(cpu_env(), SLURM_CONF=slurm.env["SLURM_CONF"], MASTER_PORT=str(port))
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={slurm.cpus}",
           f"--output={out}", "scripts/slurm.sbatch", CONFIG, f"--job.dump_folder={dump}", *ARGS]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_for(slurm: SlurmCluster, job_id: str, out: Path, done, what: str) -> dict:
    """Poll `scontrol show job` until done(fields); fail with the job's output if it takes too long."""
    start = time.time()
    while not done(job := slurm.job(job_id)):
        assert time.time() - start < JOB_TIMEOUT_S, f"job {job_id}: {what} never came ({job.get('JobState')}):\n" \
            + (out.read_text()[-3000:] if out.exists() else "no output")
        time.sleep(0.2)
    return job


def finished(job: dict) -> bool:
    return job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def losses(dump: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(dump)]


def last_step(dump: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(dump)), default=0)
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return 0


def test_sbatch_trains_like_launch_sh_and_a_preempted_job_requeues_and_resumes_exactly(slurm, tmp_path):
    # the plain launcher on this machine, outside Slurm, at the same time as the batch job
    plain_dump = tmp_path / "plain"
    plain = subprocess.Popen(["bash", "scripts/launch.sh", CONFIG, f"--job.dump_folder={plain_dump}", *ARGS],
                             cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # a preemption notice mid-run: USR1 to the batch script alone, as Slurm's --signal=B:USR1@... sends it
    dump, out = tmp_path / "preempted", tmp_path / "preempted.out"
    job_id = submit(slurm, dump, out)
    start = time.time()
    while last_step(dump) < 2:
        assert not finished(slurm.job(job_id)), out.read_text()[-3000:]
        assert time.time() - start < JOB_TIMEOUT_S, "no step came"
        time.sleep(0.1)
    signal = slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    assert signal.returncode == 0, signal.stderr
    requeued = ("PENDING", "1")
    wait_for(slurm, job_id, out, lambda j: (j.get("JobState"), j.get("Restarts")) == requeued, "the requeue")
    stopped_at = last_step(dump)
    assert 2 <= stopped_at < STEPS, out.read_text()[-3000:]
    assert (dump / "checkpoint" / f"step-{stopped_at}").is_dir()
    assert "2 ranks on cpu (replicate x shard = (1, 2))" in out.read_text()  # one node of the job, NPROC ranks on it
    # Slurm holds a requeued job for about two minutes (its BeginTime): start it now, but in a later second than the
    # end of its first start (slurmd refuses a credential issued in the same second as the one it revoked then)
    time.sleep(1.5)
    assert slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
    job = wait_for(slurm, job_id, out, finished, "the end of the requeued start")
    log = out.read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        log[-3000:] + slurm.logs_tail()
    assert f"stopped at step {stopped_at} on signal SIGUSR1" in log
    assert f"requeueing job {job_id}" in log and f"job {job_id}, start 2" in log
    assert f"resuming run {dump} from step {stopped_at}" in log
    assert log.count("requeueing job") == 1  # a start that reaches training.steps ends the job
    output, _ = plain.communicate(timeout=JOB_TIMEOUT_S)
    assert plain.returncode == 0, output[-3000:]
    expected = losses(plain_dump)
    assert [step for step, _ in expected] == list(range(1, STEPS + 1))
    assert losses(dump) == expected  # every step once, each loss as the uninterrupted plain run's
