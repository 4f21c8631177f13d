"""Offline sm_90 builds for the compile tests (tests/kernels/test_compile.py, test_silu_rms_norm.py): code run in a
process of its own without the Triton interpreter, and the skip where this Triton cannot compile for CUDA."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.helpers import run_script

REPO = Path(__file__).resolve().parents[2]


def in_compiling_process(code: str):
    """Run `code` (printing one JSON line last) in a process without TRITON_INTERPRET (the interpreter replaces
    @triton.jit): on CPU forked from a tests/train_forks.py server started without it, which has imported Triton."""
    proc = run_script(code, timeout=900, without=("TRITON_INTERPRET",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def cuda_backend_unavailable() -> str | None:
    """Why this Triton cannot compile for CUDA, or None: asked once per test process."""
    return in_compiling_process("import json; from kernels.sm90 import unavailable; print(json.dumps(unavailable()))")


def skip_without_cuda_backend():
    pytest.importorskip("triton")
    why = cuda_backend_unavailable()
    if why:
        pytest.skip(f"this Triton cannot compile for CUDA: {why}")
