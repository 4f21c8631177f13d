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


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RWKV7Settings().scan_bv = 16
