"""One run per run folder: rank 0 holds an exclusive lock (flock) on {dump_folder}/.lock for the whole run.

The file names its holder ("host pid"). The kernel drops the lock when the holder's process ends however it ends,
so a file left naming a dead process is simply taken over (with a notice); a clean exit empties it.
`python -m flame.run_lock DIR` is the launcher's check before it starts any process: exit 2 and one line if DIR is in
use.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from flame.config import RunError

LOCK_NAME = ".lock"
ENDING_WAIT_S = 10.0
"""How long a lock whose holder is ending (gone or exiting) is waited for before the folder counts as in use."""


def holder_is_ending(holder: str) -> bool:
    """The holder named in the lock file ran on this host and is gone or exiting (no command line left): the lock is
    still held only by processes being torn down, a run killed a moment ago whose data workers (which inherit the
    lock's file) have not finished exiting. False where /proc cannot tell."""
    host, _, pid = holder.partition(" ")
    if host != socket.gethostname() or not pid.isdigit() or not Path("/proc/self").exists():
        return False
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.file = None

    def acquire(self) -> tuple[bool, str]:
        """(True, previous holder left in the file or "") when taken, (False, holder) when another process has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # no truncation: the holder's line stays readable
        deadline = time.monotonic() + ENDING_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "unknown holder"
                if holder_is_ending(holder) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                f.close()
                return False, holder
        f.seek(0)
        previous = f.read().strip()
        self.file = f
        return True, previous

    def write_holder(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{socket.gethostname()} {os.getpid()}\n")
        self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            self.file.truncate(0)
            self.file.close()  # closing drops the lock
            self.file = None


def describe(holder: str) -> str:
    host, _, pid = holder.partition(" ")
    return f"host {host}, pid {pid}" if pid else holder


def in_use_message(run_dir: Path, holder: str) -> str:
    return (f"run folder {run_dir} is in use by another run ({describe(holder)}; lock {Path(run_dir) / LOCK_NAME}): "
            "stop that run first, or choose another job.dump_folder")


def lock_run_folder(run_dir: Path, rank: int) -> RunLock | None:
    """Rank 0 takes the lock and keeps it (the returned RunLock; None on other ranks). Every rank learns the outcome
    through one broadcast, so no rank waits for a peer that has stopped: a folder in use raises RunError on all."""
    import torch.distributed as dist

    lock, outcome = None, [None]
    if rank == 0:
        lock = RunLock(run_dir)
        taken, holder = lock.acquire()
        if taken:
            lock.write_holder()
            if holder:
                print(f"run folder {run_dir}: took over the lock left by {describe(holder)}, which is no longer "
                      "running", flush=True)
        else:
            lock, outcome = None, [holder]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RunError(in_use_message(run_dir, outcome[0]))
    return lock


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m flame.run_lock RUN_FOLDER", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(sys.argv[1])
    if not (run_dir / LOCK_NAME).exists():
        return
    lock = RunLock(run_dir)
    taken, holder = lock.acquire()
    if not taken:
        print(f"error: {in_use_message(run_dir, holder)}", file=sys.stderr)
        sys.exit(2)
    lock.file.close()  # only a check: the run's rank 0 takes the lock for good


if __name__ == "__main__":
    main()
