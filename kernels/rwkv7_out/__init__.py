"""RWKV-7's output epilogue, fused (README.md): rwkv7_out (Triton on CUDA, PyTorch on CPU; op.py) and the plain
PyTorch forward and backward naive_rwkv7_out(_bwd)."""

from kernels.rwkv7_out.naive import naive_rwkv7_out, naive_rwkv7_out_bwd
from kernels.rwkv7_out.op import rwkv7_out

__all__ = ["rwkv7_out", "naive_rwkv7_out", "naive_rwkv7_out_bwd"]
