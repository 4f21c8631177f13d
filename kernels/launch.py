"""The one way our ops launch a Triton kernel, so that what a launch compiles is described once, by the launch code.

    launch(kernel, grid, *args, num_warps=4, maxnreg=None, **kwargs)

Under `record()` a launch is not run but described (`Launch`: the kernel, each runtime argument's type, the
compile-time values, warps and register cap). An op's forward and backward run on meta tensors under `record()`
then list exactly the kernels a GPU would compile for those shapes and settings, without a GPU: `kernels.sm90`
compiles them offline for an H100 (the compile test, benchmarks/kernel_resources.py).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64"}
_recorded: list | None = None


@dataclass(frozen=True)
class Launch:
    """One kernel build: what Triton specializes a launch on."""
    kernel: object                  # the @triton.jit function
    types: tuple                    # (name, "*bf16" | "*fp32" | "i32" | "fp32" | ...) of each runtime argument
    constexprs: tuple               # (name, value), None arguments included (Triton takes those as constants)
    num_warps: int
    maxnreg: int | None

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def launch(kernel, grid, *args, num_warps: int = 4, maxnreg: int | None = None, **kwargs):
    if _recorded is not None:
        _recorded.append(describe(kernel, args, kwargs, num_warps, maxnreg))
        return
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    kernel[grid](*args, num_warps=num_warps, **options, **kwargs)


def register_fake(op, fake, real) -> None:
    """Give a custom op its fake (shapes only, for tracing); under record() the meta call runs `real`, the launch
    code, instead, so that its launches are recorded (torch allows one meta implementation per op: the fake)."""
    op.register_fake(lambda *args, **kwargs: (real if _recorded is not None else fake)(*args, **kwargs))


@contextlib.contextmanager
def record():
    """Collect the launches made inside (a list of Launch, duplicates kept in launch order) instead of running."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def describe(kernel, args, kwargs, num_warps, maxnreg) -> Launch:
    values = dict(zip(kernel.arg_names, args)) | kwargs
    missing = [p.name for p in kernel.params if p.name not in values and p.default is inspect.Parameter.empty]
    assert not missing, f"{kernel.fn.__name__}: no value for {missing}"
    types, consts = [], []
    for p in kernel.params:
        v = values.get(p.name, p.default)
        if p.is_constexpr or v is None:
            consts.append((p.name, v))
        elif isinstance(v, torch.Tensor):
            types.append((p.name, "*" + _DTYPES[v.dtype]))
        elif isinstance(v, bool):
            types.append((p.name, "i1"))
        elif isinstance(v, int):
            types.append((p.name, "i32"))
        elif isinstance(v, float):
            types.append((p.name, "fp32"))
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {p.name} of type {type(v).__name__}")
    return Launch(kernel, tuple(types), tuple(consts), num_warps, maxnreg)


def distinct(launches: list[Launch]) -> dict[str, Launch]:
    """The different builds among `launches` in first-launch order, named by kernel; a kernel built more than once
    is told apart by the compile-time values and argument types that differ between its builds."""
    builds = list(dict.fromkeys(launches))
    named = {}
    for b in builds:
        twins = [o for o in builds if o.kernel is b.kernel]
        parts = []
        if len(twins) > 1:
            sig = lambda x: dict(x.constexprs) | {n: ":" + t for n, t in x.types}  # noqa: E731
            mine = sig(b)
            parts = [f"{n}={v}" for n, v in mine.items() if any(sig(o).get(n, mine[n]) != v or n not in sig(o)
                                                              for o in twins)]
            if any(o.num_warps != b.num_warps for o in twins):
                parts.append(f"warps={b.num_warps}")
        named[b.name + (f" ({', '.join(parts)})" if parts else "")] = b
    return named
