"""A test helper that starts training jobs without paying torch's import each time: imports flame.train once, then
for each line of JSON arguments on stdin forks a job (its own session, output to the files named), prints its pid,
waits for it and prints "exit CODE" (negative: the signal that ended it).

Each job is a whole training process (one rank, no torchrun) that the test may kill at any moment with its session.
"""

from __future__ import annotations

import json
import os
import sys

import flame.train  # noqa: F401  (the slow imports, done once)


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            try:
                flame.train.main(job["args"])  # exits the process itself (os._exit)
            finally:
                os._exit(1)
        print(pid, flush=True)
        print(f"exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)


if __name__ == "__main__":
    main()
