"""RWKV-7's CUDA kernels (compiled at run time by kernels.cuda_rtc): the forward's sequence scan (scan.cu, the Triton
`_fwd_scan`'s sequence role), the backward's (bwd_scan.cu, `_bwd_scan`'s) and the forward's per-chunk preparation
(prep.cu, `_fwd_prep`'s work), for what the 0.6B layers run (bf16 inputs, key heads of 64, V a multiple of 64).
`chunk._prep`, `chunk._fwd` and `chunk._bwd` take them where `runs(...)` says so and the Triton kernels elsewhere; each
reads and writes the tensors its Triton kernel does."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import cuda_rtc

KD = 64
"""The key head size the kernels are built for (their KD)."""
BT, VC = 16, 64
"""Tokens a chunk, value columns a block."""


@dataclass(frozen=True)
class Scan:
    """One of the CUDA kernels: its source file, its name (flame_ marks our CUDA kernels in profiles:
    flame.profiling.device_kind), the shared memory a block takes (its Shared, which the build checks), its threads a
    block, the blocks an SM it is built to hold (its registers and shared memory allow them), the stack bytes its
    build may spill (the build test checks all three) and, for a scan, whether it forms the log decays from their
    logits (the LOGITS build) or reads them by chunk."""
    file: str
    name: str
    shared_bytes: int
    threads: int = 256
    blocks: int = 2
    spill_bytes: int = 0
    logits: bool = False

    def source(self) -> str:
        return (Path(__file__).parent / self.file).read_text()

    def defines(self) -> dict:
        """What the build is given: the shared memory a block is launched with, which the source checks against
        its Shared (a static_assert: a build where the two disagree fails), and LOGITS (the scans' choice; prep.cu,
        which always forms w from the logits, ignores it)."""
        return {"SHARED_BYTES": self.shared_bytes, "LOGITS": int(self.logits)}

    def resources(self, arch: str = "sm_90") -> dict:
        """Registers and spilled bytes a thread of the kernel built for `arch` takes (NVRTC, no GPU)."""
        return cuda_rtc.resources(self.source(), self.name, arch, self.defines())

    def kernel(self, device: torch.device) -> cuda_rtc.Kernel | None:
        """The compiled kernel for `device`, or None where it cannot run (no NVRTC, a GPU before sm_90, a failed
        compile: said once, and the Triton scan runs)."""
        return _kernel(self, device.index if device.index is not None else torch.cuda.current_device())


def _inputs_and_formed(forward: bool, logits: bool) -> tuple[int, int, int]:
    """Bytes of a chunk's Inputs and Formed and of the consumers' staging tiles (the structs of scan.cu and
    bwd_scan.cu)."""
    w, rows3 = (2 if logits else 4) * KD * BT, 3 * 2 * BT * KD   # the logits or w by chunk; three bf16 [t][key] tiles
    tile, tile16 = 4 * BT * (BT + 8), 4 * BT * BT      # fp32 [BT, BT] tiles: rows padded; tiles.cuh's tile16
    token_major, key_major = 4 * BT * (KD + 8), 4 * KD * BT
    if forward:   # + W, A_rb, A_rk, Uv, v | R, K, B, eC | bf16 [KD, 16] a warp
        inputs = w + rows3 + token_major + 2 * tile16 + 4 * BT * (VC + 4) + 2 * BT * (VC + 8)
        return inputs, token_major + 2 * key_major + 4 * KD, 4 * KD * 16 * 2
    # + dO, A_rb, T | A_rb^T, T^T, b e^{gC-g}, r e^g, a e^{g-w}, eC | fp32 [KD, 20] a warp
    inputs = w + rows3 + 2 * BT * (VC + 8) + 2 * tile16
    return inputs, 2 * tile + token_major + 2 * key_major + 4 * KD, 4 * KD * 20 * 4


def _shared_bytes(forward: bool, logits: bool = False) -> int:
    inputs, formed, stages = _inputs_and_formed(forward, logits)
    return 3 * inputs + 2 * formed + stages


FORWARD = Scan("scan.cu", "flame_rwkv7_fwd_scan", _shared_bytes(True))
FORWARD_LOGITS = Scan("scan.cu", "flame_rwkv7_fwd_scan", _shared_bytes(True, True), logits=True)
BACKWARD = Scan("bwd_scan.cu", "flame_rwkv7_bwd_scan", _shared_bytes(False))
BACKWARD_LOGITS = Scan("bwd_scan.cu", "flame_rwkv7_bwd_scan", _shared_bytes(False, True), logits=True)

PREP_WARPS = 4
"""Chunks (one a warp) a block of prep.cu."""


def _prep_shared_bytes() -> int:
    """prep.cu's Shared: per warp r, k, a, b (bf16 [BT, KD + 8]), v (bf16 [BT, VC + 8]) and a level's two factor
    tiles (bf16 [BT, KD + 8]), whose place T, the powers of A_ab and the B operands (fp32) take after the levels."""
    x, v = 4 * 2 * BT * (KD + 8), 2 * BT * (VC + 8)
    formed = max(2 * 2 * BT * (KD + 8), 2 * 4 * BT * (BT + 4) + 4 * BT * (KD + 8))
    return PREP_WARPS * (x + v + formed)


# three blocks an SM: ptxas keeps fifteen values on the stack, stored and loaded once a chunk
PREP = Scan("prep.cu", "flame_rwkv7_fwd_prep", _prep_shared_bytes(), threads=32 * PREP_WARPS, blocks=3, spill_bytes=64)


@functools.lru_cache(maxsize=None)
def _kernel(scan: Scan, index: int) -> cuda_rtc.Kernel | None:
    cc = cuda_rtc.capability(index)
    if cc is None or cc[0] < 9:
        return None
    try:
        return cuda_rtc.compile_kernel(scan.source(), scan.name, torch.device("cuda", index), scan.defines())
    except RuntimeError as e:
        warnings.warn(f"RWKV-7's CUDA kernel {scan.name} is not available here, its Triton kernel runs instead: {e}",
                      stacklevel=2)
        return None


def serves(scan: Scan, r: torch.Tensor, v: torch.Tensor, products: bool) -> bool:
    """Whether a CUDA kernel serves calls like this one, whatever their tensors' addresses (so a fake tensor can be
    asked): bf16 inputs, the products the caller's settings ask for (`products`: Settings.cuda_products), K = 64, V a
    multiple of 64 (the block's columns), on a Hopper GPU or later (sm_90's stmatrix) where the kernel compiles."""
    if not (r.is_cuda and r.dtype == v.dtype == torch.bfloat16 and products and r.shape[-1] == KD
            and v.shape[-1] % VC == 0):
        return False
    return scan.kernel(r.device) is not None


def runs(scan: Scan, r: torch.Tensor, v: torch.Tensor, tensors: tuple, products: bool) -> bool:
    """Whether a CUDA kernel takes a call: it serves such calls and `tensors` (the caller's, which it copies 16 bytes
    at a time) are 16-byte aligned."""
    return serves(scan, r, v, products) and all(x.data_ptr() % 16 == 0 for x in tensors)


def forward(logits: bool) -> Scan:
    """The forward scan that reads the log decays as the op has them: from their logits, or by chunk."""
    return FORWARD_LOGITS if logits else FORWARD


def fwd_scan(r, w, w_bias, decay_scale: float, k, v, b, cu, chunk_offsets, W, Uv, Arb, Ark, h0, o, h, U, ht,
             scale: float, TT: int) -> None:
    """The sequence scan over every sequence of cu: o, h, U (and ht where given) from the state h0 (or zero). w: the
    decay's logits (bf16 [1, T, H, K]) with w_bias (fp32 [H * K]), or w by chunk with w_bias None."""
    N, H, V = cu.numel() - 1, r.shape[2], v.shape[-1]
    scan = forward(w_bias is not None)
    scan.kernel(r.device).launch(
        (N, H, V // VC), scan.threads, scan.shared_bytes, r, w, w_bias, ("f32", decay_scale), k, v, b, cu,
        chunk_offsets, W, Uv, Arb, Ark, h0, o, h, U, ht, ("f32", scale), ("i32", H), ("i32", V), ("i32", TT),
        ("i32", int(h0 is not None)), ("i32", int(ht is not None)))


def backward(logits: bool) -> Scan:
    """The backward scan that reads the log decays as the op has them: from their logits, or by chunk."""
    return BACKWARD_LOGITS if logits else BACKWARD


def bwd_scan(r, w, w_bias, decay_scale: float, a, b, do, cu, chunk_offsets, Arb, Tinv, dht, dh, dZ, dh0,
             scale: float, TT: int, seg_first: int, seg_count: int, segment: bool) -> None:
    """The backward sequence scan, last chunk to first: dh (the state gradient at each chunk's end, rows as
    `_bwd_scan` numbers them) and dZ from dht (or zero), the gradient at the start to dh0 where given. w: the
    decay's logits (bf16 [1, T, H, K]) with w_bias (fp32 [H * K]), or w by chunk with w_bias None."""
    N, H, V = cu.numel() - 1, r.shape[2], do.shape[-1]
    scan = backward(w_bias is not None)
    scan.kernel(r.device).launch(
        (N, H, V // VC), scan.threads, scan.shared_bytes, r, w, w_bias, ("f32", decay_scale), a, b, do, cu,
        chunk_offsets, Arb, Tinv, dht, dh, dZ, dh0, ("f32", scale), ("i32", H), ("i32", V), ("i32", TT),
        ("i32", seg_first), ("i32", seg_count), ("i32", int(segment)), ("i32", int(dht is not None)),
        ("i32", int(dh0 is not None)))


def fwd_prep(r, z, w_bias, k, v, a, b, cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv, wf, decay_scale: float, TT: int,
             NT: int) -> None:
    """_fwd_prep's work for the decay from its logits z (bf16) and bias w_bias (fp32 [H * K]): W, Uv, A_rb, A_rk,
    A_ak (bf16), T and w by chunk (where wf is given: the scans that read it), for all NT chunks."""
    H, V = r.shape[2], v.shape[-1]
    PREP.kernel(r.device).launch(
        ((NT + PREP_WARPS - 1) // PREP_WARPS, H, 1), PREP.threads, PREP.shared_bytes, r, z, w_bias, k, v, a, b,
        cu, chunk_index, W, Uv, Arb, Ark, Aak, Tinv, wf, ("f32", decay_scale), ("i32", H), ("i32", V), ("i32", TT),
        ("i32", NT))
