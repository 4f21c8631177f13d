"""Registers, stack (spilled registers) and shared memory per thread block of each RWKV-7 kernel, compiled offline
for an H100 (sm_90) with Triton's bundled ptxas: no GPU needed, so a kernel change can be judged before a device call.

    python scripts/kernel_resources.py [--kv 64] [--warps 4]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # as on the GPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def resources(compiled) -> dict:
    """REG and STACK from cuobjdump of the cubin, plus Triton's shared memory figure."""
    import triton
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", out))
    return dict(registers=int(found["REG"]), stack=int(found["STACK"]), shared=compiled.metadata.shared)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv", type=int, default=64, help="K = V")
    p.add_argument("--warps", type=int, default=None, help="for the per-chunk kernels (default: the shipped ones)")
    args = p.parse_args()
    import kernels.rwkv7 as m
    from kernels.rwkv7.bwd import _bwd_chunk, _bwd_chunk_k, _bwd_chunk_v, _bwd_scan
    from kernels.rwkv7.fwd import _fwd_prep, _fwd_scan
    from tests.kernels import sm90

    K = V = args.kv
    BT, BV, SBV = m.CHUNK, min(m.CHUNK_BV, max(16, V)), m._scan_bv(V, 128)
    f32 = {n: "*fp32" for n in ("w", "W", "Uv", "Arb", "Ark", "Aak", "Tinv", "h0", "h", "U", "ht", "dht", "dh", "dZ",
                                "dh0", "dw", "d_rdec", "d_adec", "d_bend", "d_kend", "dArb", "dArk", "dAab", "dAak",
                                "dgc", "dw_part")}
    chunk = dict(H=16, K=K, BT=BT, BK=max(16, K), PREC=m.CHUNK_PREC)
    levels = dict(LEVELS=BT.bit_length() - 1)
    scan = dict(H=16, K=K, V=V, BT=BT, BK=max(16, K), BV=SBV, PREC=m.PREC)
    warps = lambda default: args.warps or default  # noqa: E731
    kernels = [
        ("_fwd_prep", _fwd_prep, dict(chunk, V=V, BV=BV, **levels), warps(m.PREP_WARPS)),
        ("_fwd_scan", _fwd_scan, dict(scan, HAS_H0=True, STORE_HT=True), m.SCAN_WARPS),
        ("_bwd_scan", _bwd_scan, dict(scan, HAS_DHT=True, STORE_DH0=True), m.SCAN_WARPS),
        ("_bwd_chunk", _bwd_chunk, dict(chunk, V=V, BV=BV, **levels), warps(m.BWD_WARPS)),
        ("_bwd_chunk_v (BWD_SPLIT 2, 3)", _bwd_chunk_v, dict(chunk, V=V, BV=BV), warps(m.BWD_WARPS)),
    ] + [(f"_bwd_chunk_k PART {part} (BWD_SPLIT {2 if part == 0 else 3})", _bwd_chunk_k,
          dict(chunk, PART=part, **levels), warps(m.KWARPS)) for part in (0, 1, 2)]
    print(f"sm_90, K = V = {K}, chunk {BT}")
    print("| kernel | warps | registers | stack bytes | shared bytes |")
    print("|---|---|---|---|---|")
    for name, fn, consts, nw in kernels:
        r = resources(sm90.build(fn, consts, nw, f32))
        print(f"| {name} | {nw} | {r['registers']} | {r['stack']} | {r['shared']} |", flush=True)


if __name__ == "__main__":
    main()
