"""Where a run is: open a run by what a user types - a directory, ``file://``, ``s3://``, a local
mirror of an S3 run, or a ``ddiloco run`` output directory (the run its summary names; issue 26).

Shared by the roles (the syncer's ``gc``) and the tools (replay, log, export), so that every command
reads a run location the same way and none creates a mistyped local directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.descriptor import RunDescriptor
from storage.errors import NotFound
from storage.layout import DESCRIPTOR_KEY, read_descriptor
from storage.store import ObjectStore, open_store


def _local_path(uri: str) -> str | None:
    """The directory a local run location names (a path or ``file://``), None for a remote one."""
    return uri[len("file://"):] if uri.startswith("file://") else None if "://" in uri else uri


def run_output(uri: str) -> dict | None:
    """The summary of a ``ddiloco run`` output directory ``uri`` (``OUT/summary.json``, when ``uri``
    is a local directory that holds no run itself), else None."""
    local = _local_path(uri)
    if local is None:
        return None
    out = Path(os.path.expanduser(local))
    if (out / DESCRIPTOR_KEY).exists() or not (out / "summary.json").is_file():
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def open_run(uri: str, *, s3_endpoint: str | None = None) -> tuple[ObjectStore, RunDescriptor]:
    """The store and descriptor of the run at ``uri`` (a directory, a local mirror of an S3 run,
    ``file://`` or ``s3://``, or a ``ddiloco run`` output directory: the run its summary names,
    ``replay_uri`` - a ``--wan`` run's copy of its home store - or ``run_uri``; issue 26);
    ``NotFound`` says when there is no run there."""
    summary = run_output(uri)
    if summary is not None and isinstance(summary.get("replay_uri") or summary.get("run_uri"), str):
        uri = summary.get("replay_uri") or summary["run_uri"]
    local = _local_path(uri)
    if local is not None and not os.path.isdir(os.path.expanduser(local)):
        # Opening a local store creates its directory: a mistyped path must not become an empty run.
        raise NotFound(f"no run at {uri} (no such directory)", uri=uri)
    store = open_store(uri, s3_endpoint=s3_endpoint)
    return store, read_descriptor(store)
