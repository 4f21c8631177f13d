"""The errors a foreseen problem raises (flame.train prints their one line and exits 2) and `check`, which raises
a ConfigError. A leaf module, so flame.config and the [data] section's flame.data.config both import it."""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A config problem, named by file and dotted key."""

    def __init__(self, key: str, expected: str, got: Any = dataclasses.MISSING, file: str | None = None):
        self.key, self.expected, self.got, self.file = key, expected, got, file
        super().__init__(self.line())

    def line(self) -> str:
        where = f"{self.file}: " if self.file else ""
        got = "" if self.got is dataclasses.MISSING else f", got {self.got!r}"
        return f"config error: {where}{self.key}: expected {self.expected}{got}"


class RunError(RuntimeError):
    """A foreseen failure that is not a config value (a checkpoint that does not fit, a resume that cannot continue
    the data, init_from weights that do not fit, too many non-finite steps in a row): `flame.train` prints its one
    line, exit code 2."""


def check(ok: bool, key: str, expected: str, got: Any = dataclasses.MISSING) -> None:
    if not ok:
        raise ConfigError(key, expected, got)
