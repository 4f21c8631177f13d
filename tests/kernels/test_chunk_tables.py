"""kernels.utils.chunk_tables: which chunk of which sequence every per-chunk program takes, built without a host read."""

import pytest
import torch

from kernels.utils import as_varlen, chunk_tables


def reference_tables(lengths, chunk):
    """The plain enumeration: every sequence's chunks in order."""
    offsets, index = [0], []
    for n, length in enumerate(lengths):
        nt = -(-length // chunk)
        index += [(n, i) for i in range(nt)]
        offsets.append(offsets[-1] + nt)
    return offsets, index


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("lengths", [[1], [15, 16, 17], [0, 5, 0, 64, 0], [100, 1, 33, 16, 0, 250], [7] * 40])
def test_packed_tables_match_the_enumeration_and_spare_chunks_are_empty(lengths, chunk):
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    offsets, index, NT = chunk_tables(cu, chunk, total)
    ref_offsets, ref_index = reference_tables(lengths, chunk)
    assert offsets.tolist() == ref_offsets
    assert NT == total // chunk + len(lengths) >= len(ref_index)
    assert index.shape == (NT, 2) and index.dtype == torch.int32
    assert [tuple(x) for x in index[:len(ref_index)].tolist()] == ref_index
    # spare programs start at or past the end of the sequence they name: every token they touch is masked
    for n, i in index[len(ref_index):].tolist():
        assert 0 <= n < len(lengths) and cu[n] + i * chunk >= cu[n + 1]


@pytest.mark.parametrize("B, T, chunk", [(1, 1, 16), (3, 15, 16), (2, 64, 16), (4, 100, 32)])
def test_equal_rows_tables_are_exact(B, T, chunk):
    cu = as_varlen(B, T, None, "cpu")
    offsets, index, NT = chunk_tables(cu, chunk, B * T, seq_len=T)
    ref_offsets, ref_index = reference_tables([T] * B, chunk)
    assert offsets.tolist() == ref_offsets and NT == len(ref_index)
    assert [tuple(x) for x in index.tolist()] == ref_index


def test_tables_never_read_the_device():
    # A meta tensor has no data: any host read (.tolist(), .item(), int()) raises. On a GPU such a read is a sync
    # that stalls every layer's launch.
    cu = torch.tensor([0, 5, 40, 41], dtype=torch.int32, device="meta")
    offsets, index, NT = chunk_tables(cu, 16, 41)
    assert (offsets.shape, index.shape, NT) == ((4,), (41 // 16 + 3, 2), 41 // 16 + 3)
    offsets, index, NT = chunk_tables(as_varlen(2, 40, None, "meta"), 16, 80, seq_len=40)
    assert (offsets.shape, index.shape, NT) == ((3,), (6, 2), 6)
