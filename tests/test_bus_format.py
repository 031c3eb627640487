"""The bus message head is a versioned record (issue 26, docs/formats.md ``bus``): each version
names its types (v1: all that v1 writers sent, ``round`` included; v2 the same, fixed by the
number). A reader takes both, refuses a type the message's version lacks and any version it does
not know."""
import pytest

from pipeline.envelope import pack_record
from pipeline.errors import FormatError
from workers.bus.bus import BUS_KIND, BUS_VERSION, Message, decode_message, encode_message


def test_messages_round_trip_under_the_current_version():
    msg = Message("round", {"fragment": 1, "round": 40, "epoch": 2})
    frames = encode_message(msg)
    assert decode_message(frames, 1 << 20) == msg and BUS_VERSION == 2


def test_a_v1_peer_is_read_and_a_type_its_version_lacks_is_refused(monkeypatch):
    from workers.bus import bus
    assert decode_message([pack_record(BUS_KIND, 1, {"type": "round", "fragment": 0})], 1 << 20) \
        == Message("round", {"fragment": 0})          # what a 6ae44ea syncer announces
    monkeypatch.setitem(bus.TYPES_BY_VERSION, 1, bus.TYPES_BY_VERSION[1][:-1])   # a version without "round"
    with pytest.raises(FormatError, match="unknown type 'round' for bus version 1"):
        decode_message([pack_record(BUS_KIND, 1, {"type": "round", "fragment": 0})], 1 << 20)
    with pytest.raises(FormatError, match=r"bus format version 3 is not supported \(this build reads \[1, 2\]\)"):
        decode_message([pack_record(BUS_KIND, 3, {"type": "heartbeat"})], 1 << 20)
