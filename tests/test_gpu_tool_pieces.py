"""The GPU tools benchmarks/kernel_accuracy.py and benchmarks/sanitize_kernel.py build their inputs (and the fp64
reference) from the kernel tests' own pieces: on a machine without a GPU they get as far as finding them, then stop
with one line. A piece that moved (as the input makers once did) fails here, not in the next GPU session."""

import subprocess
import sys

import pytest

from tests.helpers import REPO, env


def run_without_gpu(*args):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env(extra=dict(CUDA_VISIBLE_DEVICES="")),
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr, proc.stdout


@pytest.mark.parametrize("op", ["rwkv6", "rwkv7"])
def test_kernel_accuracy_finds_the_tests_pieces_then_needs_a_gpu(op):
    assert run_without_gpu("benchmarks/kernel_accuracy.py", "--op", op) == (
        2, "kernel_accuracy: needs a CUDA GPU\n", "")


@pytest.mark.parametrize("op, shape, flag", [("rwkv6", "1,64,2,16,16", None), ("rwkv7", "1,64,2,16,16", "--logits"),
                                             ("gsa", "1,64,2,16,16,16", "--projection")])
def test_sanitize_kernel_finds_the_tests_pieces_then_needs_a_gpu(op, shape, flag):
    assert run_without_gpu("benchmarks/sanitize_kernel.py", op, shape, *([flag] if flag else [])) == (
        2, "sanitize_kernel: needs a CUDA GPU\n", "")
