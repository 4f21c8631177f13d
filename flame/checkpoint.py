"""Sharded checkpoints with torch.distributed.checkpoint (DCP), visible only once complete.

Layout: {dump_folder}/{checkpoint.folder}/step-N/ (DCP files). A save writes step-N.tmp/ first and renames it after
every rank has finished, so a folder named step-N is always complete; older ones are pruned only after that.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flame.config import CheckpointConfig

_STEP_DIR = re.compile(r"^step-(\d+)$")


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, rank: int):
        self.cfg, self.rank = cfg, rank
        self.folder = run_dir / cfg.folder

    def complete_steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _STEP_DIR.match(p.name)))

    def step_to_resume(self) -> int | None:
        """The step to load, following checkpoint.resume and checkpoint.load_step; None starts fresh."""
        steps = self.complete_steps()
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise FileNotFoundError(f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint "
                                        f"{self.folder}/step-{self.cfg.load_step} (complete: {steps})")
            return self.cfg.load_step
        if self.cfg.resume == "auto" and steps:
            return steps[-1]
        return None

    def save(self, step: int, state: dict) -> Path:
        final, tmp = self.folder / f"step-{step}", self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._prune()
        dist.barrier()
        return final

    def load(self, step: int, state: dict) -> None:
        """Fill `state` (same structure as saved) in place."""
        dcp.load(state, checkpoint_id=str(self.folder / f"step-{step}"))

    def _prune(self) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        for old in self.complete_steps()[: -self.cfg.keep_latest_k]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
