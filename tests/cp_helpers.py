"""Context-parallel model checks on CPU gloo ranks: the cases, the global batches, and the worker each rank runs (one
spawn per cp size runs every case), comparing the cp run against the same model run whole on the same batch."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import torch
import torch.distributed as dist

from flame.context_parallel import ContextParallel, chain_links, enable, split_batch
from flame.loss import IGNORE_INDEX
from tests.tiny_models import tiny_model, wake_branches

B, T, VOCAB = 2, 32, 64


def doc_starts(T: int) -> list[list[int]]:
    """Document starts per row, in units of T / 32: documents cross the piece boundaries of cp 2 and 4 (8, 16, 24),
    start exactly on one (16, 24), one starts a token before one (24u - 1: the next piece continues it, its convolution
    must not read the tokens before), and row 1's second document spans whole pieces (a transition carried through)."""
    u = T // 32
    return [[0, 5 * u, 16 * u, 24 * u - 1, 27 * u], [0, u, 24 * u, 26 * u]]

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


def global_batch(packed: bool, T: int = T) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (B, T), generator=g)
    labels = torch.randint(VOCAB, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.2] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        starts = [row * T + s for row, row_starts in enumerate(doc_starts(T)) for s in row_starts]
        batch["cu_seqlens"] = torch.tensor(starts + [B * T], dtype=torch.int32)
    return batch


def build(fields: dict):
    model = tiny_model(fields["name"], **{k: v for k, v in fields.items() if k != "name"})
    return wake_branches(model, 0.1) if fields["name"] != "gsa" else model


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch)
    loss.backward()
    plain = lambda n: n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731 (wrappers)
    return loss.detach(), {plain(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def case_names() -> list[str]:
    return [f"{case}{'_packed' if packed else ''}" for case in CASES for packed in (False, True)]


COMPILED = ("rwkv7", "gsa_conv")
"""Cases also run at cp = 2 with training's selective checkpointing and each block compiled whole (fullgraph: the
exchanges inside a checkpointed block must not break its graph, which would run the block eagerly). Rows, not packed:
the CPU reference path of packed documents loops over their data-dependent lengths (a graph break of its own)."""
CHAIN = ("rwkv7", "rwkv7_packed", "rwkv6_packed", "gsa_packed", "gsa_conv_packed")
"""Cases also run with the send/recv chain (ContextParallel.links) at cp = 2 and 4."""
VARIANTS = {
    "compiled": ("gather", "selective"),
    "full_compiled": ("gather", "full"),
    "chain_compiled": ("chain", "selective"),
    "chain_full_compiled": ("chain", "full"),
}
"""Runs of case rwkv7 at cp = 2 (and of COMPILED's other cases: "compiled"), blocks compiled whole: the file
suffix -> (exchange, activation checkpointing). Full checkpointing of a cp model keeps only the exchanges' outputs:
run again in backward, a receive of the chain would wait for a send that never comes."""


def compile_whole_blocks(model, checkpoint: str) -> None:
    """Training's checkpoint wrapper ("selective" or "full") around each block, then torch.compile of it with
    fullgraph=True (aot_eager: AOTAutograd and the checkpoint policy as training's Inductor sees them, without code
    generation)."""
    from flame.activation_checkpoint import wrap_blocks

    wrap_blocks(model, checkpoint)
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)


def case_run(name: str, cp: ContextParallel | None, T: int = T, device: str = "cpu",
             checkpoint: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward of case `name` on the global batch of rows of T tokens: whole rows (cp None), or this
    rank's piece with loss and gradients summed over the cp group (what FSDP's gradient reduction over the group adds
    up). On a CUDA device the models run the Triton kernels. checkpoint: compile_whole_blocks first with it."""
    packed = name.endswith("_packed")
    model = build(CASES[name.removesuffix("_packed")]).to(device)
    if cp is not None:
        enable(model, cp)
    if checkpoint:
        compile_whole_blocks(model, checkpoint)
    batch = {k: v.to(device) for k, v in global_batch(packed, T).items()}
    if cp is None:
        return loss_and_grads(model, batch)
    loss, grads = loss_and_grads(model, split_batch(batch, cp))
    for t in [loss, *grads.values()]:
        dist.all_reduce(t, group=cp.group)
    return loss, grads


def case_of(result: str) -> str:
    """The case a result name runs: "rwkv7_packed_chain" -> "rwkv7_packed", "rwkv7_chain_compiled" -> "rwkv7"."""
    for suffix in sorted(VARIANTS, key=len, reverse=True):   # "full_compiled" before "compiled"
        if result.endswith("_" + suffix):
            return result.removesuffix("_" + suffix)
    return result.removesuffix("_chain")


def compiled_runs() -> list[tuple[str, str]]:
    """(case, file suffix) of the compiled runs at cp = 2."""
    return [(c, "compiled") for c in COMPILED] + [("rwkv7", v) for v in VARIANTS if v != "compiled"]


WORLD = 4
"""One start of 4 ranks runs cp = 4 over all of them and cp = 2 over the pairs (0, 1) and (2, 3), each pair half of
the cases; one start of 2 ranks (2 GPUs) runs every case at cp = 2."""


def worker(rank: int, port: int, out: str, world: int = WORLD, T: int = T, cuda: bool = False) -> None:
    """Every case at cp = 2 (and 4 on 4 ranks), CHAIN's with the chain too, then compiled_runs(); each group's rank 0
    saves (loss sum, gradients) to out/{size}_{case}[_suffix].pt. CPU: gloo ranks; cuda: NCCL, rank r on GPU r."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if world == 2:
        pair = ContextParallel(dist.group.WORLD, rank, 2)
        runs = [(pair, case_names())]
        share = slice(None)
    else:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = ContextParallel(groups[rank // 2], rank % 2, 2)
        runs = [(pair, case_names()[rank // 2::2]), (ContextParallel(dist.group.WORLD, rank, world), case_names())]
        share = slice(rank // 2, None, 2)
    chained = {cp.size: replace(cp, links=chain_links([list(range(world))] if cp.size == world else
                                                      [[0, 1], [2, 3]][:world // 2]))
               for cp, _ in runs}
    runs += [(chained[cp.size], [f"{c}_chain" for c in CHAIN if c in names]) for cp, names in list(runs)]
    for cp, names in runs:
        for name in names:
            result = case_run(case_of(name), cp, T, device)
            if cp.rank == 0:
                torch.save(result, os.path.join(out, f"{cp.size}_{name}.pt"))
    for case, suffix in compiled_runs()[share]:
        exchange, checkpoint = VARIANTS[suffix]
        cp = chained[2] if exchange == "chain" else pair
        result = case_run(case, cp, T, device, checkpoint)
        if cp.rank == 0:
            torch.save(result, os.path.join(out, f"2_{case}_{suffix}.pt"))
    dist.barrier()
    dist.destroy_process_group()
