"""RWKV-7's log decay from its logits: w = -e^{-1/2} sigmoid(z + bias), in fp32 (a bf16 sigmoid near 0 and 1 loses the
slow channels over long contexts). Per-step decay e^w lies in (e^{-e^{-1/2}}, 1) = (0.545, 1).

chunk_rwkv7(..., w_bias=bias) takes the logits z instead of w and forms w inside the kernel (kernels/rwkv7/README.md,
"Decay from logits"); this is the same function in PyTorch, for the CPU path, decoding and references.
"""

from __future__ import annotations

import math

import torch

DECAY_SCALE = math.exp(-0.5)
"""w = -DECAY_SCALE * sigmoid(.): RWKV-7's bound on how fast one step may forget."""


def log_decay(z: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """w [..., H, K] (fp32, or z's dtype when that is wider) from logits z [..., H, K] and the bias [H * K] or
    [H, K]."""
    dtype = torch.promote_types(z.dtype, torch.float32)
    return -DECAY_SCALE * torch.sigmoid(z.to(dtype) + bias.reshape(z.shape[-2:]).to(dtype))
