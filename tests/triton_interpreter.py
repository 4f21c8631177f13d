"""Triton's interpreter (TRITON_INTERPRET=1, the CPU kernel tests) with its language patching made cheap.

Before every kernel launch and again at every call of a @triton.jit helper inside a kernel, the interpreter replaces
each Triton builtin of triton.language (and of its tensor class, its math module, ...) by an interpreted version,
finding them with inspect.getmembers over the whole package: a third of the interpreter's CPU time in the kernel
tests, which call small helpers thousands of times. The builtins of a package are fixed once Triton is imported, so
install() lists them once and the interpreter then checks just those names, as it would have found them: the same
members replaced, the same results. Where Triton's interpreter has other internals than the ones this expects, it
leaves the interpreter as it is.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Make this process's Triton interpreter look its builtins up from a list; False where it cannot (other
    internals)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_builtin, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if (patch_builtin is None or patch_attr is None or is_builtin is None
            or list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]
            or list(inspect.signature(patch_attr).parameters) != ["obj", "name", "member", "builder", "scope"]):
        return False
    # listed now, before any launch has replaced them (a launch puts every one back when it ends)
    packages = [tl, tl.core, tl.core.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    builtins = {pkg: [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
                for pkg in packages if pkg is not None}

    def listed_patch_builtin(pkg, builder, scope):
        names = builtins.get(pkg)
        if names is None:  # a package this did not list: the interpreter's own search
            return patch_builtin(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):  # not replaced already (a helper called inside a kernel)
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = listed_patch_builtin
    return True
