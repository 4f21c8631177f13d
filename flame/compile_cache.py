"""Our kernels' sources in the key of Inductor's on-disk cache of compiled graphs.

Inductor keys a compiled graph by the graph, its inputs and its configuration, not by the fake (meta) implementations
of the custom ops in it (pytorch#160472), from which it takes their outputs' shapes. After an update of flame that
changes what one of our ops returns (RWKV-7's chunk op keeping fewer tensors), a warm cache handed the new code a graph
compiled for the old outputs: the step failed, or segfaulted. A graph pass that changes nothing but whose id is a hash
of `kernels/` (Inductor's documented hook for keying the cache by code: CustomGraphPass.uuid) makes every edit there a
new key; unchanged sources keep their cache entries.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch._inductor.custom_graph_pass import CustomGraphPass

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
SOURCE_SUFFIXES = (".py", ".cu", ".cuh")


def sources_hash(root: Path) -> str:
    """sha256 of every kernel source under root: each one's path and contents, in path order."""
    h = hashlib.sha256()
    for p in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts):
        h.update(f"{p.relative_to(root)}\0{p.stat().st_size}\0".encode())
        h.update(p.read_bytes())
    return h.hexdigest()


class KernelSources(CustomGraphPass):
    """A post-grad pass that leaves the graph as it is; its uuid, which Inductor puts in its cache key, is the hash
    of `kernels/`'s sources, read once a process."""

    def __init__(self, root: Path | None = None):
        self.root = root or KERNELS
        self._hash = None

    def __call__(self, graph) -> None:
        pass

    def uuid(self) -> str:
        if self._hash is None:
            self._hash = sources_hash(self.root)
        return self._hash


def key_inductor_cache_by_kernels() -> None:
    """Make Inductor's cache keys include our kernels' sources (compile_blocks calls it before compiling). A post-grad
    pass of the user's own is left in place (it keys the cache by its own uuid)."""
    from torch._inductor import config

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = KernelSources()
