"""A LayerNorm, then RWKV's token shift and its lerps, in one pass (README.md): norm_shift_mix (Triton on CUDA,
PyTorch on CPU; op.py) and the plain PyTorch reference naive_norm_shift_mix."""

from kernels.token_shift.naive import naive_norm_shift_mix
from kernels.token_shift.op import Settings, norm_shift_mix

__all__ = ["norm_shift_mix", "naive_norm_shift_mix", "Settings"]
