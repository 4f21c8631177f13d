"""The forward sequence scan in CUDA (scan.cu, compiled at run time by kernels.cuda_rtc): the Triton `_fwd_scan`'s
sequence role, for what the 0.6B layers run (bf16 inputs, key heads of 64, V a multiple of 64). `chunk._fwd` takes
it where `runs(...)` says so and the Triton scan elsewhere; both read and write the same tensors."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from kernels import cuda_rtc

KD = 64
"""The key head size scan.cu is built for (its KD)."""
NAME = "flame_rwkv7_fwd_scan"
"""The kernel's name: flame_ marks our CUDA kernels in profiles (flame.profiling.device_kind)."""


@functools.lru_cache(maxsize=1)
def _source() -> str:
    return (Path(__file__).parent / "scan.cu").read_text()


def runs(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, bf16_kept: bool) -> bool:
    """Whether the CUDA scan takes a call: bf16 inputs (the chunk states and U kept in bf16) starting 16-byte
    aligned (it copies 16 bytes at a time), K = 64, V a multiple of 64 (the block's columns), on a Hopper GPU or later
    (sm_90's stmatrix) where the kernel compiles."""
    if not (r.is_cuda and r.dtype == v.dtype == torch.bfloat16 and bf16_kept and r.shape[-1] == KD
            and v.shape[-1] % 64 == 0 and all(x.data_ptr() % 16 == 0 for x in (r, k, v, b))):
        return False
    return kernel(r.device) is not None


def defines() -> dict:
    """What the kernel's build is given: the shared memory a block is launched with, which scan.cu checks against
    its Shared (a static_assert: a build where the two disagree fails)."""
    return {"SHARED_BYTES": shared_bytes()}


def resources(arch: str = "sm_90") -> dict:
    """Registers and spilled bytes a thread of the kernel built for `arch` takes (NVRTC, no GPU)."""
    return cuda_rtc.resources(_source(), NAME, arch, defines())


def shared_bytes() -> int:
    """Dynamic shared memory of a block: scan.cu's Shared."""
    bt, vc = 16, 64
    inputs = 4 * KD * bt + 3 * 2 * bt * KD + 4 * bt * (KD + 8) + 2 * 4 * bt * (bt + 8) + 4 * bt * (vc + 4) \
        + 2 * bt * (vc + 8)
    formed = 4 * bt * (KD + 8) + 2 * 4 * KD * (bt + 4) + 4 * KD
    return 3 * inputs + 2 * formed + 4 * KD * 16 * 2


def kernel(device: torch.device) -> cuda_rtc.Kernel | None:
    """The compiled scan for `device`, or None where it cannot run (no NVRTC, a GPU before sm_90, a failed compile:
    said once, and the Triton scan runs)."""
    return _kernel(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _kernel(index: int) -> cuda_rtc.Kernel | None:
    cc = cuda_rtc.capability(index)
    if cc is None or cc[0] < 9:
        return None
    try:
        return cuda_rtc.compile_kernel(_source(), NAME, torch.device("cuda", index), defines())
    except RuntimeError as e:
        warnings.warn(f"RWKV-7's CUDA scan is not available here, the Triton scan runs instead: {e}", stacklevel=2)
        return None


def fwd_scan(r, wf, k, v, b, cu, chunk_offsets, W, Uv, Arb, Ark, h0, o, h, U, ht, scale: float, TT: int) -> None:
    """The sequence scan over every sequence of cu: o, h, U (and ht where given) from the state h0 (or zero)."""
    N, H, V = cu.numel() - 1, r.shape[2], v.shape[-1]
    kernel(r.device).launch(
        (N, H, V // 64), 256, shared_bytes(), r, wf, k, v, b, cu, chunk_offsets, W, Uv, Arb, Ark, h0,
        o, h, U, ht, ("f32", scale), ("i32", H), ("i32", V), ("i32", TT), ("i32", int(h0 is not None)),
        ("i32", int(ht is not None)))
