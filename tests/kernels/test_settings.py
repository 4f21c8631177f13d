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
    for name in ("BWD_SPLIT", "LEVEL_SUMS", "CHUNK_PREC", "SCAN_BV"):
        monkeypatch.setattr(rwkv7, name, getattr(rwkv7, name))   # restored after the test
    made = apply(["rwkv7.BWD_SPLIT=3", "rwkv7.LEVEL_SUMS=True", "rwkv7.CHUNK_PREC=bf16", "rwkv7.SCAN_BV=None"])
    assert made == {"rwkv7.BWD_SPLIT": 3, "rwkv7.LEVEL_SUMS": True, "rwkv7.CHUNK_PREC": "bf16", "rwkv7.SCAN_BV": None}
    assert (rwkv7.BWD_SPLIT, rwkv7.LEVEL_SUMS, rwkv7.CHUNK_PREC, rwkv7.SCAN_BV) == (3, True, "bf16", None)


@pytest.mark.parametrize("item", ["rwkv7.NO_SUCH=1", "rwkv7.chunk_rwkv7=1", "nofamily.X=1", "rwkv7.BWD_SPLIT"])
def test_apply_rejects_unknown_settings(item):
    with pytest.raises((ValueError, ModuleNotFoundError)):
        apply([item])


def test_env_settings_reach_the_tests(tmp_path):
    # a pytest run under FLAME_KERNEL_SETTINGS sees the setting in the module its tests use
    probe = tmp_path / "test_probe.py"
    probe.write_text("import kernels.rwkv7 as m\n\ndef test_probe():\n    assert m.BWD_SPLIT == 3 and m.LEVEL_SUMS is True\n")
    env = dict(os.environ, FLAME_KERNEL_SETTINGS="rwkv7.BWD_SPLIT=3, rwkv7.LEVEL_SUMS=True", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(probe)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kernel settings: {'rwkv7.BWD_SPLIT': 3, 'rwkv7.LEVEL_SUMS': True}" in proc.stdout
