"""Fused output projection and cross entropy as a sum over target rows (math and design in README.md): the chunk
loop, the Triton launch and the custom ops torch.compile sees whole.

    loss = linear_cross_entropy_sum(hidden [..., D], weight [V, D], labels [...], chunk_size=4096,
                                    l2wrap_factor=0.0, ignore_index=-100, backend=None, block_v=4096)

loss is the fp32 sum over rows with a label of logsumexp(h W^T) - (h W^T)[label]. l2wrap_factor > 0 adds L2Wrap's
gradient (factor * m at each labelled row's first arg-max logit m) without changing the value. Logits are
h @ W^T in the inputs' dtype (under autocast: the autocast dtype, as a matmul there would give); the cross entropy
runs in fp32 over them. With a gradient wanted, the forward already computes d loss / d hidden and d loss / d weight
(one chunk of logits at a time, overwritten in place by its own gradient), and the backward only scales them by
the incoming gradient: three matmuls in all, no fp32 logits, no recomputation. CUDA runs the row kernel in Triton
(rows.py), CPU in PyTorch (naive.py); backend="triton" | "torch" forces one (tests run Triton on CPU tensors
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.cross_entropy.naive import cross_entropy_rows_torch
from kernels.launch import launch
from kernels.utils import next_pow2

BLOCK_V = 4096
"""Columns per tile of the row kernel: 16 fp32 values per thread at 8 warps."""
ROW_WARPS = 8
"""Warps per row program (256 threads share a 4096-column tile); not yet tuned on a GPU."""
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Logit dtypes the Triton rows take; others (fp64) run the PyTorch rows."""


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_size: int = 4096, l2wrap_factor: float = 0.0, ignore_index: int = -100,
                             backend: str | None = None, block_v: int = BLOCK_V) -> torch.Tensor:
    """sum_i CE(hidden_i @ weight^T, labels_i) over labels_i != ignore_index, fp32 (module docstring)."""
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2 or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy_sum: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                         f"labels {tuple(labels.shape)} do not fit (hidden [..., D], weight [V, D], labels [...])")
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy_sum: chunk_size must be >= 1, got {chunk_size}")
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy_sum: hidden is {hidden.dtype} but weight is {weight.dtype}")
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    grad = torch.is_grad_enabled()
    loss, _, _ = torch.ops.flame.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, float(l2wrap_factor),
        ignore_index, grad and hidden.requires_grad, grad and weight.requires_grad, backend or "", block_v)
    return loss


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """d loss / d weight sums over every chunk: in fp32 (fp64 stays fp64), cast to the weight's dtype at the end."""
    return torch.promote_types(dtype, torch.float32)


def _pick_backend(backend: str, logits_dtype: torch.dtype, device: torch.device) -> str:
    if backend:
        return backend
    return "triton" if device.type == "cuda" and logits_dtype in TRITON_DTYPES else "torch"


def cross_entropy_rows_triton(logits, labels, losses, l2wrap_factor: float, ignore_index: int, write_grad: bool,
                              block_v: int = BLOCK_V):
    """Triton version of naive.cross_entropy_rows_torch (same arguments): one program per row."""
    from kernels.cross_entropy.rows import _cross_entropy_rows

    n, V = logits.shape
    if n == 0:
        return
    assert logits.is_contiguous() and logits.dtype in TRITON_DTYPES, (logits.dtype, logits.stride())
    launch(_cross_entropy_rows, (n,), logits, labels.contiguous(), losses, V, float(l2wrap_factor), int(ignore_index),
           BV=min(block_v, next_pow2(V)), L2WRAP=bool(l2wrap_factor), WRITE_GRAD=write_grad, num_warps=ROW_WARPS)


def _accumulate(acc: torch.Tensor, grad_t: torch.Tensor, h: torch.Tensor) -> None:
    """acc += grad_t @ h, the product rounded only once, into acc's dtype."""
    if acc.dtype == grad_t.dtype:
        acc.addmm_(grad_t, h)
    elif acc.is_cuda:   # cuBLAS reads and writes the fp32 accumulator itself: no [V, D] temporary
        torch.addmm(acc, grad_t, h, out_dtype=acc.dtype, out=acc)
    else:
        acc += (grad_t @ h).to(acc.dtype)


@torch.library.custom_op("flame::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                          l2wrap_factor: float, ignore_index: int, grad_hidden: bool, grad_weight: bool,
                          backend: str, block_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss sum, d loss / d hidden [N, D] in hidden's dtype, d loss / d weight [V, D] in the accumulator
    dtype); a gradient not asked for is an empty tensor. hidden [N, D] and weight [V, D] share one dtype."""
    N, D = hidden.shape
    V = weight.shape[0]
    write = grad_hidden or grad_weight
    rows = cross_entropy_rows_torch if _pick_backend(backend, hidden.dtype, hidden.device) == "torch" else \
        lambda *a: cross_entropy_rows_triton(*a, block_v=block_v)
    losses = torch.empty(N, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    dw = weight.new_zeros(V, D, dtype=_accumulator_dtype(weight.dtype)) if grad_weight else weight.new_empty(0)
    chunk = max(1, min(chunk_size, N))
    buffer = hidden.new_empty(chunk, V)   # one chunk's logits, then its gradient
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, N, chunk):
            end = min(start + chunk, N)
            h, logits = hidden[start:end], buffer[:end - start]
            torch.mm(h, weight.t(), out=logits)
            rows(logits, labels[start:end], losses[start:end], l2wrap_factor, ignore_index, write)
            if grad_hidden:
                torch.mm(logits, weight, out=dh[start:end])
            if grad_weight:
                _accumulate(dw, logits.t(), h)
    return losses.sum(), dh, dw


@_linear_cross_entropy.register_fake
def _(hidden, weight, labels, chunk_size, l2wrap_factor, ignore_index, grad_hidden, grad_weight, backend, block_v):
    loss = hidden.new_empty((), dtype=torch.float32)
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape, dtype=_accumulator_dtype(weight.dtype)) if grad_weight else \
        weight.new_empty(0)
    return loss, dh, dw


@torch.library.custom_op("flame::linear_cross_entropy_bwd", mutates_args=())
def _linear_cross_entropy_bwd(grad_loss: torch.Tensor, dh: torch.Tensor, dw: torch.Tensor, hidden_dtype: torch.dtype,
                              weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's gradients times the incoming scalar gradient, in fp32, returned in the inputs' dtypes."""
    def scaled(x, dtype):
        return (x.to(torch.promote_types(x.dtype, torch.float32)) * grad_loss).to(dtype)
    return scaled(dh, hidden_dtype), scaled(dw, weight_dtype)


@_linear_cross_entropy_bwd.register_fake
def _(grad_loss, dh, dw, hidden_dtype, weight_dtype):
    return torch.empty_like(dh, dtype=hidden_dtype), torch.empty_like(dw, dtype=weight_dtype)


def _setup_context(ctx, inputs, output):
    hidden, weight, *_, grad_hidden, grad_weight, _backend, _block_v = inputs
    _, dh, dw = output
    ctx.save_for_backward(dh, dw)
    ctx.mark_non_differentiable(dh, dw)
    ctx.dtypes = (hidden.dtype, weight.dtype)
    ctx.wanted = (grad_hidden, grad_weight)


def _backward(ctx, grad_loss, _grad_dh, _grad_dw):
    dh, dw = ctx.saved_tensors
    gh, gw = torch.ops.flame.linear_cross_entropy_bwd(grad_loss, dh, dw, *ctx.dtypes)
    return (gh if ctx.wanted[0] else None, gw if ctx.wanted[1] else None) + (None,) * 8


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
