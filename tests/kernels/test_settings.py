"""kernels.settings: "op.field=value" against each op's frozen Settings (benchmarks, offline compiles)."""

import dataclasses

import pytest

from kernels.gsa.chunk import Settings as GSASettings
from kernels.rwkv7.chunk import Settings as RWKV7Settings
from kernels.settings import parse


def test_parse_gives_typed_settings_per_op():
    made = parse(["rwkv7.prep_maxnreg=128", "rwkv7.scan_bv=None", "rwkv7.prec=ieee", "gsa.scan_warps=8"])
    assert made == {"rwkv7": dataclasses.replace(RWKV7Settings(), prep_maxnreg=128, scan_bv=None, prec="ieee"),
                    "gsa": dataclasses.replace(GSASettings(), scan_warps=8)}


def test_parse_reads_true_and_false_for_switches():
    # a bare word is otherwise taken as a string, and "false" would be a truthy one
    for text, value in (("false", False), ("False", False), ("true", True), ("True", True)):
        assert parse([f"gsa.fp16_states={text}"])["gsa"].fp16_states is value


@pytest.mark.parametrize("item", ["rwkv7.no_such=1", "rwkv7.chunk_rwkv7=1", "nofamily.x=1", "rwkv7.prep_maxnreg",
                                  "scan_bv=16", "gsa.fp16_states=no", "gsa.fp16_states=1"])
def test_parse_rejects_unknown_settings(item):
    with pytest.raises(ValueError, match="kernel setting"):
        parse([item])


@pytest.mark.parametrize("item, line", [
    ("rwkv7.chunk=32", "rwkv7 Settings.chunk must be 16, got 32"),
    ("gsa.chunk=64", "gsa Settings.chunk must be None or 16 or 32, got 64"),
    ("rwkv6.wide_k_chunk=8", "rwkv6 Settings.wide_k_chunk must be 16 or 32, got 8"),
    ("rwkv7.prec=fp16", "rwkv7 Settings.prec must be 'tf32' or 'ieee', got 'fp16'"),
    ("gsa.scan_warps=3", "gsa Settings.scan_warps must be 1, 2, 4, 8 or 16, got 3"),
    ("rwkv6.scan_bv=48", "rwkv6 Settings.scan_bv must be a power of two of at least 16 or None, got 48"),
    ("rwkv7.chunk_bv=8", "rwkv7 Settings.chunk_bv must be a power of two of at least 16 or None, got 8"),
    ("gsa.key_scan_bd=0", "gsa Settings.key_scan_bd must be a power of two of at least 16 or None, got 0")])
def test_parse_refuses_settings_the_kernels_are_not_built_for(item, line):
    # refused before any kernel is built (RWKV-7's backward at chunks of 32 read an illegal address on an H200;
    # a tile that is no power of two fails in Triton's tl.arange)
    with pytest.raises(ValueError) as refused:
        parse([item])
    assert str(refused.value) == line


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RWKV7Settings().scan_bv = 16
