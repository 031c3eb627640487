"""The syncer role (SPEC §4, §7): ingest, the round book, commits, restart recovery, replication to
other regions and retention. ``from workers.syncer import Syncer, SyncerConfig`` keeps working."""
from workers.syncer.syncer import Syncer, SyncerConfig, SyncerStats

__all__ = ["Syncer", "SyncerConfig", "SyncerStats"]
