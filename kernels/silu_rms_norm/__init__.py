"""The GSA output norm, fused (README.md): silu_rms_norm (Triton on CUDA, PyTorch on CPU; op.py) and the plain
PyTorch forward and backward naive_silu_rms_norm(_bwd)."""

from kernels.silu_rms_norm.naive import naive_silu_rms_norm, naive_silu_rms_norm_bwd
from kernels.silu_rms_norm.op import silu_rms_norm

__all__ = ["silu_rms_norm", "naive_silu_rms_norm", "naive_silu_rms_norm_bwd"]
