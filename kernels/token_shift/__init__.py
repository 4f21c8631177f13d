"""RWKV's token shift and its lerps in one pass (README.md): shift_mix (Triton on CUDA, PyTorch on CPU; op.py) and
the plain PyTorch reference naive_shift_mix."""

from kernels.token_shift.naive import naive_shift_mix
from kernels.token_shift.op import Settings, shift_mix

__all__ = ["shift_mix", "naive_shift_mix", "Settings"]
