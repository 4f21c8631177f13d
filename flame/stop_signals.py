"""How a rank is asked to stop: SIGINT (Ctrl-C, forwarded by scripts/launch.sh), SIGTERM and SIGUSR1 (preemption
notices) mean "finish the steps under way, save a checkpoint, exit 0": the step being queued carries the flag (or,
received after its last launch, the next one does) and the trainer reads it once the next step is queued, so at most
one more step runs. A second SIGINT means "stop at once, save nothing".

Installed as the rank starts, before its slow imports, so that a stop asked for during start-up is kept for the first
step instead of surfacing as a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import os
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a process ended by SIGINT

received = 0
"""The first stop signal received (0: none yet)."""


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame) -> None:
    global received
    if signum == signal.SIGINT and received == signal.SIGINT:
        print("second Ctrl-C: stopped at once, nothing saved", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_EXIT_CODE)  # data workers end with this process (flame.lifeline)
    received = received or signum
