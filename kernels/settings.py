"""Kernel settings by name, for benchmarks and offline compiles: "op.field=value" against the op's frozen Settings
(kernels/<op>/chunk.py), e.g.

    python benchmarks/bench_kernels.py --set rwkv7.scan_bv=32 --set gsa.scan_warps=8

A custom op (flame::chunk_<op>) takes no dataclass: its Settings travel as text, `to_text(settings)` ("field=value"
of the changed fields, comma-separated; "" for the defaults), and come back as `from_text(op, text)`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools


def parse(items: list[str]) -> dict:
    """{op name: its Settings with the given fields changed} for each op named in items ("op.field=value"; value a
    Python literal, or a bare word taken as a string). An unknown op or field is an error, not a silent no-op."""
    from kernels.ops import OPS

    changes: dict[str, dict] = {}
    for item in items:
        target, sep, text = item.partition("=")
        op, dot, field = target.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"kernel setting {item!r}: expected op.field=value, e.g. rwkv7.scan_bv=32")
        if op not in OPS:
            raise ValueError(f"kernel setting {item!r}: no op {op!r} (ops: {', '.join(OPS)})")
        fields = {f.name for f in dataclasses.fields(OPS[op].settings_type())}
        if field not in fields:
            raise ValueError(f"kernel setting {item!r}: {op} has no setting {field!r} (settings: "
                             f"{', '.join(sorted(fields))})")
        try:
            value = ast.literal_eval(text.strip())      # 8, True, None, 'bf16'
        except (ValueError, SyntaxError):
            value = text.strip()                         # bf16
        if isinstance(getattr(OPS[op].settings_type()(), field), bool):   # a bare word would be a truthy string
            value = {"true": True, "false": False}.get(str(value).lower(), value)
            if not isinstance(value, bool):
                raise ValueError(f"kernel setting {item!r}: {op}.{field} is true or false")
        changes.setdefault(op, {})[field] = value
    return {op: OPS[op].settings_type()(**kw) for op, kw in changes.items()}


def check_choice(settings, field: str, allowed: tuple) -> None:
    """Refuse, with one line (ValueError), a value of a Settings field that the kernels are not built for: a chunk
    size they were never built or tested at fails inside a kernel (spills, shared memory, or a bad build), not here."""
    value = getattr(settings, field)
    if value not in allowed:
        raise ValueError(f"{_op(settings)} Settings.{field} must be {' or '.join(map(repr, allowed))}, got {value!r}")


def check_tiles_and_warps(settings) -> None:
    """What every chunk kernel's Settings shares, refused with one line (ValueError) rather than as a Triton error
    at the first launch: prec "tf32" or "ieee", warps (fields *_warps) a power of two up to 16, tiles (*_bv, *_bd) a
    power of two of at least 16 (a product's least width) or None."""
    check_choice(settings, "prec", ("tf32", "ieee"))
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name.endswith("_warps") and value not in (1, 2, 4, 8, 16):
            raise ValueError(f"{_op(settings)} Settings.{f.name} must be 1, 2, 4, 8 or 16, got {value!r}")
        if f.name.endswith(("_bv", "_bd")) and value is not None and not (
                isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
            raise ValueError(f"{_op(settings)} Settings.{f.name} must be a power of two of at least 16 or None, "
                             f"got {value!r}")


def _op(settings) -> str:
    """The op a Settings belongs to (kernels/<op>/chunk.py)."""
    return type(settings).__module__.split(".")[-2]


def to_text(settings) -> str:
    """The fields of a Settings that differ from its defaults, as "field=value,..." ("" for the defaults)."""
    default = type(settings)()
    return ",".join(f"{f.name}={getattr(settings, f.name)!r}" for f in dataclasses.fields(settings)
                    if getattr(settings, f.name) != getattr(default, f.name))


@functools.lru_cache(maxsize=64)
def from_text(op: str, text: str):
    """op's Settings from to_text's text (None or "": the defaults)."""
    from kernels.ops import OPS

    items = [f"{op}.{item}" for item in (text or "").split(",") if item]
    return parse(items).get(op) or OPS[op].settings_type()()


class TextSettings:
    """Base of a frozen Settings dataclass that travels to its custom op as text (custom ops take no dataclasses):
    encode() gives every field as "field=value,...", decode() reads it back."""

    def encode(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))

    @classmethod
    def decode(cls, text: str):
        """Cached: every call of the op decodes its text again, on the host's critical path (about 20 us
        uncached)."""
        return _decode(cls, text)


@functools.lru_cache(maxsize=256)
def _decode(cls, text: str):
    return cls(**{k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in text.split(",") if item)})
