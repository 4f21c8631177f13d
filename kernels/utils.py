"""Helpers shared by the Triton kernels: interpreter detection, sequence/chunk bookkeeping."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def is_interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether an op with a Triton and a PyTorch path (token_shift, rwkv7_key, rwkv7_out, silu_rms_norm) runs
    Triton: backend 'triton' forces it, 'torch' the PyTorch path, 'auto' takes Triton for CUDA tensors where Triton
    is installed."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return backend == "triton" or (backend == "auto" and x.is_cuda and importlib.util.find_spec("triton") is not None)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launch code's grids: triton.cdiv is a jit function, about 4 us a call on the host."""
    return -(-a // b)


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


def check_head_sizes(op: str, sizes: dict[str, int], limits: dict[str, int]) -> None:
    """One clear line, before anything launches, where a head size (K, V, slots...) is outside what the op's Triton
    kernel builds: each limited size from 1 to its limit (the largest the sm_90 compile fits), any other from 1."""
    if all(1 <= x <= limits.get(n, x) for n, x in sizes.items()):
        return
    given = ", ".join(f"{n}={x}" for n, x in sizes.items())
    supported = ", ".join(f"{n} from 1 to {limits[n]}" if n in limits else f"any {n} >= 1" for n in sizes)
    raise ValueError(f"{op}: head size {given} is not supported by the Triton kernel ({supported}); "
                     "backend='torch' takes any")


def as_varlen(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Every call becomes a packed batch: B equal-length rows are B sequences of length T (int32 offsets)."""
    if cu_seqlens is None:
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    return cu_seqlens.to(device=device, dtype=torch.int32)


def packed_rows(B: int, T: int, H: int, cu_seqlens: torch.Tensor | None, device):
    """The Triton paths' packing of a call: the sequences' int32 offsets (as_varlen; cu_seqlens needs B == 1) and a
    function giving a [B, T, H, D] input as one contiguous packed row [1, B * T, H, D]."""
    if cu_seqlens is not None:
        assert B == 1, "cu_seqlens needs B == 1 (sequences packed along T)"
    return as_varlen(B, T, cu_seqlens, device), lambda x: x.reshape(1, B * T, H, x.shape[-1]).contiguous()


def chunk_tables(cu_seqlens: torch.Tensor, chunk: int, total: int, seq_len: int | None = None):
    """(chunk_offsets [N+1]: first global chunk of each sequence, chunk_index [NT, 2]: (sequence, chunk in it), NT).

    Chunks never straddle two sequences. Built on the device from shapes alone, never read back to the host: a host
    read (`.tolist()`) would stall the CPU until the GPU drained, once per layer and call, leaving the GPU idle while
    Python prepares the next launches. `total` is the packed length; `seq_len` the common length of B equal rows
    (then NT is exact and the tables are cached). For packed sequences of unknown lengths NT is the upper bound
    total // chunk + N (sum of ceil(len_i / chunk) <= that): the spare chunks map past the last sequence's end,
    and their programs return at once (tl_utils.spare_chunk).
    """
    N = cu_seqlens.numel() - 1
    if seq_len is not None:
        return _equal_rows_tables(N, seq_len, chunk, cu_seqlens.device)
    cu = cu_seqlens.long()
    per_seq = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    offsets = torch.cat((per_seq.new_zeros(1), per_seq.cumsum(0)))
    NT = chunk_count(N, chunk, total)
    c = torch.arange(NT, device=cu.device)
    n = torch.searchsorted(offsets[1:], c, right=True).clamp_max(N - 1)
    index = torch.stack((n, c - offsets[n]), dim=1).to(torch.int32)
    return offsets.to(torch.int32), index, NT


def chunk_count(N: int, chunk: int, total: int, seq_len: int | None = None) -> int:
    """NT of chunk_tables from shapes alone (what a custom op's fake needs to shape per-chunk outputs)."""
    return N * -(-seq_len // chunk) if seq_len is not None else total // chunk + N


@functools.lru_cache(maxsize=16)
def _equal_rows_tables(B: int, T: int, chunk: int, device: torch.device):
    per_seq = -(-T // chunk)
    c = torch.arange(B * per_seq, dtype=torch.int32, device=device)
    index = torch.stack((c // per_seq, c % per_seq), dim=1) if per_seq else c.new_zeros(0, 2)
    offsets = torch.arange(B + 1, dtype=torch.int32, device=device) * per_seq
    return offsets, index, chunk_count(B, chunk, B * T, T)


def per_sequence(B: int, cu_seqlens: torch.Tensor | None, run_one):
    """The PyTorch chunked paths' walk over sequences: run_one(rows, tokens), two slices picking one sequence (or all
    B rows at once when cu_seqlens is None; else B == 1 and cu_seqlens packs the sequences along T), returns
    (o, *final states); their concatenation: o along the tokens, each state along the sequences."""
    if cu_seqlens is None:
        spans = [(slice(None), slice(None))]
    else:
        assert B == 1, "cu_seqlens needs B == 1 (sequences packed along T)"
        cu = cu_seqlens.tolist()
        spans = [(slice(n, n + 1), slice(cu[n], cu[n + 1])) for n in range(len(cu) - 1)]
    results = [run_one(rows, tokens) for rows, tokens in spans]
    return tuple(torch.cat(parts, dim=1 if i == 0 else 0) for i, parts in enumerate(zip(*results)))


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """The naive references' walk over sequences: (row, first token, end) of each, the B rows of T tokens when
    cu_seqlens is None, else the sequences cu_seqlens packs along T in one row (B == 1)."""
    if cu_seqlens is None:
        return [(i, 0, T) for i in range(B)]
    assert B == 1, "cu_seqlens needs B == 1 (sequences packed along T)"
    cu = cu_seqlens.tolist()
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def sequence_count(B: int, cu_seqlens: torch.Tensor | None) -> int:
    return B if cu_seqlens is None else cu_seqlens.numel() - 1
