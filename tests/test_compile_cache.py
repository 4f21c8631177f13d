"""flame.compile_cache: Inductor's on-disk cache of compiled graphs keyed by our kernels' sources, so that a change to
a custom op's outputs never meets a graph compiled for the old ones (which failed or segfaulted), while unchanged
sources keep their entries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import REPO, env

from flame.compile_cache import KERNELS, KernelSources, sources_hash

# A custom op whose second output has OUT_N elements, as one of ours that stops returning a tensor, compiled in a
# process whose kernel sources are the files of SOURCES: it prints the result and Inductor's cache counters.
SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch
    import torch._functorch.config
    from torch._dynamo.utils import counters
    import flame.compile_cache as cc

    N = int(os.environ["OUT_N"])

    @torch.library.custom_op("flame_test::two_outputs", mutates_args=())
    def two_outputs(x: torch.Tensor) -> list[torch.Tensor]:
        return [x * 2, x.new_ones(N)]

    @two_outputs.register_fake
    def _(x):
        return [torch.empty_like(x), x.new_empty(N)]

    cc.KERNELS = Path(os.environ["SOURCES"])
    torch._functorch.config.enable_autograd_cache = False   # as flame.parallel.compile_blocks runs Inductor
    cc.key_inductor_cache_by_kernels()
    y = torch.compile(lambda x: sum(t.sum() for t in two_outputs(x)))(torch.ones(8))
    print(float(y), counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
""")


def compile_once(tmp_path, out_n: int, source: str) -> tuple[float, int, int]:
    sources = tmp_path / f"kernels-{source}"
    sources.mkdir(exist_ok=True)
    (sources / "op.py").write_text(source)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env(extra={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OUT_N": str(out_n),
                                         "SOURCES": str(sources)}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    value, hits, misses = proc.stdout.split()[-3:]
    return float(value), int(hits), int(misses)


def test_changed_kernel_sources_compile_afresh_and_unchanged_ones_hit_the_cache(tmp_path):
    assert compile_once(tmp_path, 4, "v1") == (20.0, 0, 1)     # 16 + 4
    # the op now returns an empty second output: another source, so a new key (the old graph expected 4 elements)
    assert compile_once(tmp_path, 0, "v2") == (16.0, 0, 1)
    assert compile_once(tmp_path, 0, "v2") == (16.0, 1, 0)     # the same sources: the cache serves it


def test_sources_hash_follows_paths_and_contents(tmp_path):
    (tmp_path / "op").mkdir()
    (tmp_path / "op" / "kernel.cu").write_text("a")
    (tmp_path / "op" / "launch.py").write_text("b")
    first = sources_hash(tmp_path)
    (tmp_path / "notes.md").write_text("not a source")
    (tmp_path / "op" / "__pycache__").mkdir()
    (tmp_path / "op" / "__pycache__" / "launch.py").write_text("a build product")
    assert sources_hash(tmp_path) == first
    (tmp_path / "op" / "kernel.cu").write_text("c")
    edited = sources_hash(tmp_path)
    (tmp_path / "op" / "kernel.cu").rename(tmp_path / "op" / "other.cu")
    assert len({first, edited, sources_hash(tmp_path)}) == 3
    assert KernelSources().uuid() == sources_hash(KERNELS)   # the repository's kernels/
