"""Process group, device mesh, and how a model is wrapped: activation checkpointing, compile, FSDP2 / HSDP."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from flame.config import ParallelismConfig, resolve_dp_degrees
from flame.errors import RunError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    """(dp_replicate, dp_shard_cp): FSDP's mesh. dp_shard_cp is dp_shard x cp, cp innermost (torchtitan's layout): the
    ranks of a cp group hold the same parameters and shard them like data-parallel ranks."""
    cp_mesh: DeviceMesh | None = None
    """(dp, cp) when context_parallel_degree > 1: "cp" groups the ranks that share each sequence (consecutive ranks,
    in sequence order), "dp" is the data-parallel coordinate; None when cp = 1."""

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """2-D mesh -> HSDP (replicate x shard); 1-D -> plain FSDP."""
        return self.mesh if self.mesh.size(0) > 1 else self.mesh["dp_shard_cp"]

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_mesh is None else self.cp_mesh["cp"].size()

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: distinct streams of rows (the ranks of one cp group read the same rows)."""
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate, its reader index in the data loader."""
        return self.rank if self.cp_mesh is None else self.cp_mesh["dp"].get_local_rank()

    def context_parallel(self, exchange: str):
        """This rank's flame.context_parallel.ContextParallel, or None when cp = 1; exchange: "gather" or "chain"
        (every rank calls this: the chain's process groups are created here)."""
        if self.cp_mesh is None:
            return None
        from flame.context_parallel import ContextParallel, chain_links

        cp = self.cp_mesh["cp"]
        links = chain_links(self.cp_mesh.mesh.tolist()) if exchange == "chain" else None
        return ContextParallel(group=cp.get_group(), rank=cp.get_local_rank(), size=cp.size(), links=links)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """After torchrun restarted the ranks (--max-restarts), the store of torchrun's agent still holds the failed
    attempt's keys, the addresses of ranks now dead among them: the new ranks would connect to those and fail. Each
    attempt gets keys of its own; None (the usual env:// set-up) for a first attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"flame/attempt_{attempt}", client)


def rank_and_world(store: dist.Store | None, world_size: int) -> dict:
    return {} if store is None else {"rank": int(os.environ["RANK"]), "world_size": world_size}


def init_distributed(cfg: ParallelismConfig) -> Dist:
    """Join the torchrun job (or become a job of one when started without torchrun)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    replicate, shard, cp = resolve_dp_degrees(cfg, world_size)
    timeout = timedelta(seconds=cfg.collective_timeout_sec)  # a lost or hung rank fails the job after this
    store = attempt_store(world_size, timeout)
    if torch.cuda.is_available():
        local_rank, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))   # (torchrun's): every rank says the same
        if per_node > gpus:
            raise RunError(f"{per_node} processes a node but {gpus} GPU(s) on this one: start one process a GPU "
                           f"(NGPU or NPROC for scripts/launch.sh, --nproc-per-node for torchrun)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout, store=store,
                                **rank_and_world(store, world_size))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout, store=store, **rank_and_world(store, world_size))
    mesh = init_device_mesh(device.type, (replicate, shard * cp), mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    cp_mesh = None if cp == 1 else init_device_mesh(device.type, (replicate * shard, cp), mesh_dim_names=("dp", "cp"))
    return Dist(rank=dist.get_rank(), world_size=world_size, device=device, mesh=mesh, cp_mesh=cp_mesh)


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block of `model.layers` (in place), as training.compile does.

    AOTAutograd's on-disk cache is turned off first: once warm it replays the metadata of outputs that alias a
    graph's intermediates (a linear's 3-D output beside a view of it, live across a graph break) with
    garbage sizes, and the second run of a config failed ("shape '[94745291249156, 6174690382483291083, 128]' is
    invalid") or segfaulted, on torch 2.11 (H100) and 2.13 (CPU). PyTorch's fix (pytorch#185861, the _unsafe_view
    ViewMeta serialization) is not in them. Inductor's own FX graph cache stays on, keyed by our kernels' sources too
    (flame.compile_cache).
    """
    import torch._functorch.config  # not imported by `import torch`

    from flame.compile_cache import key_inductor_cache_by_kernels

    torch._functorch.config.enable_autograd_cache = False
    key_inductor_cache_by_kernels()
    for block in model.layers:
        block.compile()


def prepare_blocks(model: nn.Module, activation_checkpoint: str, compile: bool, recompute: list[str] = ()) -> None:
    """Checkpoint and compile each block of `model.layers` (in place), as training does.

    Each block is wrapped first and the wrapper compiled (torchtitan's order): Dynamo traces the checkpoint with its
    policy and Inductor's partitioner keeps what the policy saves (selective) or nothing (full). This needs blocks
    without a graph break, which they are (our kernels are custom ops, flame::chunk_*): a break would run the whole
    wrapped block eager.
    """
    from flame.activation_checkpoint import wrap_blocks  # (torchtitan's module: imported only when wrapping)

    wrap_blocks(model, activation_checkpoint, recompute)
    if compile:
        compile_blocks(model)


def parallelize(model: nn.Module, d: Dist, *, param_dtype: str, reduce_dtype: str, activation_checkpoint: str,
                compile: bool, fsdp_wrap: str = "blocks", recompute: list[str] = ()) -> nn.Module:
    """Checkpoint and compile (prepare_blocks), then shard each block of `model.layers` (fsdp_wrap "blocks"; "model":
    the root alone, parallelism.fsdp_wrap), then the root.

    Gradients are reduced as a SUM: the loss is already divided by the global token count, so FSDP's own
    averaging over ranks would divide a second time.
    """
    prepare_blocks(model, activation_checkpoint, compile, recompute)
    if d.on_gpu:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    else:  # CPU: fp32 throughout (bf16 matmuls on CPU are slow and not what tests compare against)
        mp = MixedPrecisionPolicy()
    n = len(model.layers)
    # Over one shard (one GPU, or replicas only) a block's gathered parameters are its bf16 copies, 2 bytes per
    # parameter: keeping them spares the backward a second cast and copy of every parameter (thousands of small
    # kernels a step at 0.6B), and keep_gathered_parameters keeps them from step to step too. Over several shards,
    # resharding is what saves the memory.
    reshard = d.mesh["dp_shard_cp"].size() > 1
    for i, block in enumerate(model.layers if fsdp_wrap == "blocks" else []):
        # the last block's parameters are needed again right away by backward: keep them gathered
        fully_shard(block, mesh=d.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard and i < n - 1)
    fully_shard(model, mesh=d.fsdp_mesh, mp_policy=mp)
    # Over one rank there is nothing to reduce and FSDP divides by nothing unless told a factor: even a factor of 1.0
    # costs a pass over every gradient there (FSDP's single-rank path divides, then copies).
    if d.fsdp_mesh.size() > 1:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM, NCCL's is zero-copy
    return model


def keep_gathered_parameters(model: nn.Module, d: Dist, optimizer: torch.optim.Optimizer) -> bool:
    """Over one shard (one GPU, or replicas only), keep each block's gathered parameters from step to step and bring
    them up to date after every optimizer step in one foreach copy (a cast to the compute dtype) from the updated
    shards. FSDP's one-shard path instead frees them after the backward and, in every pre-forward, casts and copies
    each parameter on its own: two kernels a parameter and step (RWKV-7 0.6B: 1,350 a step, in the forward, where the
    host has least time to spare). The same weights reach every forward (tests/test_parallel_kept.py, bit for bit).
    Between steps the modules then hold the gathered copies: the shards, with their gradients, are the optimizer's
    parameters and the state dict's (which reshards). False, and FSDP's default, over several shards or where FSDP's
    parameter records are not as this expects."""
    if d.mesh["dp_shard_cp"].size() > 1:
        return False
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
        params = [p for g in groups if g is not None for p in g.fsdp_params]
        if not params or not all(isinstance(p.sharded_param, DTensor) for p in params):
            return False
    except (ImportError, AttributeError):
        return False

    @torch.no_grad()
    def refresh(*_):
        kept = [p for p in params if p.sharded_state == ShardedState.UNSHARDED]
        if kept:
            torch._foreach_copy_([p.unsharded_param for p in kept], [local_tensor(p.sharded_param) for p in kept])

    model.set_reshard_after_backward(False)
    optimizer.register_step_post_hook(refresh)
    return True


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, else the tensor (the attribute: to_local() is an autograd call, about 8 us a tensor
    on the CPU machine against 0.04)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank of the job (data-parallel ranks and the pieces of each cp group)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
