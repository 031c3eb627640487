"""DeltaHeader.to_dict is written field by field (a learner's answer step calls it cold; asdict's
deep copy cost tens of microseconds there): it must stay the dataclass's own dict, every field,
in order, so the bytes on the wire and in storage do not change."""
import dataclasses

import msgpack

from pipeline.types import DeltaHeader


def test_to_dict_is_asdict_field_for_field_and_in_order():
    h = DeltaHeader("l0", 3, 17, 2, 41, 12, 6144, 99, round=58)
    assert h.to_dict() == dataclasses.asdict(h)
    assert list(h.to_dict()) == [f.name for f in dataclasses.fields(DeltaHeader)]
    assert msgpack.packb(h.to_dict()) == msgpack.packb(dataclasses.asdict(h))
    assert DeltaHeader.from_dict(h.to_dict()) == h


def test_to_dict_keeps_the_default_round():
    h = DeltaHeader("l1", 0, 0, 0, 0, 1, 1, 0)
    assert h.to_dict()["round"] == -1 and DeltaHeader.from_dict(h.to_dict()) == h
