import os

import pytest
import torch

# Without a GPU, Triton kernels can only run through its interpreter, and Triton decides interpreter-or-compiler
# when it is imported (its own tl.cumsum / tl.sum are decorated then): set the switch before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not torch.cuda.is_available():
    # a test process of `-n auto` shares the cores with the others: torch's default of a thread per core in each
    # oversubscribes them, and its threads spin waiting for each other (CPU suite on 2 cores: a third more CPU time
    # in the in-process model tests). Subprocesses get OMP_NUM_THREADS=1 from tests/helpers.py's env().
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_interpreter

    triton_interpreter.install()  # the same interpretation at less CPU (the module says how)


def pytest_xdist_auto_num_workers(config):
    # `-n auto` (pyproject): one worker per core on CPU; GPU tests run in one process, since they share the card
    # and some of them time it. None leaves the choice to pytest-xdist.
    return 0 if torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
