"""A syncer that dies mid-commit, for the chaos scenario ``syncer-crash-mid-commit`` (docs/chaos.md).

    python -m infra.chaos.faulty_syncer --crash-before-commit N <every `ddiloco syncer` flag>

builds the syncer with the very handler of ``ddiloco syncer`` (workers/commands.py
``configure_syncer``) and passes ``Syncer(before_commit=...)`` a hook that, on the N-th attempt to
append a ``merge`` commit - when the round's inputs and its version object are already stored -
logs ``fault-injected`` and exits with ``os._exit(137)``, like a SIGKILL between the data and the
commit that names it (SPEC §7: data before the commit). The production syncer reads no fault
setting at all; this wrapper is the only way in.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from pipeline.types import CommitRecord
from workers.cli import run_handler
from workers.commands import configure_syncer
from workers.common.events import EventLog

CRASH = "crash-before-commit"
EXIT_CODE = 137                      # what a SIGKILLed process reports (128 + 9)


def crash_count(spec: str) -> int:
    """A scenario's ``syncer_fault`` (``crash-before-commit[:N]``, N >= 1, default 1) -> N."""
    name, _, n = (spec or "").partition(":")
    if name != CRASH or not (n or "1").isdigit() or int(n or "1") < 1:
        raise ValueError(f"syncer fault {spec!r}: expected {CRASH}[:N] with N >= 1")
    return int(n or "1")


class CrashBeforeCommit:
    """The ``before_commit`` hook: exit 137 on the ``n``-th append attempt of a merge commit.
    ``exit`` is ``os._exit`` (no clean-up, no flush beyond the event log's own line) unless a test
    passes another."""

    def __init__(self, n: int, events: EventLog, exit: Callable[[int], object] = os._exit):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"--crash-before-commit must be an int >= 1, got {n!r}")
        self.left, self.events, self.exit = n, events, exit

    def __call__(self, rec: CommitRecord) -> None:
        if rec.kind != "merge":
            return
        self.left -= 1
        if self.left <= 0:
            self.events.emit("fault-injected", fault=CRASH, seq=rec.seq, output_key=rec.output_key)
            self.exit(EXIT_CODE)


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.chaos.faulty_syncer",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--crash-before-commit", type=_at_least_one, required=True, metavar="N",
                        help="exit 137 on the N-th merge commit, after its data is stored, before it is appended")
    handler = configure_syncer(parser, before_commit=lambda args, events: CrashBeforeCommit(
        args.crash_before_commit, events))
    return run_handler(handler, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
