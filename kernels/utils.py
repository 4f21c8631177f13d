"""Helpers shared by the Triton kernels: interpreter detection, sequence/chunk bookkeeping."""

from __future__ import annotations

import functools
import os

import torch


def is_interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def scan_tile(D: int, sequences_x_heads: int) -> int:
    """Feature tile of a sequential state scan (one program per sequence, head and tile walks all of the sequence's
    chunks in order): the largest of 64, 32, 16 that still gives about one program per SM of an H100 (128).
    Few long sequences then take narrow tiles, many sequences wide ones (measured for GSA and RWKV-7 in their
    READMEs)."""
    full = min(64, max(16, next_pow2(D)))
    for bd in (64, 32):
        if sequences_x_heads * -(-D // bd) >= 128:
            return min(bd, full)
    return min(16, full)


def as_varlen(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Every call becomes a packed batch: B equal-length rows are B sequences of length T (int32 offsets)."""
    if cu_seqlens is None:
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    return cu_seqlens.to(device=device, dtype=torch.int32)


@functools.lru_cache(maxsize=64)
def _chunk_tables(cu: tuple, chunk: int):
    chunk_offsets, index = [0], []
    for n in range(len(cu) - 1):
        nt = -(-(cu[n + 1] - cu[n]) // chunk)
        index += [(n, i) for i in range(nt)]
        chunk_offsets.append(chunk_offsets[-1] + nt)
    return chunk_offsets, index


def chunk_tables(cu_seqlens: torch.Tensor, chunk: int):
    """(chunk_offsets [N+1]: first global chunk of each sequence, chunk_index [NT, 2]: (sequence, chunk in it)).

    Chunks never straddle two sequences. Reads cu_seqlens on the host (one sync per call, cached by value).
    """
    offsets, index = _chunk_tables(tuple(cu_seqlens.tolist()), chunk)
    dev = cu_seqlens.device
    index_t = torch.tensor(index if index else [(0, 0)], dtype=torch.int32, device=dev).reshape(-1, 2)
    return torch.tensor(offsets, dtype=torch.int32, device=dev), index_t, len(index)
