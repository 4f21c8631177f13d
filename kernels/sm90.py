"""Compile our kernels for an H100 (sm_90) on a machine without a GPU: the interpreter runs the kernels but never
lowers them, so this is what catches layouts, shapes and shared memory that only the GPU compiler rejects, and what
reports registers and spills before a device call (benchmarks/kernel_resources.py).

The builds come from the launch code itself (kernels.launch.record): an op's forward and backward run on meta
tensors at the benchmark shapes, called as the models call them (kernels.ops), and each distinct launch is compiled
as the GPU would compile it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from kernels.launch import Launch, distinct, record

H100_SMEM = 232448   # shared memory bytes one block may use on sm_90 (227 KiB)


def build(b: Launch):
    """triton.compile of one recorded launch for sm_90. Every pointer, and every integer that is a multiple of 16
    at these shapes, is taken as 16-byte aligned / divisible, as Triton specializes a launch with fresh tensors:
    without that the compiler can neither vectorize nor pipeline (cp.async) loads, and registers and spills differ
    from the GPU's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(b.constexprs)
    sig = dict(b.types) | {n: "constexpr" for n in consts}
    sig = {n: sig[n] for n in b.kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(b.kernel.arg_names)
               if sig[n].startswith("*") or sig[n] == "i32"}
    options = dict(num_warps=b.num_warps, **({} if b.maxnreg is None else {"maxnreg": b.maxnreg}))
    return triton.compile(ASTSource(b.kernel, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options=options)


def op_launches(op, settings=None) -> dict[str, Launch]:
    """The distinct launches of one op (a kernels.ops.Op) over its benchmark shapes, forward and backward, with
    `settings` (None: its defaults): recorded on meta tensors, nothing runs."""
    import torch

    with record() as launches:
        for shape in op.shapes:
            xs = [x.requires_grad_(x.is_floating_point()) for x in op.make_inputs(*shape, device="meta")]
            out = op.ours(shape, xs, settings)
            torch.autograd.backward(out, [torch.ones_like(out)])
    return distinct(launches)


def resources(compiled) -> dict:
    """From cuobjdump of the cubin (Triton bundles it): registers and stack bytes (spilled registers) per thread,
    shared memory bytes per block, SASS instructions: in all, and in the largest loop body (a sequential scan's
    step; 0 without a loop), and the tile loads (64- and 128-bit global loads): in all, and how many are issued
    before the first shared-memory store. A kernel with few blocks per SM waits on its loads; a load whose layout
    conversion (shared store, barrier) comes before the next load is issued makes the loads wait one after another."""
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
    wide = [bool(re.search(r"\bLDG\.E\.(64|128)\b", ins)) for _, ins in code]
    first_store = next((i for i, (_, ins) in enumerate(code) if re.search(r"\bSTS\b", ins)), len(code))
    return dict(registers=int(found["REG"]), stack=int(found["STACK"]), shared=compiled.metadata.shared,
                instructions=len(code), loop=max(loops, default=0), loads=sum(wide),
                loads_first=sum(wide[:first_store]))


def report(op, what: str = "shared", settings=None) -> dict:
    """{kernel build: shared memory bytes} (what="shared") or {kernel build: resources(...)} of one op, or
    {"unavailable": why} when this Triton cannot compile for CUDA."""
    why = unavailable()
    if why:
        return {"unavailable": why}
    compiled = {name: build(b) for name, b in op_launches(op, settings).items()}
    if what == "shared":
        return {name: c.metadata.shared for name, c in compiled.items()}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(os.cpu_count()) as pool:  # the disassemblies are subprocesses: run them side by side
        return dict(zip(compiled, pool.map(resources, compiled.values())))


def unavailable() -> str | None:
    """Why this Triton cannot compile for CUDA at all (no backend or ptxas), or None."""
    from kernels import probe

    try:
        build(Launch(probe.copy_one, (("x", "*fp32"),), (), 4, None))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:300]
    return None
