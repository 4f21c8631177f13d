"""The chunked ops, each as one adapter: its benchmark shapes (one per shape regime its launch code chooses), inputs
made as its model layer makes them, our call with given settings, and FLA's call for comparison.

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
    module: str                  # its package: kernels.<name>.chunk holds chunk_<name> and Settings
    shape_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    make_inputs: Callable        # (*shape, device) -> list of tensors
    call: Callable               # (chunk function, inputs, settings) -> output
    fla_call: Callable           # (FLA's module, inputs) -> output

    def settings_type(self):
        return importlib.import_module(f"{self.module}.chunk").Settings

    def ours(self, xs, settings=None):
        """Our output on inputs xs (the Triton kernel whatever the device: meta tensors record its launches)."""
        fn = getattr(importlib.import_module(f"{self.module}.chunk"), f"chunk_{self.name}")
        return self.call(fn, xs, settings)

    def fla(self):
        """FLA's call on our inputs, or raise (FLA missing, or broken against this torch/triton)."""
        mod = importlib.import_module(f"fla.ops.{self.name}")
        return lambda *xs: self.fla_call(mod, xs)


def rwkv7_inputs(B, T, H, K, V, device="cuda"):
    """As the RWKV-7 layer makes them: a = -kk, b = kk * rate (kk unit-norm), log decay in [-e^-0.5, 0) in fp32."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    r, k = (torch.randn(B, T, H, K, device=device, dtype=dt) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device, dtype=dt)
    kk = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    rate = torch.rand(B, T, H, K, device=device)
    w = -math.exp(-0.5) * torch.sigmoid(torch.randn(B, T, H, K, device=device))
    return [r, w, k, v, (-kk).to(dt), (kk * rate).to(dt)]


def gsa_inputs(B, T, H, D, M, device="cuda"):
    """As the GSA layer makes them: swish q, k, silu v; log gate f = logsigmoid(.) / 8 in fp32, slot writes
    s = 1 - e^f."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    q, k, v = (F.silu(torch.randn(B, T, H, D, device=device)).to(dt) for _ in range(3))
    f = F.logsigmoid(torch.randn(B, T, H, M, device=device)) / 8
    return [q, k, v, (-torch.expm1(f)).to(dt), f]


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


OPS = {
    # B=8 T=4096 takes the sequential scans, B=2 T=16384 the blocked ones (few sequence-heads)
    "rwkv7": Op("rwkv7", "kernels.rwkv7", ("B", "T", "H", "K", "V"),
                ((8, 4096, 16, 64, 64), (2, 16384, 16, 64, 64)), rwkv7_inputs,
                lambda fn, xs, s: fn(*xs, scale=1.0, backend="triton", settings=s)[0],
                # as FLA's RWKV7 layer calls it: bf16 log decay bounded below, chunks of 64
                lambda fla, xs: fla.chunk_rwkv7(xs[0], xs[1].to(xs[0].dtype), *xs[2:], scale=1.0, safe_gate=True,
                                                lower_bound=-math.exp(-0.5), chunk_size=64)[0]),
    # the GSA layer at hidden 1024 (4 heads, K = V = 256, 64 slots). B=8 T=4096 takes the forward without stored
    # states (many sequence-heads), B=2 T=16384 the one that stores them
    "gsa": Op("gsa", "kernels.gsa", ("B", "T", "H", "D", "M"), ((8, 4096, 4, 256, 64), (2, 16384, 4, 256, 64)),
              gsa_inputs,
              lambda fn, xs, s: fn(*xs, scale=1.0, backend="triton", settings=s)[0],
              # as FLA's GSA layer passes them: s and the log gate in bf16
              lambda fla, xs: fla.chunk_gsa(*xs[:4], xs[4].to(xs[0].dtype), scale=1.0)[0]),
    # B=8 T=4096 takes wide V tiles in the scans, B=2 T=16384 narrow ones (few sequence-heads)
    "rwkv6": Op("rwkv6", "kernels.rwkv6", ("B", "T", "H", "K", "V"),
                ((8, 4096, 16, 64, 64), (2, 16384, 16, 64, 64)), rwkv6_inputs,
                lambda fn, xs, s: fn(*xs, scale=1.0, backend="triton", settings=s)[0],
                # as FLA's RWKV6 layer calls it: the log decay in the model's dtype, scale 1
                lambda fla, xs: fla.chunk_rwkv6(xs[0], xs[1], xs[2], xs[3].to(xs[0].dtype), xs[4], scale=1.0)[0]),
}
