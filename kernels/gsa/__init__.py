"""GSA (Gated Slot Attention), chunked (kernels/gsa/README.md): chunk_gsa (Triton on CUDA, PyTorch on CPU;
chunk.py), the token-by-token reference naive_gsa and the PyTorch chunked path chunk_gsa_torch."""

from kernels.gsa.chunk import chunk_gsa
from kernels.gsa.naive import naive_gsa
from kernels.gsa.torch_chunk import chunk_gsa_torch

__all__ = ["chunk_gsa", "naive_gsa", "chunk_gsa_torch"]
