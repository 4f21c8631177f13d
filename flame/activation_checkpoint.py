"""Activation checkpointing of each block of `model.layers` (training.activation_checkpoint).

full: a block keeps only its inputs; backward runs its whole forward again.
selective: a block keeps the outputs of the ops that are expensive to run again (matmuls, attention, our chunk kernels,
RWKV-7's output epilogue) and recomputes the rest (elementwise work, norms, activations, token shifts) from them in
backward, so backward never repeats a matmul or a kernel. It costs more memory than full and less than none.
training.recompute adds parts to what selective recomputes, trading some of its speed back for memory: "mlp_hidden"
(the MLP's input matmuls run again) and "chunk_tensors" (RWKV-7's chunk op keeps its chunk states alone).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing, FullAC

from flame.errors import ConfigError

SAVED_ATEN_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear"})
"""aten ops whose outputs selective checkpointing keeps (by name, every overload)."""
SAVED_ATEN_PREFIXES = ("_scaled_dot_product_", "_flash_attention_", "_efficient_attention_", "_cudnn_attention_")
"""Attention: every SDPA backend (flash, efficient, cuDNN, math, the CPU flash path)."""
CHUNK_KERNEL_PREFIX = "chunk_"
"""Our kernels' custom ops are flame::chunk_<model> (kernels/); their outputs are kept too."""
EXCHANGE_NAMESPACES = ("_c10d_functional", "flame_cp")
"""Context parallelism's exchanges (functional collectives, flame/cp_chain.py's transfers): never run again in
backward, under either checkpointing."""
SAVED_GLUE_OPS = frozenset({"rwkv7_out"})
"""Fused glue ops whose outputs are kept: RWKV-7's output epilogue gives one [T, C] tensor, the output projection's
input (its weight's gradient reads it), where recomputing it costs the epilogue's whole forward again (about 1 % of
the 0.6B step for 2 GiB at 8 x 4096 tokens on one GPU)."""


MLP_INPUTS = "mlp_input_projections"
"""An MLP module's class attribute: the names of its nn.Linear inputs (whose outputs "mlp_hidden" recomputes)."""
KEEP_CHUNK_TENSORS = "keep_chunk_tensors"
"""A time-mixing module's attribute: False makes its chunk kernel keep the chunk states alone ("chunk_tensors")."""


def saves_output(func) -> bool:
    """Whether selective checkpointing keeps the output of `func` (an op overload seen by the dispatcher)."""
    namespace, name = getattr(func, "namespace", None), getattr(func, "_opname", "")
    if namespace == "aten":
        return name in SAVED_ATEN_OPS or name.startswith(SAVED_ATEN_PREFIXES)
    if namespace in EXCHANGE_NAMESPACES:
        return True
    if namespace == "flame":
        return (name.startswith(CHUNK_KERNEL_PREFIX) and not name.endswith("_bwd")) or name in SAVED_GLUE_OPS
    return False


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if saves_output(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _matmul_width(func, args) -> int | None:
    """The output width of a 2-D matmul (mm, addmm, linear), else None."""
    if getattr(func, "namespace", None) != "aten":
        return None
    name = func._opname
    if name == "mm":
        return args[1].shape[-1]
    if name == "addmm":
        return args[2].shape[-1]
    if name == "linear":
        return args[1].shape[0]
    return None


def _recomputing_widths(widths: frozenset[int]):
    """Selective's policy, except that matmuls whose output is one of `widths` wide are recomputed. The policy sees
    ops, not modules (under torch.compile it runs on the traced graph), so the MLP's matmuls are known by width:
    mlp_hidden_widths makes sure no other matmul of a block has it."""
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if _matmul_width(func, args) in widths:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return _policy(ctx, func, *args, **kwargs)
    return policy


def mlp_hidden_widths(model: nn.Module) -> frozenset[int]:
    """The output widths of the blocks' MLP input projections, checked to be no other 2-D parameter's dimension in
    the blocks (a projection of that width elsewhere would be recomputed too)."""
    widths, mlp_params = set(), set()
    for block in model.layers:
        for module in block.modules():
            for name in getattr(module, MLP_INPUTS, ()):
                widths.add(getattr(module, name).out_features)
            if hasattr(module, MLP_INPUTS):
                mlp_params.update(id(p) for p in module.parameters())
    if not widths:
        raise ConfigError("training.recompute", f"no 'mlp_hidden' for {type(model).__name__}, whose blocks have no MLP")
    for name, p in model.layers.named_parameters():
        clash = widths.intersection(p.shape) if p.dim() == 2 and id(p) not in mlp_params else set()
        if clash:
            raise ConfigError("training.recompute", f"no 'mlp_hidden' while the MLP's width {min(clash)} is also a "
                              f"dimension of {name} (its matmul would be recomputed too)")
    return frozenset(widths)


def _exchanges_only_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    exchange = getattr(func, "namespace", None) in EXCHANGE_NAMESPACES
    return CheckpointPolicy.MUST_SAVE if exchange else CheckpointPolicy.MUST_RECOMPUTE


class PolicyAC(ActivationCheckpointing):
    """torchtitan's per-block wrapping with a policy of ours. (torchtitan's SelectiveAC also recomputes every
    second matmul, which is the cost our selective policy exists to avoid.)"""

    def __init__(self, policy) -> None:
        super().__init__(ActivationCheckpointing.Config())
        self.policy = policy

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        c, policy = self.config, self.policy
        return checkpoint_wrapper(module, context_fn=lambda: create_selective_checkpoint_contexts(policy),
                                  preserve_rng_state=c.preserve_rng_state, determinism_check=c.determinism_check,
                                  early_stop=False, debug=c.debug)


def wrap_blocks(model: nn.Module, mode: str, recompute: tuple[str, ...] | list[str] = ()) -> None:
    """Replace each block of `model.layers` by its checkpoint wrapper ("full" or "selective"; "none" does nothing);
    with "selective", `recompute` names the parts it recomputes too (training.recompute).
    The wrapper holds the block as `_checkpoint_wrapped_module`, which FSDP and the state dict see through.
    A context-parallel model's full checkpointing keeps its exchanges' outputs and recomputes everything else: run
    again, the chain's receive would wait for a send that never comes (and the gather would gather again)."""
    if mode == "full" and getattr(model, "context_parallel", None) is not None:
        PolicyAC(_exchanges_only_policy).apply(model)
    elif mode == "full":
        FullAC(FullAC.Config()).apply(model)
    elif mode == "selective":
        widths = mlp_hidden_widths(model) if "mlp_hidden" in recompute else frozenset()
        if "chunk_tensors" in recompute:
            kernels = [m for m in model.layers.modules() if hasattr(m, KEEP_CHUNK_TENSORS)]
            if not kernels:
                raise ConfigError("training.recompute", f"no 'chunk_tensors' for {type(model).__name__}, whose chunk "
                                  "kernel keeps what it keeps")
            for m in kernels:
                setattr(m, KEEP_CHUNK_TENSORS, False)
        PolicyAC(_recomputing_widths(widths) if widths else _policy).apply(model)
