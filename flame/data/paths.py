"""Relative data paths work from the working directory or from the repository root (configs name data/sample/...)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str) -> str:
    """`path` itself if it exists (or is absolute), else the same path under the repository root if that exists."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = REPO_ROOT / path
    return str(candidate) if candidate.exists() else path


def expand_glob(pattern: str) -> list[str]:
    """Files matching a glob (`**` recurses), or every file under a folder; sorted, so every rank sees one order."""
    for base in (pattern, str(REPO_ROOT / pattern)) if not os.path.isabs(pattern) else (pattern,):
        if os.path.isdir(base):
            base = os.path.join(base, "**", "*")
        files = sorted(f for f in glob.glob(base, recursive=True) if os.path.isfile(f))
        if files:
            return files
    return []
