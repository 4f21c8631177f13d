"""scripts/setup.sh: a failed install stops CI with one line naming what is missing; a complete one calls no pip.

pip is replaced by a stub (PYTHON points at a wrapper around this Python whose "-m pip" fails), so nothing is
downloaded or installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

NOISE = (
    "WARNING: Location '/nowhere' is ignored: it is either a non-existing path or lacks a specific scheme.",
    "WARNING: Running pip as the 'root' user can result in broken permissions and conflicting behaviour",
)


def _python_whose_pip_fails(tmp_path: Path) -> tuple[Path, Path]:
    calls = tmp_path / "pip_calls"
    stub = tmp_path / "python"
    noise = "\n".join(f"  echo \"{line}\" >&2" for line in NOISE)
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then\n'
        f'  echo "$*" >> {calls}\n'
        f"{noise}\n"
        '  echo "ERROR: No matching distribution found for flame-no-such-package==1.0" >&2\n'
        "  exit 1\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    return stub, calls


def _setup(repo: Path, python: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(python)}
    return subprocess.run(["bash", str(repo / "scripts/setup.sh")], env=env, capture_output=True, text=True, timeout=300)


def test_failed_install_exits_nonzero_with_one_line_naming_it(tmp_path):
    # a copy of the project whose test extras name a package that cannot be installed
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts/setup.sh", repo / "scripts/setup.sh")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'test = ["pytest>=8"' in pyproject
    (repo / "pyproject.toml").write_text(pyproject.replace('test = ["pytest>=8"', 'test = ["flame-no-such-package==1.0", "pytest>=8"'))
    stub, calls = _python_whose_pip_fails(tmp_path)

    out = _setup(repo, stub)

    assert out.returncode != 0
    assert "-m pip install -q -e .[test]" in calls.read_text()
    lines = out.stderr.splitlines()
    ours = [line for line in lines if line.startswith("setup.sh:")]
    assert len(ours) == 1, out.stderr
    assert "flame-no-such-package==1.0" in ours[0]
    assert "pytest>=8" not in ours[0]  # installed here: not named
    assert not any("is ignored" in line or "'root' user" in line for line in lines), out.stderr
    assert "ERROR: No matching distribution found for flame-no-such-package==1.0" in lines  # pip's own reason


def test_complete_install_calls_no_pip(tmp_path):
    stub, calls = _python_whose_pip_fails(tmp_path)
    out = _setup(REPO, stub)
    assert out.returncode == 0, out.stderr
    assert not calls.exists(), calls.read_text()
