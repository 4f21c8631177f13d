"""A test helper that starts training jobs without paying torch's import each time: imports flame.train once, then
for each line of JSON on stdin forks a job's processes (each in its own session, output to the files named, the
environment given), prints their pids on one line, waits for them and prints "exit CODE ..." (one code a process;
negative: the signal that ended it).

A job is {"args": [...], "stdout": PATH, "stderr": PATH, "env": {...}} (one process), or {"args": [...], "ranks":
[{"stdout", "stderr", "env"}, ...]}: the ranks of one job, each env naming its RANK, WORLD_SIZE and the rendezvous
(MASTER_ADDR, MASTER_PORT), as torchrun's env:// set-up does. Each process is a whole training process (no
torchrun) that the test may kill at any moment with its session. It ends as `python -m flame.train ARGS` would: its
exit code, a traceback on stderr for an uncaught exception. As torchrun does, once a rank has failed the others get
30 s to end by themselves before they are killed. With "script": CODE, a job runs `python -c CODE ARGS` instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import flame.train  # noqa: F401  (the slow imports, done once)
# and the imports every job would make after it starts (a second or more each on 2 cores): Dynamo (building a model
# on the meta device goes through torch's reference ops), torchtitan's checkpointing (prepare_blocks) and its LR
# scheduler container (flame.optim)
import flame.activation_checkpoint  # noqa: F401
import torch._dynamo  # noqa: F401
import torchtitan.components.optimizer.lr_scheduler  # noqa: F401

GRACE = 30.0
"""Seconds the other ranks of a job get to end after one has failed, before they are killed."""


def run_job(args: list[str], out: dict, script: str | None = None) -> None:
    """In the forked child: become the job's process (out: its stdout, stderr and env), run flame.train (or
    `script` as `python -c` runs it), never return."""
    code = 1
    try:
        os.setsid()
        if "env" in out:
            os.environ.clear()
            os.environ.update(out["env"])
        stdout = os.open(out["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        stderr = os.open(out["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        if script is not None:
            sys.argv = ["-c", *args]
            exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
        else:
            flame.train.STARTED = time.perf_counter()  # "since launch" counts from the fork
            flame.train.main(args)  # ends the process itself (os._exit) when it runs to its end
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (as the interpreter would: the traceback, exit 1)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_all(pids: list[int]) -> list[int]:
    """The exit codes of the job's processes, in order; after a failure the others are killed GRACE s later."""
    codes: dict[int, int] = {}
    kill_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG) if kill_at is not None else os.waitpid(-1, 0)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and kill_at is None:
                kill_at = time.monotonic() + GRACE
        elif time.monotonic() > kill_at:
            for p in set(pids) - set(codes):
                try:
                    os.killpg(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kill_at = float("inf")
        else:
            time.sleep(0.05)
    return [codes[p] for p in pids]


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for out in job.get("ranks", [job]):
            pid = os.fork()
            if pid == 0:
                run_job(job["args"], out, job.get("script"))
            pids.append(pid)
        print(*pids, flush=True)
        print("exit", *wait_all(pids), flush=True)


if __name__ == "__main__":
    main()
