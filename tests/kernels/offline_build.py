"""Offline sm_90 builds for the compile tests (tests/kernels/test_compile.py, test_silu_rms_norm.py): code run in a
fresh process without the Triton interpreter, and the skip where this Triton cannot compile for CUDA."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def in_fresh_process(code: str):
    """Run `code` (printing one JSON line last) without TRITON_INTERPRET (the interpreter replaces @triton.jit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def cuda_backend_unavailable() -> str | None:
    """Why this Triton cannot compile for CUDA, or None: asked once per test process (a fresh process: seconds)."""
    return in_fresh_process("import json; from kernels.sm90 import unavailable; print(json.dumps(unavailable()))")


def skip_without_cuda_backend():
    pytest.importorskip("triton")
    why = cuda_backend_unavailable()
    if why:
        pytest.skip(f"this Triton cannot compile for CUDA: {why}")
