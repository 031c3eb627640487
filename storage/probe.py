"""Start-up conformance probe: does this store enforce create-if-absent? (SPEC §7)

The commit log's safety (one record per seq, fencing of a stale syncer) rests entirely on the
store refusing a second create of the same key. Some S3 clones accept ``If-None-Match: *`` and
ignore it; a syncer on such a store would silently fork the log. So before a syncer runs it
creates a scratch key, tries to create it again with other bytes, and checks the first bytes
survived. Run by hand: ``python -m storage.probe s3://bucket/prefix``.
"""
from __future__ import annotations

import sys
import uuid

from .errors import AlreadyExists, StoreError
from .layout import probe_key
from .store import ObjectStore, open_store


def probe_conditional_writes(store: ObjectStore) -> None:
    """Raise ``StoreError`` naming the store and what failed unless create-if-absent is enforced.
    Retryable errors (``Unavailable``) pass through unchanged: the store was not judged."""
    key = probe_key(uuid.uuid4().hex)
    first, second = b"ddiloco probe: first", b"ddiloco probe: second"
    advice = ("a syncer cannot run here: use AWS S3, a recent MinIO or SeaweedFS (tested: SeaweedFS 4.48), "
              "or a local directory")
    try:
        try:
            store.put_if_absent(key, first)
        except AlreadyExists:
            raise StoreError(f"create-if-absent refused a fresh key {key}; the store misreports "
                             f"conditional writes; {advice}", uri=store.uri) from None
        except StoreError as exc:
            if exc.retryable:
                raise
            raise StoreError(f"a conditional create failed ({exc.detail}); {advice}", uri=store.uri) from None
        try:
            store.put_if_absent(key, second)
        except AlreadyExists:
            pass  # the expected refusal
        else:
            raise StoreError(f"create-if-absent is NOT enforced: a second conditional create of {key} "
                             f"succeeded; {advice}", uri=store.uri)
        if store.get(key) != first:
            raise StoreError(f"create-if-absent is NOT enforced: {key} was overwritten by a refused "
                             f"create; {advice}", uri=store.uri)
    finally:
        try:
            store.delete(key)
        except StoreError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m storage.probe STORE_URI", file=sys.stderr)
        return 2
    try:
        store = open_store(args[0])
        probe_conditional_writes(store)
    except StoreError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"OK: {store.uri} enforces create-if-absent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
