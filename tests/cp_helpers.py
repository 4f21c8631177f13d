"""Context-parallel model checks on CPU gloo ranks: the cases, the global batches, and the worker each rank runs (one
spawn per cp size runs every case), comparing the cp run against the same model run whole on the same batch."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from flame.context_parallel import ContextParallel, enable, split_batch
from flame.loss import IGNORE_INDEX
from tests.tiny_models import tiny_model, wake_branches

B, T, VOCAB = 2, 32, 64
DOC_STARTS = [[0, 5, 16, 23, 27], [0, 1, 24, 26]]
"""Document starts per row: documents cross the piece boundaries of cp 2 and 4 (8, 16, 24), start exactly on one (16,
24), one starts a token before one (23: the next piece continues it, its convolution must not read 21 and 22), and
row 1's second document spans whole pieces (a transition carried through them)."""

CASES = {
    "rwkv7": dict(name="rwkv7", vocab_size=VOCAB, hidden_size=32, num_layers=2, head_dim=16),
    "rwkv6": dict(name="rwkv6", vocab_size=VOCAB, hidden_size=32, num_layers=2, head_dim=16, mix_low_rank=8,
                  decay_low_rank=8),
    # GSA at a larger init than its 0.02: the slot softmax then depends enough on q and k that their gradients are
    # not all cancellation (at 0.02 they are ~1e-5 and their fp32 rounding is ~1e-5 of that)
    "gsa": dict(name="gsa", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_slots=8,
                initializer_range=0.2),
    "gsa_conv": dict(name="gsa", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_slots=8,
                     initializer_range=0.2, use_short_conv=True, conv_size=4),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (B, T), generator=g)
    labels = torch.randint(VOCAB, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.2] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        starts = [row * T + s for row, row_starts in enumerate(DOC_STARTS) for s in row_starts]
        batch["cu_seqlens"] = torch.tensor(starts + [B * T], dtype=torch.int32)
    return batch


def build(fields: dict):
    model = tiny_model(fields["name"], **{k: v for k, v in fields.items() if k != "name"})
    return wake_branches(model, 0.1) if fields["name"] != "gsa" else model


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def case_names() -> list[str]:
    return [f"{case}{'_packed' if packed else ''}" for case in CASES for packed in (False, True)]


def case_run(name: str, cp: ContextParallel | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward of case `name` on the global batch: whole rows (cp None), or this rank's piece with
    loss and gradients summed over the cp group (what FSDP's gradient reduction over the group adds up)."""
    packed = name.endswith("_packed")
    model, batch = build(CASES[name.removesuffix("_packed")]), global_batch(packed)
    if cp is None:
        return loss_and_grads(model, batch)
    enable(model, cp)
    loss, grads = loss_and_grads(model, split_batch(batch, cp))
    for t in [loss, *grads.values()]:
        dist.all_reduce(t, group=cp.group)
    return loss, grads


WORLD = 4
"""One start of 4 gloo ranks runs cp = 4 over all of them and cp = 2 over the pairs (0, 1) and (2, 3), each pair half
of the cases."""


def worker(rank: int, port: int, out: str) -> None:
    """Every case at cp = 2 and 4; each group's rank 0 saves (loss sum, gradients) to out/{size}_{case}.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for cp, names in ((ContextParallel(pairs[rank // 2], rank % 2, 2), case_names()[rank // 2::2]),
                      (ContextParallel(dist.group.WORLD, rank, WORLD), case_names())):
        for name in names:
            result = case_run(name, cp)
            if cp.rank == 0:
                torch.save(result, os.path.join(out, f"{cp.size}_{name}.pt"))
    dist.barrier()
    dist.destroy_process_group()
