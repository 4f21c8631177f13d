import os

import pytest
import torch

# Without a GPU, Triton kernels can only run through its interpreter, and Triton decides interpreter-or-compiler
# when it is imported (its own tl.cumsum / tl.sum are decorated then): set the switch before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # FLAME_KERNEL_SETTINGS="rwkv7.LEVEL_SUMS=False,gsa.FEED_SCAN=False": the tests run with other kernel settings
    # (kernels/settings.py), e.g. a variant's GPU tests before it becomes the default.
    if os.environ.get("FLAME_KERNEL_SETTINGS"):
        from kernels.settings import apply_env
        config._flame_kernel_settings = apply_env()


def pytest_xdist_auto_num_workers(config):
    # `-n auto` (pyproject): one worker per core on CPU; GPU tests run in one process, since they share the card
    # and some of them time it. None leaves the choice to pytest-xdist.
    return 0 if torch.cuda.is_available() else None


def pytest_report_header(config):
    made = getattr(config, "_flame_kernel_settings", None)
    return f"kernel settings: {made}" if made else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
