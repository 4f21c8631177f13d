"""Fused output projection and cross entropy (kernels/cross_entropy/README.md): linear_cross_entropy_sum (the
custom op flame::linear_cross_entropy; Triton rows on CUDA, PyTorch on CPU; linear.py) and the row math in plain
PyTorch, cross_entropy_rows_torch (naive.py)."""

from kernels.cross_entropy.linear import linear_cross_entropy_sum
from kernels.cross_entropy.naive import cross_entropy_rows_torch

__all__ = ["linear_cross_entropy_sum", "cross_entropy_rows_torch"]
