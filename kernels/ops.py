"""The chunked ops, each as one adapter: its benchmark shapes (one per shape regime its launch code chooses), inputs
made as its model layer makes them, our op called as the model's training forward calls it (RWKV-7: the decay from
its logits, w_bias; GSA: from the stacked projection) with given settings, and FLA's op called as FLA's layer calls it.

benchmarks/bench_kernels.py times every op through these; kernels.sm90 records and compiles their launches at the same
shapes; kernels.settings parses "op.field=value" against each op's Settings.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Op:
    name: str
    module: str                  # its package: kernels.<name>.chunk holds its Settings
    shape_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    make_inputs: Callable        # (*shape, device) -> list of tensors, as the model's layer has them
    call: Callable               # (shape, inputs, settings) -> output: the model's call of our op
    fla_call: Callable           # (FLA's module, shape, inputs) -> output: FLA's layer's call of FLA's op
    qkv: Callable                # (shape, inputs) -> (q, k, v) [B, T, H, D]: the attention row's inputs
    model_call: str              # the call the rows time, in words (the kernel READMEs name it)

    def settings_type(self):
        return importlib.import_module(f"{self.module}.chunk").Settings

    def ours(self, shape, xs, settings=None):
        """Our output on inputs xs of `shape` (the Triton kernel whatever the device: meta tensors record its
        launches)."""
        return self.call(shape, xs, settings)

    def fla(self, shape):
        """FLA's call on our inputs of `shape`, or raise (FLA missing, or broken against this torch/triton)."""
        mod = importlib.import_module(f"fla.ops.{self.name}")
        return lambda *xs: self.fla_call(mod, shape, xs)


def rwkv7_inputs(B, T, H, K, V, device="cuda"):
    """As the RWKV-7 layer makes them: a = -kk, b = kk * rate (kk unit-norm); the decay's logits z less their bias
    (bf16, x's dtype) and the bias w0 ([H * K], a parameter: bf16 as FSDP's mixed precision gives it to the training
    forward): the log decay -e^-0.5 sigmoid(z + w0)."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    r, k = (torch.randn(B, T, H, K, device=device, dtype=dt) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device, dtype=dt)
    kk = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    rate = torch.rand(B, T, H, K, device=device)
    z = torch.randn(B, T, H, K, device=device, dtype=dt)
    w0 = torch.randn(H * K, device=device, dtype=dt)
    return [r, z, k, v, (-kk).to(dt), (kk * rate).to(dt), w0]


def rwkv7_call(shape, xs, settings):
    """As the RWKV-7 layer calls it: the logits and w_bias, the log decay formed in the kernel in fp32."""
    from kernels.rwkv7.chunk import chunk_rwkv7

    r, z, k, v, a, b, w0 = xs
    return chunk_rwkv7(r, z, k, v, a, b, scale=1.0, w_bias=w0, backend="triton", settings=settings)[0]


def rwkv7_fla(fla, shape, xs):
    """As FLA's RWKV7 layer calls it: the log decay formed in PyTorch from the same logits, passed in bf16, bounded
    below, chunks of 64."""
    from kernels.rwkv7.decay import log_decay

    r, z, k, v, a, b, w0 = xs
    return fla.chunk_rwkv7(r, log_decay(z, w0).to(r.dtype), k, v, a, b, scale=1.0, safe_gate=True,
                           lower_bound=-math.exp(-0.5), chunk_size=64)[0]


GSA_NORMALIZER = 8.0
"""The GSA configs' gate_logit_normalizer."""


def gsa_inputs(B, T, H, D, M, device="cuda"):
    """As the GSA layer without short convolutions makes it: y = (q | k | v | f), one matmul's output, bf16
    [B, T, 3 H D + H M]."""
    torch.manual_seed(0)
    return [torch.randn(B, T, 3 * H * D + H * M, device=device, dtype=torch.bfloat16)]


def gsa_call(shape, xs, settings):
    """As the GSA layer calls it in training: the feature maps and the chunk op from y in one call."""
    from kernels.gsa.projection import chunk_gsa_from_projection

    _, _, H, D, M = shape
    return chunk_gsa_from_projection(xs[0], H, D, M, GSA_NORMALIZER, scale=1.0, backend="triton", settings=settings)


def gsa_fla(fla, shape, xs):
    """As FLA's GSA layer calls it: the same feature maps in PyTorch (swish q, k, v; g = logsigmoid(f) / 8;
    s = 1 - e^g), then FLA's chunk_gsa with s and g in bf16."""
    from kernels.gsa.projection import feature_maps

    B, T, H, D, M = shape
    q, k, v, s, g = feature_maps(*xs[0].split([H * D] * 3 + [H * M], dim=-1), GSA_NORMALIZER)
    q, k, v = (x.view(B, T, H, D) for x in (q, k, v))
    return fla.chunk_gsa(q, k, v, s.view(B, T, H, M), g.view(B, T, H, M).to(q.dtype), scale=1.0)[0]


def gsa_qkv(shape, xs):
    B, T, H, D, M = shape
    return [x.view(B, T, H, D) for x in xs[0].split([H * D] * 3 + [H * M], dim=-1)[:3]]


def rwkv6_inputs(B, T, H, K, V, device="cuda"):
    """As the RWKV-6 layer makes them: log decay -exp(d) in fp32 with d in RWKV-6's initial range [-6, -1] (so
    [-0.37, -0.0025] per step), bonus u [H, K]."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    r, k = (torch.randn(B, T, H, K, device=device, dtype=dt) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device, dtype=dt)
    w = -torch.exp(torch.empty(B, T, H, K, device=device).uniform_(-6, -1))
    u = (0.5 * torch.randn(H, K, device=device)).to(dt)
    return [r, k, v, w, u]


def rwkv6_call(shape, xs, settings):
    """As the RWKV-6 layer calls it: the log decay in fp32, scale 1."""
    from kernels.rwkv6.chunk import chunk_rwkv6

    return chunk_rwkv6(*xs, scale=1.0, backend="triton", settings=settings)[0]


def rwkv6_fla(fla, shape, xs):
    """As FLA's RWKV6 layer calls it: the log decay in the model's dtype, scale 1."""
    r, k, v, w, u = xs
    return fla.chunk_rwkv6(r, k, v, w.to(r.dtype), u, scale=1.0)[0]


def first_three(shape, xs):
    return xs[:3]


OPS = {
    # B=8 T=4096 takes the sequential scans, B=2 T=16384 the blocked ones (few sequence-heads)
    "rwkv7": Op("rwkv7", "kernels.rwkv7", ("B", "T", "H", "K", "V"),
                ((8, 4096, 16, 64, 64), (2, 16384, 16, 64, 64)), rwkv7_inputs, rwkv7_call, rwkv7_fla, first_three,
                "chunk_rwkv7(r, z, k, v, a, b, scale=1.0, w_bias=w0): the decay's logits, as the RWKV-7 layer"),
    # the GSA layer at hidden 1024 (4 heads, K = V = 256, 64 slots). B=8 T=4096 takes the forward without stored
    # states (many sequence-heads), B=2 T=16384 the one that stores them
    "gsa": Op("gsa", "kernels.gsa", ("B", "T", "H", "D", "M"), ((8, 4096, 4, 256, 64), (2, 16384, 4, 256, 64)),
              gsa_inputs, gsa_call, gsa_fla, gsa_qkv,
              "chunk_gsa_from_projection(y, H, D, M, 8.0): the stacked projection, as the GSA layer in training"),
    # B=8 T=4096 takes wide V tiles in the scans, B=2 T=16384 narrow ones (few sequence-heads)
    "rwkv6": Op("rwkv6", "kernels.rwkv6", ("B", "T", "H", "K", "V"),
                ((8, 4096, 16, 64, 64), (2, 16384, 16, 64, 64)), rwkv6_inputs, rwkv6_call, rwkv6_fla, first_three,
                "chunk_rwkv6(r, k, v, w, u, scale=1.0): the log decay in fp32, as the RWKV-6 layer"),
}
