"""A hung or lost rank fails the job within parallelism.collective_timeout_sec, naming the ranks that did not arrive.

Every rank meets the others at the start of each step on a gloo group of its own (torch's monitored_barrier: rank 0
collects every rank and names those missing). A rank that stops between steps (data, a stuck file system, a
debugger) is named there. One that stops inside a step leaves the others in a collective, which fails after the
process group's timeout (the same seconds); on CPU that failure comes back here, and one more monitored barrier
names who is missing. (On GPU, NCCL's watchdog ends the processes after that timeout with its own message.)
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

from flame.checkpoint import first_line
from flame.config import RunError

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
PROBE_SEC = 10.0
"""The longest a probe after a failed collective waits: the ranks alive have already waited the full timeout."""


class RankMissing(RunError):
    """Some rank did not arrive in time (its message names it when this rank could tell)."""


class Heartbeat:
    def __init__(self, timeout_sec: float):
        self.timeout_sec = timeout_sec
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_sec))

    def arrive(self, step: int) -> None:
        """Every rank reaches step `step` within the timeout, or RankMissing on every rank that did."""
        if self.group is not None:
            self._barrier(self.timeout_sec, f"at step {step}")

    def explain(self, step: int, error: BaseException) -> None:
        """After a collective failed in step `step`: RankMissing naming the ranks that no longer answer; returns
        (the caller re-raises `error`) when every rank is there, i.e. the failure was something else."""
        if self.group is not None:
            self._barrier(min(self.timeout_sec, PROBE_SEC), f"in step {step} ({first_line(error)})")

    def _barrier(self, seconds: float, where: str) -> None:
        try:
            dist.monitored_barrier(self.group, timeout=timedelta(seconds=seconds), wait_all_ranks=True)
        except RuntimeError as e:
            found = _MISSING.search(str(e))
            if found:
                ranks = found.group(1).strip()
                who = f"rank{'s' if ',' in ranks else ''} {ranks}"
            elif dist.get_rank() == 0:  # a peer's connection broke before the probe's own timeout
                who = f"a rank ({first_line(e)})"
            else:  # only rank 0 can tell which ranks are missing
                who = "rank 0, or a rank it waits for,"
            raise RankMissing(f"{who} did not arrive {where} within {seconds:g} s "
                              "(parallelism.collective_timeout_sec): it hangs or has died; its log says why, and "
                              "the checkpoints saved so far are intact: launch again to resume") from None


def is_collective_failure(e: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo's transport, a backend error), not a bug of this rank: only
    then are the other ranks waiting at a probe rather than in the collective."""
    return isinstance(e, dist.DistError) or bool(_COLLECTIVE.search(str(e)))


_COLLECTIVE = re.compile(r"gloo/transport|Timed out waiting|Connection (closed|reset) by peer")
