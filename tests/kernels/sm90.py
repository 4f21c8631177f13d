"""Compile Triton kernels for an H100 (sm_90) on a machine without a GPU: the interpreter runs the kernels but never
lowers them, so this is what catches layouts, shapes and shared memory that only the GPU compiler rejects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

H100_SMEM = 232448   # shared memory bytes one block may use on sm_90 (227 KiB)
REPO = Path(__file__).resolve().parents[2]


def build(fn, consts: dict, warps: int, types: dict | None = None, maxnreg: int | None = None):
    """triton.compile of a @triton.jit kernel for sm_90: pointer arguments default to bf16, `types` overrides.
    Every pointer is taken as 16-byte aligned, as Triton specializes a launch with fresh tensors: without that the
    compiler can neither vectorize nor pipeline (cp.async) loads, and registers and spills differ from the GPU's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else (types or {}).get(n, "*bf16") for n in fn.arg_names}
    ints = ("cu", "chunk_offsets", "chunk_index", "block_offsets", "block_index")
    sig.update({n: tp for n, tp in dict({n: "*i32" for n in ints}, scale="fp32", TT="i32").items() if n in sig})
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if sig[n].startswith("*") or n == "TT"}   # TT: a token count, a multiple of 16 at benchmark shapes
    options = dict(num_warps=warps, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32), options=options)


def resources(compiled) -> dict:
    """From cuobjdump of the cubin (Triton bundles it): registers and stack bytes (spilled registers) per thread,
    shared memory bytes per block, and SASS instructions: in all, and in the largest loop body (a sequential
    scan's step; 0 without a loop)."""
    import re
    import tempfile

    import triton
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = lambda flag: subprocess.run([str(cuobjdump), flag, f.name], capture_output=True, text=True,  # noqa: E731
                                           check=True).stdout
        usage, sass = dump("--dump-resource-usage"), dump("-sass")
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    # SASS lines look like "/*0a30*/   @P0 BRA 0x0910 ;": 16 bytes per instruction, a loop is a branch backwards
    code = [(int(a, 16), ins) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(a - int(t, 16)) // 16 + 1 for a, ins in code for t in re.findall(r"\bBRA\s+(0x[0-9a-f]+)", ins)
             if int(t, 16) < a]
    return dict(registers=int(found["REG"]), stack=int(found["STACK"]), shared=compiled.metadata.shared,
                instructions=len(code), loop=max(loops, default=0))


def report(kernels: dict, what: str) -> dict:
    """{name: compiled} as {name: shared bytes} (what="shared") or {name: resources(...)} (what="resources")."""
    return {n: c.metadata.shared if what == "shared" else resources(c) for n, c in kernels.items()}


def shared_memory_in_subprocess(module: str, call: str) -> dict:
    """`module.call` (returning a JSON-able dict, e.g. {kernel: shared bytes}, or {"unavailable": why}), run in a
    fresh process without TRITON_INTERPRET (the interpreter replaces @triton.jit at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, {module}; print(json.dumps({module}.{call}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def unavailable() -> str | None:
    """Why this Triton cannot compile for CUDA at all (no backend or ptxas), or None."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x):
        tl.store(x, tl.load(x))

    try:
        build(_probe, {}, 4, types={"x": "*fp32"})
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:300]
    return None


def assert_fits_h100(module: str, call: str, n_kernels: int):
    """The test body both kernel families share: compile in a fresh process, skip only when this Triton has no CUDA
    backend, and check every kernel's shared memory against the H100's."""
    import pytest

    pytest.importorskip("triton")
    smem = shared_memory_in_subprocess(module, call)
    if "unavailable" in smem:
        pytest.skip(f"this Triton cannot compile for CUDA: {smem['unavailable']}")
    assert len(smem) == n_kernels, smem
    for name, nbytes in smem.items():
        assert nbytes <= H100_SMEM, f"{name} needs {nbytes} bytes of shared memory (> {H100_SMEM})"

