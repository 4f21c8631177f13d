"""RWKV-7, chunked (kernels/rwkv7/README.md): chunk_rwkv7 (Triton on CUDA, PyTorch on CPU; chunk.py), the
token-by-token reference naive_rwkv7 and the PyTorch chunked path chunk_rwkv7_torch."""

from kernels.rwkv7.chunk import chunk_rwkv7
from kernels.rwkv7.naive import naive_rwkv7
from kernels.rwkv7.torch_chunk import chunk_rwkv7_torch

__all__ = ["chunk_rwkv7", "naive_rwkv7", "chunk_rwkv7_torch"]
