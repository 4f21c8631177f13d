import os

import pytest
import torch

# Without a GPU, Triton kernels can only run through its interpreter, and Triton decides interpreter-or-compiler
# when it is imported (its own tl.cumsum / tl.sum are decorated then): set the switch before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # a test process of `-n auto` shares the cores with the others: torch's default of a thread per core in each
    # oversubscribes them, and its threads spin waiting for each other (CPU suite on 2 cores: a third more CPU time
    # in the in-process model tests). Subprocesses get OMP_NUM_THREADS=1 from tests/helpers.py's env().
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_interpreter

    triton_interpreter.install()  # the same interpretation at less CPU (the module says how)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: module-scoped ones start reference runs too
def pytest_runtest_setup(item):
    # On a GPU machine, the jobs a test not marked gpu starts see no GPU (tests/helpers.py's env()): such tests check
    # the CPU path against CPU references, and some start more ranks than the machine has GPUs. (Not this process's
    # CUDA_VISIBLE_DEVICES: torch reads it again for device_count(), which would then disagree with is_available().)
    from tests import helpers

    helpers.JOBS_SEE_GPUS = torch.cuda.is_available() and "gpu" in item.keywords


GPU_WORKERS = 12
"""Test processes of `-n auto` on a GPU machine at most: they share one card, each with a CUDA context (the GPU suite
runs in 7 minutes at 12 on one H200)."""


def pytest_xdist_auto_num_workers(config):
    # `-n auto` (pyproject): one test process per core; None leaves the choice to pytest-xdist
    if torch.cuda.is_available():
        return min(GPU_WORKERS, len(os.sched_getaffinity(0)))
    return None


def module_fixtures(item) -> list[str]:
    """The module-scoped fixtures a test asks for, itself or through its fixtures (autouse ones, such as
    tests.helpers.one_thread, left out)."""
    info, found, seen = item._fixtureinfo, [], set()
    todo = list(info.argnames)
    while todo:
        name = todo.pop()
        if name in seen or name not in info.name2fixturedefs:
            continue
        seen.add(name)
        fixture = info.name2fixturedefs[name][-1]
        if fixture.scope == "module":
            found.append(name)
        todo.extend(fixture.argnames)
    return found


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # `--dist loadgroup` (pyproject): the tests of a module that share a module-scoped fixture (a reference training
    # run, the context-parallel runs of every case) go to one test process, which sets it up once; split over two,
    # each process set it up again.
    for item in items:
        if module_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        # tests marked slow go first: pytest-xdist hands tests out in this order, so they start beside the short
        # ones instead of running on as the suite's tail
        items.sort(key=lambda item: "slow" not in item.keywords)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
