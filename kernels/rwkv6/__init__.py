"""RWKV-6 "Finch", chunked (kernels/rwkv6/README.md): chunk_rwkv6 (Triton on CUDA, PyTorch on CPU; chunk.py), the
token-by-token reference naive_rwkv6, the PyTorch chunked path chunk_rwkv6_torch and the one-token decoding step
recurrent_step (step.py)."""

from kernels.rwkv6.chunk import chunk_rwkv6
from kernels.rwkv6.naive import naive_rwkv6
from kernels.rwkv6.step import recurrent_step
from kernels.rwkv6.torch_chunk import chunk_rwkv6_torch

__all__ = ["chunk_rwkv6", "naive_rwkv6", "chunk_rwkv6_torch", "recurrent_step"]
