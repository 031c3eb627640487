"""The ZeroMQ fast path and who may speak on it (SPEC §7, docs/protocol.md, docs/security.md): sockets
and messages, key files, signatures. ``from workers.bus import BusConfig`` keeps working."""
from workers.bus.bus import (AnnounceListener, BusConfig, CurveKeys, LearnerLink, Message, SyncerBus,
                             decode_message, drain_wake, encode_message)

__all__ = ["AnnounceListener", "BusConfig", "CurveKeys", "LearnerLink", "Message", "SyncerBus",
           "decode_message", "drain_wake", "encode_message"]
