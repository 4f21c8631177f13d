"""kernels.settings: kernel settings changed by name (benchmarks, offline compiles, FLAME_KERNEL_SETTINGS)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels.rwkv7 as rwkv7
from kernels.settings import apply

REPO = Path(__file__).resolve().parents[2]


def test_apply_sets_typed_values_and_returns_them(monkeypatch):
    for name in ("PREP_MAXNREG", "LEVEL_SUMS", "CHUNK_PREC", "SCAN_BV"):
        monkeypatch.setattr(rwkv7, name, getattr(rwkv7, name))   # restored after the test
    made = apply(["rwkv7.PREP_MAXNREG=128", "rwkv7.LEVEL_SUMS=False", "rwkv7.CHUNK_PREC=bf16", "rwkv7.SCAN_BV=None"])
    assert made == {"rwkv7.PREP_MAXNREG": 128, "rwkv7.LEVEL_SUMS": False, "rwkv7.CHUNK_PREC": "bf16",
                    "rwkv7.SCAN_BV": None}
    assert (rwkv7.PREP_MAXNREG, rwkv7.LEVEL_SUMS, rwkv7.CHUNK_PREC, rwkv7.SCAN_BV) == (128, False, "bf16", None)


@pytest.mark.parametrize("item", ["rwkv7.NO_SUCH=1", "rwkv7.chunk_rwkv7=1", "nofamily.X=1", "rwkv7.PREP_MAXNREG"])
def test_apply_rejects_unknown_settings(item):
    with pytest.raises((ValueError, ModuleNotFoundError)):
        apply([item])


def test_env_settings_reach_the_tests(tmp_path):
    # a pytest run under FLAME_KERNEL_SETTINGS sees the setting in the module its tests use
    probe = tmp_path / "test_probe.py"
    probe.write_text("import kernels.rwkv7 as m\n\ndef test_probe():\n    assert m.PREP_MAXNREG == 128 and m.LEVEL_SUMS is False\n")
    env = dict(os.environ, FLAME_KERNEL_SETTINGS="rwkv7.PREP_MAXNREG=128, rwkv7.LEVEL_SUMS=False", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(probe)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kernel settings: {'rwkv7.PREP_MAXNREG': 128, 'rwkv7.LEVEL_SUMS': False}" in proc.stdout
