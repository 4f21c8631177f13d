"""The send/recv chain of context parallelism: rank r of a cp group receives what crosses into its piece from rank
r - 1 (a layer's recurrent state, a token-shift input) and sends its own on to rank r + 1; the backward sends each
gradient back the same way. Exact, and nothing is computed twice: the cost is that rank r waits for rank r - 1's
piece of each layer (a pipeline of cp - 1 steps forward and backward), in place of every rank computing its piece's
transition (flame/context_parallel.py's gather).

The four transfers are custom ops, so a compiled, checkpointed block stays one graph that calls them where they
stand: send_next / recv_prev in forward, recv_next / send_prev (their backwards) in backward. Each takes a tensor it
does not read, only to be placed after it (`after`), so that a receive waits no earlier than its result is needed.
The sends are isend without a wait: a blocking send would hold the sender until the receiver gets there. Their
handles are kept until the next forward (wait_sends). Selective checkpointing must keep their outputs
(flame/activation_checkpoint.py): a receive run again in backward would wait for a send that never comes.

Each kind of transfer has its own process group (ContextParallel.links): a compiled backward may order independent
transfers differently on two ranks, and NCCL pairs the sends and receives of one group in order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_pending_sends: list = []


def wait_sends() -> None:
    """Let the current stream wait for every send issued so far (they have completed by the next forward: the next
    rank needed them); frees their buffers."""
    while _pending_sends:
        _pending_sends.pop().wait()


def _peer(group_name: str, step: int) -> tuple[dist.ProcessGroup, int]:
    group = _resolve_process_group(group_name)
    return group, dist.get_rank(group) + step


def _send(x: torch.Tensor, group_name: str, step: int) -> None:
    group, peer = _peer(group_name, step)
    _pending_sends.append(dist.isend(x.contiguous(), group_dst=peer, group=group))


def _recv(shape: list[int], dtype: torch.dtype, device: torch.device, group_name: str, step: int) -> torch.Tensor:
    group, peer = _peer(group_name, step)
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.irecv(out, group_src=peer, group=group).wait()   # NCCL: the stream waits, not the host
    return out


@torch.library.custom_op("flame_cp::send_next", mutates_args=())
def send_next(x: torch.Tensor, group: str) -> torch.Tensor:
    """Send x to the next rank; returns a zero fp32 scalar, the `link` the caller adds into its graph (to a small
    tensor whose gradient exists where x's gradient is needed: autograd runs the receive of that gradient then)."""
    _send(x, group, 1)
    return x.new_zeros((), dtype=torch.float32)


@send_next.register_fake
def _(x, group):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("flame_cp::recv_next", mutates_args=())
def recv_next(after: torch.Tensor, shape: list[int], dtype: torch.dtype, group: str) -> torch.Tensor:
    """send_next's backward: the gradient of the sent tensor, from the next rank."""
    return _recv(shape, dtype, after.device, group, 1)


@recv_next.register_fake
def _(after, shape, dtype, group):
    return after.new_empty(shape, dtype=dtype)


def _send_next_setup(ctx, inputs, output):
    x, ctx.group = inputs
    ctx.shape, ctx.dtype = list(x.shape), x.dtype


def _send_next_backward(ctx, grad_link):
    return recv_next(grad_link, ctx.shape, ctx.dtype, ctx.group), None


send_next.register_autograd(_send_next_backward, setup_context=_send_next_setup)


@torch.library.custom_op("flame_cp::recv_prev", mutates_args=())
def recv_prev(anchor: torch.Tensor, after: torch.Tensor, shape: list[int], dtype: torch.dtype,
              group: str) -> torch.Tensor:
    """What the previous rank sends (send_next). anchor: a parameter of the layer; its (zero) gradient is what keeps
    the backward, which sends the received tensor's gradient back, in the graph."""
    return _recv(shape, dtype, after.device, group, -1)


@recv_prev.register_fake
def _(anchor, after, shape, dtype, group):
    return after.new_empty(shape, dtype=dtype)


@torch.library.custom_op("flame_cp::send_prev", mutates_args=())
def send_prev(grad: torch.Tensor, anchor_shape: list[int], anchor_dtype: torch.dtype, group: str) -> torch.Tensor:
    """recv_prev's backward: send the gradient to the previous rank; returns the anchor's (zero) gradient."""
    _send(grad, group, -1)
    return grad.new_zeros(anchor_shape, dtype=anchor_dtype)


@send_prev.register_fake
def _(grad, anchor_shape, anchor_dtype, group):
    return grad.new_empty(anchor_shape, dtype=anchor_dtype)


def _recv_prev_setup(ctx, inputs, output):
    anchor, ctx.group = inputs[0], inputs[4]
    ctx.anchor_shape, ctx.anchor_dtype = list(anchor.shape), anchor.dtype


def _recv_prev_backward(ctx, grad):
    return send_prev(grad, ctx.anchor_shape, ctx.anchor_dtype, ctx.group), None, None, None, None


recv_prev.register_autograd(_recv_prev_backward, setup_context=_recv_prev_setup)


def receive(group: str, rank: int, anchor: torch.Tensor, after: torch.Tensor, shape: list[int],
            dtype: torch.dtype) -> torch.Tensor:
    """The previous rank's tensor of `shape` and `dtype` in the chain of process group `group` (by name; `rank` is
    this rank's place in it): zeros on the first rank. anchor and after: recv_prev's."""
    if rank == 0:
        return after.new_zeros(shape, dtype=dtype)
    return recv_prev(anchor, after, shape, dtype, group)


def send(group: str, rank: int, size: int, x: torch.Tensor) -> torch.Tensor | None:
    """Send x on to the next rank (none on the last rank: None), returning send_next's link."""
    return send_next(x, group) if rank < size - 1 else None
