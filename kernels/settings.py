"""Kernel module settings (tiles, warps, precisions, variants: the module-level constants of kernels.rwkv7 and
kernels.gsa) changed by name, for benchmarks, offline compiles and test runs:

    python scripts/bench_kernels.py --set rwkv7.LEVEL_SUMS=False --set rwkv7.PREP_MAXNREG=128
    FLAME_KERNEL_SETTINGS="rwkv7.LEVEL_SUMS=False,gsa.FEED_SCAN=False" python -m pytest -m gpu tests/kernels
"""

from __future__ import annotations

import ast
import importlib


def apply(items: list[str]) -> dict:
    """Set each "family.NAME=VALUE" (VALUE a Python literal, or a bare word taken as a string); returns the settings
    made. An unknown family or name is an error, not a silent no-op."""
    made = {}
    for item in items:
        target, sep, text = item.partition("=")
        family, dot, name = target.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"kernel setting {item!r}: expected family.NAME=VALUE, e.g. rwkv7.PREP_MAXNREG=128")
        module = importlib.import_module(f"kernels.{family}")
        if not name.isupper() or not hasattr(module, name):
            raise ValueError(f"kernel setting {item!r}: kernels.{family} has no setting {name}")
        try:
            value = ast.literal_eval(text.strip())      # 8, True, None, 'bf16'
        except (ValueError, SyntaxError):
            value = text.strip()                         # bf16
        setattr(module, name, value)
        made[f"{family}.{name}"] = value
    return made


def apply_env(var: str = "FLAME_KERNEL_SETTINGS") -> dict:
    """apply() of the comma-separated settings in an environment variable (none when unset)."""
    import os
    text = os.environ.get(var, "")
    return apply([x for x in text.split(",") if x.strip()])
