"""Counts of what the pipeline read and skipped, with warnings about skips at a bounded rate.

A bad line is warned about once per file and line: a reader passes over its files again and again, and meets the
same bad line on every pass; from the second time on it is only counted (skipped_<reason> in the metrics).
"""

from __future__ import annotations

import logging

log = logging.getLogger("flame.data")
WARN_FIRST = 5  # warn about the first few skips of each reason, then at 10, 100, 1000, ...


class Counters:
    """Named integer counters of one reader: docs, tokens, skipped_<reason>, source<i>_epoch."""

    def __init__(self):
        self.values: dict[str, int] = {}
        self.warned: set[str] = set()
        """Places (file:line) already warned about, in this process (a resumed run may warn once again)."""
        self.places: dict[str, int] = {}
        """Per reason: skips at places not warned about yet; paces the warnings (the first few, the 10th, 100th,
        ...)."""

    def add(self, name: str, n: int = 1) -> int:
        self.values[name] = self.values.get(name, 0) + n
        return self.values[name]

    def skip(self, reason: str, where: str, detail: str) -> None:
        """A document (or the rest of a file) was skipped; `where` names the file and line."""
        n = self.add(f"skipped_{reason}")
        if where in self.warned:
            return
        k = self.places[reason] = self.places.get(reason, 0) + 1
        if k <= WARN_FIRST or str(k).rstrip("0") == "1":
            self.warned.add(where)  # only the places warned about are kept: a bounded set
            log.warning("data: skipped (%s) at %s: %s [%d skipped for this reason so far in this reader]",
                        reason, where, detail, n)

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def merge_counters(per_reader: list[dict]) -> dict:
    """Sum over readers; epochs are the fewest passes any reader has completed."""
    total: dict[str, int] = {}
    for values in per_reader:
        for name, v in values.items():
            if name.endswith("_epoch"):
                total[name] = min(total.get(name, v), v)
            else:
                total[name] = total.get(name, 0) + v
    return total
