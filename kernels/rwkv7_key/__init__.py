"""RWKV-7's key prologue, fused (README.md): rwkv7_key (Triton on CUDA, PyTorch on CPU; op.py) and the plain
PyTorch forward and backward naive_rwkv7_key(_bwd)."""

from kernels.rwkv7_key.naive import naive_rwkv7_key, naive_rwkv7_key_bwd
from kernels.rwkv7_key.op import rwkv7_key

__all__ = ["rwkv7_key", "naive_rwkv7_key", "naive_rwkv7_key_bwd"]
