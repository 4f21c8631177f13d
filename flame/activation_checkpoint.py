"""Activation checkpointing of each block of `model.layers` (training.activation_checkpoint).

full: a block keeps only its inputs; backward runs its whole forward again.
selective: a block keeps the outputs of the ops that are expensive to run again (matmuls, attention, our chunk kernels,
RWKV-7's output epilogue) and recomputes the rest (elementwise work, norms, activations, token shifts) from them in
backward, so backward never repeats a matmul or a kernel. It costs more memory than full and less than none.
training.recompute adds parts to what selective recomputes, trading some of its speed back for memory: "mlp_hidden"
(the MLP's input matmuls run again), "low_rank" (the low-rank projections' wide up matmuls run again) and
"chunk_tensors" (RWKV-7's chunk op keeps its chunk states alone).
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


RECOMPUTED_MATMULS = {"mlp_hidden": "mlp_input_projections", "low_rank": "low_rank_up_projections"}
"""training.recompute's matmul parts, each with the module attribute that names the weights (nn.Linear or raw, used
as x @ w) whose matmul outputs the part recomputes instead of keeping."""
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


def _matmul_shape(func, args) -> tuple[int, int] | None:
    """(contraction, output width) of a matmul (mm, addmm, bmm, linear), else None."""
    if getattr(func, "namespace", None) != "aten":
        return None
    name = func._opname
    if name in ("mm", "bmm"):
        return args[0].shape[-1], args[1].shape[-1]
    if name == "addmm":
        return args[1].shape[-1], args[2].shape[-1]
    if name == "linear":
        return args[1].shape[1], args[1].shape[0]
    return None


def _recomputing(shapes: frozenset[tuple[int, int]]):
    """Selective's policy, except that matmuls of these (contraction, output width) are recomputed. The policy sees
    ops, not modules (under torch.compile it runs on the traced graph), so it knows the parts' matmuls by their
    shapes: recomputed_matmuls makes sure no other parameter of a block multiplies with one of them."""
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if _matmul_shape(func, args) in shapes:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return _policy(ctx, func, *args, **kwargs)
    return policy


def _weight_shape(p: nn.Parameter, linear_shapes: dict) -> tuple[int, int]:
    """(contraction, output width) of the matmul a weight enters: an nn.Linear's (in, out), else x @ p's."""
    return linear_shapes.get(id(p), tuple(p.shape[-2:]))


def recomputed_matmuls(model: nn.Module, parts) -> frozenset[tuple[int, int]]:
    """The (contraction, output width) of the matmuls that training.recompute's `parts` name (RECOMPUTED_MATMULS),
    checked to be no other block parameter's."""
    linear_shapes = {id(m.weight): (m.in_features, m.out_features) for m in model.layers.modules()
                     if isinstance(m, nn.Linear)}
    shapes, named = {}, set()
    for part in parts:
        attribute = RECOMPUTED_MATMULS[part]
        weights = [getattr(m, name) for m in model.layers.modules() for name in getattr(m, attribute, ())
                   if getattr(m, name, None) is not None]   # (RWKV-7's first layer has no value-residual LoRA)
        if not weights:
            raise ConfigError("training.recompute", f"no {part!r} for {type(model).__name__}, whose blocks have none")
        for w in weights:
            w = w.weight if isinstance(w, nn.Linear) else w
            shapes[_weight_shape(w, linear_shapes)] = part
            named.add(id(w))
    for name, p in model.layers.named_parameters():
        shape = _weight_shape(p, linear_shapes) if p.dim() >= 2 and id(p) not in named else None
        if shape in shapes:
            raise ConfigError("training.recompute", f"no {shapes[shape]!r} while {name} multiplies {shape[0]} -> "
                              f"{shape[1]} as well (its matmul would be recomputed too)")
    return frozenset(shapes)


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
        shapes = recomputed_matmuls(model, [p for p in recompute if p in RECOMPUTED_MATMULS])
        if "chunk_tensors" in recompute:
            kernels = [m for m in model.layers.modules() if hasattr(m, KEEP_CHUNK_TENSORS)]
            if not kernels:
                raise ConfigError("training.recompute", f"no 'chunk_tensors' for {type(model).__name__}, whose chunk "
                                  "kernel keeps what it keeps")
            for m in kernels:
                setattr(m, KEEP_CHUNK_TENSORS, False)
        PolicyAC(_recomputing(shapes) if shapes else _policy).apply(model)
