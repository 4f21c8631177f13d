"""Random inputs for the chunk kernels' tests, one maker per op: each op's test file and the custom-op checks
(tests/kernels/test_custom_ops.py) draw the same tensors from here."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.kernels import common


def gsa_inputs(B, T, H, K, V, M, *, device="cpu", dtype=torch.float32, decay="model", seed=0, n_seq=None):
    """GSA-shaped inputs: swish q, k; slot writes s in (0, 1); log forget gate g <= 0 (fp32); random states."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *sh: torch.randn(*sh, generator=gen)  # noqa: E731
    q, k, v = F.silu(rnd(B, T, H, K)), F.silu(rnd(B, T, H, K)), rnd(B, T, H, V)
    s = torch.sigmoid(rnd(B, T, H, M))   # independent of g here, so ds and dg are checked apart
    if decay == "model":      # the GSA layer's gate: logsigmoid(.) / 8
        g = F.logsigmoid(2 * rnd(B, T, H, M)) / 8
    else:                     # "wide" or "stress"
        g = common.log_decays((B, T, H, M), decay, gen)
    xs = [q, k, v, s, g]
    xs = [x.to(device=device, dtype=torch.float32 if i == 4 else dtype) for i, x in enumerate(xs)]
    N = B if n_seq is None else n_seq
    h0 = (0.5 * rnd(N, H, K, M)).to(device), rnd(N, H, M, V).to(device)
    return xs, h0


def rwkv6_inputs(B, T, H, K, V, *, device="cpu", dtype=torch.float32, decay="model", seed=0, n_seq=None):
    """RWKV-6-shaped inputs: r, k, v, log decay w <= 0 (fp32), bonus u [H, K]; and initial states."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    r, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    if decay == "model":      # the RWKV-6 layer's initial range: -exp(d), d in [-6, -1]
        w = -torch.exp(torch.empty(B, T, H, K).uniform_(-6, -1, generator=gen))
    else:                     # "wide" or "stress"
        w = common.log_decays((B, T, H, K), decay, gen)
    u = rnd(H, K)
    xs = [x.to(device=device, dtype=torch.float32 if i == 3 else dtype) for i, x in enumerate((r, k, v, w, u))]
    h0 = rnd(B if n_seq is None else n_seq, H, K, V).to(device)
    return xs, h0



def rwkv7_inputs(B, T, H, K, V, *, device="cpu", dtype=torch.float32, decay="model", seed=0, n_seq=None):
    """RWKV-7-shaped inputs: a = -kk, b = kk * rate (kk unit-norm per head), log decay w <= 0 (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    r, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    kk = F.normalize(rnd(B, T, H, K), dim=-1)
    rate = torch.rand(B, T, H, K, generator=gen)
    if decay == "model":      # the RWKV-7 layer's range: -exp(-0.5) * sigmoid(.)
        w = -math.exp(-0.5) * torch.sigmoid(2 * rnd(B, T, H, K))
    else:                     # "wide" or "stress"
        w = common.log_decays((B, T, H, K), decay, gen)
    xs = [r, w, k, v, -kk, kk * rate]
    xs = [x.to(device=device, dtype=torch.float32 if i == 1 else dtype) for i, x in enumerate(xs)]
    N = B if n_seq is None else n_seq
    h0 = rnd(N, H, K, V).to(device)
    return xs, h0


def rwkv7_logit_inputs(B, T, H, K, V, *, device="cpu", dtype=torch.float32, seed=0, n_seq=None, spread=3.0):
    """rwkv7_inputs with RWKV-7's decay logits z [B, T, H, K] (in dtype) and bias [H * K] (fp32) instead of w:
    `spread` sets how far z + bias reaches into the sigmoid's flat ends (logits of -6 .. 6 and beyond)."""
    xs, h0 = rwkv7_inputs(B, T, H, K, V, device=device, dtype=dtype, seed=seed, n_seq=n_seq)
    gen = torch.Generator().manual_seed(seed + 1)
    z = (spread * torch.randn(B, T, H, K, generator=gen)).to(device=device, dtype=dtype)
    bias = torch.linspace(-spread, spread, H * K)[torch.randperm(H * K, generator=gen)].to(device)
    return xs, z, bias, h0
