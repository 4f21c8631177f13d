"""A one-node Slurm on this machine for the tests: Debian's slurm-wlm (munged, slurmctld, slurmd) run as root from a
temporary folder that holds the config, keys, state, spool and logs; nothing of the machine's own setup is used.

`start_cluster()` returns a SlurmCluster, or a one-line reason why it cannot run here (no root, no apt-get, a daemon
that did not come up: its last log line); every step has a timeout, so a broken set-up skips, never hangs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "squeue")
APT_TIMEOUT_S = 300
START_TIMEOUT_S = 30


def _missing() -> list[str]:
    return [name for name in DAEMONS if not shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]


def install_reason() -> str | None:
    """None when Slurm is here (installed now if it was missing and this is root with apt-get), else why not."""
    if os.geteuid() != 0:
        return "a test Slurm runs its daemons as root, and this is not root"
    if not _missing():
        return None
    if not shutil.which("apt-get"):
        return f"Slurm is not installed ({', '.join(_missing())} missing) and there is no apt-get to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=APT_TIMEOUT_S).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=APT_TIMEOUT_S)
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
            if proc.returncode != 0:
                return f"apt-get install slurm-wlm munge failed: {_last_line(proc.stderr or proc.stdout)}"
    except subprocess.TimeoutExpired:
        return f"apt-get install slurm-wlm munge took more than {APT_TIMEOUT_S} s"
    return f"still missing after apt-get install: {', '.join(_missing())}" if _missing() else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    root: Path
    """The temporary folder with slurm.conf, the munge key and socket, state, spool and logs."""
    node: str
    """The one node's name: this machine's short host name."""
    cpus: int
    """The node's CPUs: those this process may run on (slurmd drains a node configured with more than it has)."""

    @property
    def env(self) -> dict:
        """Environment for Slurm's client commands (sbatch, scontrol, ...) and the jobs they submit."""
        return dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"))

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict of its Key=Value fields (JobState, Restarts, Reason, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def logs_tail(self) -> str:
        tails = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.is_file():
                tails.append(f"{name}: {_last_line(path.read_text(errors='replace'))}")
        return "; ".join(tails) or "no daemon log written"

    def stop(self) -> None:
        """Cancel every job, end the daemons (TERM, then KILL), remove the folder."""
        try:
            self.run("scancel", "--full", "--user=root", timeout=10)
            deadline = time.time() + 15
            while time.time() < deadline and self.run("squeue", "-h", timeout=10).stdout.strip():
                time.sleep(0.2)
        except (subprocess.TimeoutExpired, OSError):
            pass
        pids = []
        for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            try:
                pids.append(int((self.root / name).read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _config(root: Path, node: str, cpus: int) -> str:
    return f"""\
ClusterName=flametest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster() -> SlurmCluster | str:
    """A running one-node Slurm whose node is idle, or the one-line reason there is none."""
    reason = install_reason()
    if reason:
        return reason
    root = Path(tempfile.mkdtemp(prefix="flame-slurm-"))
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    cpus = len(os.sched_getaffinity(0))
    conf.write_text(_config(root, node, cpus))
    cluster = SlurmCluster(root, node, cpus)
    sbin = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    daemons = [
        ["munged", "--force", f"--socket={root}/munge.socket", f"--key-file={key}", f"--pid-file={root}/munged.pid",
         f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
        ["slurmctld", "-f", str(conf), "-i"],  # -i: no state to recover
        ["slurmd", "-f", str(conf), "-N", node],
    ]
    try:
        for cmd in daemons:
            cmd[0] = shutil.which(cmd[0], path=sbin)
            proc = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
            if proc.returncode != 0:
                reason = f"{Path(cmd[0]).name} did not start: {_last_line(proc.stderr + proc.stdout)}"
                break
        else:
            deadline = time.time() + START_TIMEOUT_S
            while "idle" not in cluster.run("sinfo", "-h", "-o", "%t", timeout=10).stdout:
                if time.time() > deadline:
                    reason = f"the node never became idle in {START_TIMEOUT_S} s ({cluster.logs_tail()})"
                    break
                time.sleep(0.2)
    except (subprocess.TimeoutExpired, OSError) as e:
        reason = f"Slurm did not start: {e} ({cluster.logs_tail()})"
    if reason:
        cluster.stop()
        return reason
    return cluster
