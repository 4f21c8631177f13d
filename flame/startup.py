"""What a run is doing before its first logged step, said on rank 0's console: each start-up stage as it begins, and
every `every` seconds while one lasts (torch.compile and Triton's autotuning can take minutes without a word)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from flame.metrics import clock


class StartupReport:
    def __init__(self, started: float, say: Callable[[str], None] | None, every: float = 30.0):
        """started: time.perf_counter() when the process began; say: prints a line (None on ranks that stay quiet)."""
        self.started, self.say, self.every = started, say, every
        self.current: tuple[str, float] | None = None
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.ticker: threading.Thread | None = None

    def stage(self, what: str) -> None:
        """A stage begins (the previous one, if any, has ended)."""
        if self.say is None:
            return
        now = time.perf_counter()
        with self.lock:
            self.current = (what, now)
        self.say(f"{clock()} start-up: {what} ({now - self.started:.0f} s since launch)")
        if self.ticker is None:
            self.ticker = threading.Thread(target=self._tick, name="startup-report", daemon=True)
            self.ticker.start()

    def done(self) -> None:
        """The first step is logged: no more start-up lines."""
        self.stopped.set()
        if self.ticker is not None:
            self.ticker.join()
            self.ticker = None

    def _tick(self) -> None:
        while not self.stopped.wait(self.every):
            with self.lock:
                what, since = self.current
            now = time.perf_counter()
            if now - since >= self.every:
                self.say(f"{clock()} start-up: still {what}, {now - since:.0f} s so far "
                         f"({now - self.started:.0f} s since launch)")
