"""FLA's own models (flash-linear-attention 0.6.0) on CPU tensors, as independent references for flame's models.

FLA has no PyTorch path: its layers call Triton kernels, which run on CPU only under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before Triton is imported when there is no GPU). Two things keep FLA's
kernels from running there as they are, and `fla_interpreter()` changes both, only while it is entered:
  - FLA autotunes most kernels over several configs, and benchmarking them needs a GPU driver: the autotuner keeps
    the first config only (the choice changes block sizes, not the math);
  - the interpreter leaves the loop variable of a plain `for i in range(n)` a Python int, where compiled Triton
    gives an int32 tensor, and some FLA kernels call `i.to(tl.int64)` on it: kernels interpreted here get their
    range loop variables as int32 tensors. They are rewritten into a cache of their own, so kernels rewritten
    outside (flame's) are untouched.

    model = fla_gsa(hidden_size=64, num_hidden_layers=2, num_heads=2, num_slots=8, vocab_size=300)
    logits = model(ids).logits          # every call enters fla_interpreter() by itself

The models are built in fp32 in eval mode, with the FLA options that only choose between a Triton and a PyTorch
implementation of the same math set to PyTorch (FUSED_OFF), unless the caller passes them.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # as tests/conftest.py, for use outside pytest

# Same math either way: True picks a Triton kernel (fused norm + residual, SwiGLU, cross entropy), False PyTorch.
FUSED_OFF = {"fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": False}

_rewritten_here: dict = {}   # FLA kernels as rewritten by _RangeLoopsAsTensors (the interpreter's cache holds flame's)
_depth = 0


def interpreting() -> bool:
    from triton import knobs
    return bool(knobs.runtime.interpret)


def _range_loops_as_tensors(base):
    class RangeLoopsAsTensors(base):
        """`for i in range(...)`: i becomes an int32 tensor as in compiled Triton (`tl.range`, `tl.static_range`
        and other loops are left alone)."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            loop = node.iter
            if (isinstance(node.target, ast.Name) and isinstance(loop, ast.Call)
                    and isinstance(loop.func, ast.Name) and loop.func.id == "range"):
                name = node.target.id
                # `interpreter_semantic` is in every rewritten kernel's globals (the interpreter puts it there)
                as_tensor = ast.parse(f"{name} = interpreter_semantic.to_tensor({name}, False)").body[0]
                node.body.insert(0, ast.copy_location(as_tensor, node))
                ast.fix_missing_locations(node)
            return node

    return RangeLoopsAsTensors()


@contextlib.contextmanager
def fla_interpreter():
    """Lets FLA's Triton kernels run under the interpreter (see the module docstring); re-entrant."""
    global _depth
    if not interpreting():
        pytest.skip("FLA's kernels run on CPU only under Triton's interpreter (TRITON_INTERPRET=1 before import)")
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    saved = (Autotuner.prune_configs, interpreter.FunctionRewriter.ast_transformer,
             interpreter.InterpretedFunction.rewritten_fn)
    prune = saved[0]
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    interpreter.FunctionRewriter.ast_transformer = _range_loops_as_tensors(interpreter.ASTTransformer)
    interpreter.InterpretedFunction.rewritten_fn = _rewritten_here
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        (Autotuner.prune_configs, interpreter.FunctionRewriter.ast_transformer,
         interpreter.InterpretedFunction.rewritten_fn) = saved


def fla_causal_lm(config_cls, model_cls, seed: int | None = 0, **config_kwargs):
    """FLA's `model_cls(config_cls(**config_kwargs))`, fp32, eval, on CPU; FUSED_OFF where the config has the
    option and the caller did not set it; `seed` seeds FLA's own init (None: the global RNG as it is). Every
    forward call runs inside fla_interpreter()."""
    accepted = inspect.signature(config_cls.__init__).parameters
    kwargs = {k: v for k, v in FUSED_OFF.items() if k in accepted}
    kwargs.update(config_kwargs)
    with fla_interpreter():   # skips up front when FLA cannot run here
        if seed is not None:
            torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs)).float().eval()
    forward = model.forward

    @functools.wraps(forward)
    def forward_in_interpreter(*args, **kwargs):
        with fla_interpreter():
            return forward(*args, **kwargs)

    model.forward = forward_in_interpreter
    return model


def fla_gsa(seed: int | None = 0, **config_kwargs):
    """FLA's GSAForCausalLM (fla.models.GSAConfig keyword arguments)."""
    from fla.models import GSAConfig, GSAForCausalLM
    return fla_causal_lm(GSAConfig, GSAForCausalLM, seed, **config_kwargs)


def fla_rwkv6(seed: int | None = 0, **config_kwargs):
    """FLA's RWKV6ForCausalLM (fla.models.RWKV6Config keyword arguments)."""
    from fla.models import RWKV6Config, RWKV6ForCausalLM
    return fla_causal_lm(RWKV6Config, RWKV6ForCausalLM, seed, **config_kwargs)


def fla_rwkv7(seed: int | None = 0, **config_kwargs):
    """FLA's RWKV7ForCausalLM (fla.models.RWKV7Config keyword arguments)."""
    from fla.models import RWKV7Config, RWKV7ForCausalLM
    return fla_causal_lm(RWKV7Config, RWKV7ForCausalLM, seed, **config_kwargs)
