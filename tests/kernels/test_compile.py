"""Every kernel build our ops launch compiles for an H100 (sm_90) and fits its shared memory, checked offline (no GPU):
the interpreter runs the kernels but never lowers them. The builds are recorded from the launch code itself
(kernels.launch.record) at each op's benchmark shapes and at the largest tiles it supports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.kernels.offline_build import REPO, in_compiling_process, skip_without_cuda_backend

# beside the benchmark shapes (each shape regime): the largest head sizes each op's call accepts (MAX_K, MAX_SLOTS:
# larger ones are refused before anything launches) and K != V
EXTRA_SHAPES = {"rwkv7": [(8, 4096, 8, 128, 128), (2, 16384, 8, 128, 128), (8, 4096, 16, 32, 128),
                          (2, 16384, 16, 32, 128)],
                "gsa": [(8, 4096, 4, 256, 128), (2, 16384, 4, 256, 128), (2, 4096, 4, 64, 32), (2, 16384, 4, 64, 256)],
                "rwkv6": [(8, 4096, 8, 128, 128), (2, 16384, 8, 128, 128), (8, 4096, 16, 32, 128),
                          (2, 16384, 16, 128, 32), (8, 4096, 4, 256, 256), (2, 16384, 4, 256, 256),
                          (2, 16384, 4, 128, 256)]}


@pytest.mark.parametrize("op", ["rwkv7", "gsa", "rwkv6"])
def test_every_launched_kernel_compiles_for_h100(op):
    skip_without_cuda_backend()
    from kernels.sm90 import H100_SMEM
    shapes = EXTRA_SHAPES[op]
    smem = in_compiling_process(
        "import dataclasses, json\nfrom kernels.ops import OPS\nfrom kernels.sm90 import op_launches, report\n"
        f"op = OPS[{op!r}]\nwide = dataclasses.replace(op, shapes=op.shapes + tuple({shapes!r}))\n"
        "out = report(wide)\nout['regimes'] = len(op_launches(op))\nprint(json.dumps(out))")
    regimes = smem.pop("regimes")
    assert regimes >= 4 and len(smem) >= regimes, smem   # forward and backward kernels, both shape regimes
    for name, nbytes in smem.items():
        # 0 is a build without shared memory (elementwise scans); a failed compile raises
        assert 0 <= nbytes <= H100_SMEM, f"{name} needs {nbytes} bytes of shared memory (> {H100_SMEM})"


def test_rwkv7_backward_from_chunk_states_alone_compiles_for_h100():
    # keep_chunk_tensors=False adds _chunk_u to the backward (not launched with the defaults above): its builds at
    # the benchmark shapes
    skip_without_cuda_backend()
    from kernels.sm90 import H100_SMEM
    smem = in_compiling_process(
        "import json\nfrom kernels.ops import OPS\nfrom kernels.rwkv7.chunk import Settings\n"
        "from kernels.sm90 import build, op_launches\n"
        "launches = op_launches(OPS['rwkv7'], Settings(keep_chunk_tensors=False))\n"
        "print(json.dumps({n: build(b).metadata.shared for n, b in launches.items() if n.startswith('_chunk_u')}))")
    assert smem and all(0 < nbytes <= H100_SMEM for nbytes in smem.values()), smem


def test_recorded_launches_cover_both_regimes_of_each_op():
    # the two benchmark shapes of each op take different launch paths: each shape launches builds (kernel and
    # compile-time values) the other does not
    pytest.importorskip("triton")
    only = in_compiling_process(
        "import dataclasses, json\nfrom kernels.ops import OPS\nfrom kernels.sm90 import op_launches\n"
        "per = {n: [{f'{k} {b.constexprs}' for k, b in op_launches(dataclasses.replace(op, shapes=(s,))).items()}\n"
        "           for s in op.shapes]\n"
        "       for n, op in OPS.items()}\n"
        "print(json.dumps({n: [sorted(a - b), sorted(b - a)] for n, (a, b) in per.items()}))")
    for name, (first_only, second_only) in only.items():
        assert first_only and second_only, (name, first_only, second_only)


def test_kernel_resources_script_reports_every_build():
    """The script on one op (RWKV-6: its fewest builds; each build's disassembly takes ~0.5 s); every op's builds
    compile and fit above."""
    skip_without_cuda_backend()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_resources.py"), "--op", "rwkv6"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    builds = in_compiling_process("import json\nfrom kernels.ops import OPS\nfrom kernels.sm90 import op_launches\n"
                                  "print(json.dumps(len(op_launches(OPS['rwkv6']))))")
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| _")]
    assert len(rows) == builds, proc.stdout
    for name, regs, stack, shared, instructions, loop, loads in rows:
        assert 0 < int(regs) <= 255 and int(stack) >= 0 and 0 <= int(shared) <= 232448, name
        # the scans are loops over chunks; their body is part of the kernel
        assert 0 < int(loop) < int(instructions) if "scan" in name else 0 <= int(loop) < int(instructions), name
        first, every = map(int, loads.split("/"))
        assert 0 <= first <= every < int(instructions), name


def test_rwkv7_fwd_prep_issues_its_tile_loads_first():
    """_fwd_prep waits on its loads (few blocks per SM): all of a chunk's tiles (r, the decay logits, k, a, b, v) are
    issued before the first shared-memory store, so their latencies overlap; loaded and converted one by one (each
    conversion's shared store and barrier before the next load), they wait one after another."""
    skip_without_cuda_backend()
    found = in_compiling_process(
        "import json\nfrom kernels.ops import OPS\nfrom kernels.sm90 import build, op_launches, resources\n"
        "out = {n: resources(build(b)) for n, b in op_launches(OPS['rwkv7']).items() if n.startswith('_fwd_prep')}\n"
        "print(json.dumps(out))")
    assert found
    for name, r in found.items():
        assert r["loads"] >= 6 and r["loads_first"] == r["loads"], (name, r)
