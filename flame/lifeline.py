"""A run's processes end with their launcher: scripts/launch.sh -> torchrun -> ranks -> data workers.

Each link asks Linux for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), so killing the launcher in any way
(SIGKILL, its whole process group) ends the whole chain; torchrun starts the ranks in sessions of their own, which a
signal to the launcher's process group never reaches. `python -m flame.lifeline MODULE ARGS...` runs MODULE (torchrun)
bound to the process named by $FLAME_PARENT_PID; the ranks bind to it in turn through the same variable.
"""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import sys

PARENT_ENV = "FLAME_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (parent_pid) ends; exit now if it has already ended."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request above: it will never fire
        os._exit(1)


def die_with_launcher() -> None:
    """Bind to the parent named in $FLAME_PARENT_PID (set by the launcher chain), if any; the variable is consumed so
    that this process' own children do not take it for theirs."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent:
        die_with_parent(int(parent))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m flame.lifeline MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    die_with_launcher()
    os.environ[PARENT_ENV] = str(os.getpid())  # the module's children (the ranks) bind to this process
    # A preemption notice is for the ranks (they save, flame.stop_signals); srun delivers a job step's signal to every
    # process of the step, and USR1's default action would end torchrun and with it the ranks, unsaved.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # a rank's exit code 2 is a foreseen error it has said in one line: torchrun's own "failed (exitcode: 2)" log
    # line after it would read as a second, unexplained failure
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: "failed (exitcode: 2)" not in record.getMessage())
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ChildFailedError as e:
        # exit code 2: a rank stopped on a foreseen start-up error and said why in one line; torchrun's traceback and
        # failure report would bury that line, and its exit code 1 would hide the kind of failure
        if e.get_first_failure()[1].exitcode == 2:
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
