"""A test helper that starts training jobs without paying torch's import each time: imports flame.train once, then
for each line of JSON arguments on stdin forks a job (its own session, output to the files named, the environment
given), prints its pid, waits for it and prints "exit CODE" (negative: the signal that ended it).

Each job is a whole training process (one rank, no torchrun) that the test may kill at any moment with its session.
It ends as `python -m flame.train ARGS` would: its exit code, a traceback on stderr for an uncaught exception.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import flame.train  # noqa: F401  (the slow imports, done once)


def run_job(job: dict) -> None:
    """In the forked child: become the job, run it, never return."""
    code = 1
    try:
        os.setsid()
        if "env" in job:
            os.environ.clear()
            os.environ.update(job["env"])
        out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        flame.train.STARTED = time.perf_counter()  # "since launch" counts from the fork
        flame.train.main(job["args"])  # ends the process itself (os._exit) when it runs to its end
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


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_job(job)
        print(pid, flush=True)
        print(f"exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)


if __name__ == "__main__":
    main()
