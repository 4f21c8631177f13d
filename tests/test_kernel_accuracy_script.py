"""benchmarks/kernel_accuracy.py builds its inputs and fp64 reference from the kernel tests' own pieces
(tests/kernels/test_<op>.py's OP): on a machine without a GPU it gets as far as finding them, then stops with one
line. A reference that moved (as the input makers once did) fails here, not on the next GPU session."""

import subprocess
import sys

import pytest

from tests.helpers import REPO, env


@pytest.mark.parametrize("op", ["rwkv6", "rwkv7"])
def test_finds_the_tests_pieces_then_needs_a_gpu(op):
    proc = subprocess.run([sys.executable, "benchmarks/kernel_accuracy.py", "--op", op], cwd=REPO,
                          env=dict(env(), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, "kernel_accuracy: needs a CUDA GPU\n", "")
