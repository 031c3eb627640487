"""`ddiloco`: the command line.

Subcommands are plugins registered under the entry-point group ``ddiloco.commands``
(see setup.cfg). Each entry point names a ``configure(parser) -> handler`` function: it adds its
arguments to ``parser`` and returns ``handler(args) -> int`` (the exit status). Loading is lazy, so
one broken or slow-to-import command never breaks the others, and workers/ never imports infra/.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from typing import Callable, Sequence

GROUP = "ddiloco.commands"


def _version() -> str:
    try:
        return metadata.version("decoupled-diloco")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def _commands() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=GROUP)}


def _summary(ep: metadata.EntryPoint) -> str:
    """First docstring line of the command's configure function (imports the module)."""
    try:
        doc = (ep.load().__doc__ or "").strip()
    except Exception as exc:  # a command that fails to import is listed, not fatal
        return f"(unavailable: {exc})"
    return doc.splitlines()[0] if doc else ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    top = argparse.ArgumentParser(
        prog="ddiloco",
        description="Decoupled DiLoCo: train one model on many independent, failure-prone learners.",
    )
    top.add_argument("--version", action="version", version=f"ddiloco {_version()}")
    top.add_argument("command", nargs="?", choices=sorted(commands), metavar="COMMAND",
                     help="one of: " + ", ".join(sorted(commands)))
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        print("\ncommands:")
        for name in sorted(commands):
            print(f"  {name:<12} {_summary(commands[name])}")
        return 0 if argv else 2
    if argv[0] == "--version":
        top.parse_args(argv)
    name = argv[0]
    if name not in commands:
        top.error(f"unknown command {name!r}; choose from: {', '.join(sorted(commands))}")
    configure: Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]] = commands[name].load()
    parser = argparse.ArgumentParser(prog=f"ddiloco {name}", description=configure.__doc__)
    handler = configure(parser)
    return run_handler(handler, parser.parse_args(argv[1:]))


def run_handler(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's handler the way ``ddiloco`` does: a command's own refusal or an error a user
    can act on becomes one ``error:`` line and an exit code; a bug keeps its traceback."""
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, str):     # a command's own one-line refusal
            print(f"error: {exc.code}", file=sys.stderr)
            return 2
        raise
    except Exception as exc:   # noqa: BLE001 - a user reads one line; a bug keeps its traceback
        line = explain(exc)
        if line is None or os.environ.get("DDILOCO_DEBUG"):
            raise
        print(line, file=sys.stderr)
        return EXIT_ERROR


EXIT_ERROR = 1


def explain(exc: BaseException) -> str | None:
    """``error: <cause> — <fix>`` for the errors a user can act on; None for
    anything else (a bug: its traceback is kept). ``DDILOCO_DEBUG=1`` shows tracebacks always."""
    from pipeline.errors import FormatError
    from storage.errors import BadLocation, Fenced, NotFound, StoreError, Unavailable
    from storage.layout import DESCRIPTOR_KEY
    text = str(exc)
    if isinstance(exc, BadLocation):
        fix = "give a directory, file:///abs/path or s3://bucket/prefix"
    elif isinstance(exc, NotFound) and (exc.key in (None, DESCRIPTOR_KEY)):
        fix = "check the path (only `ddiloco run` creates a run; `ddiloco run --create-only --store URI` makes one)"
    elif isinstance(exc, NotFound):
        fix = "an object the run needs is missing: `ddiloco replay URI` names what is damaged (docs/replay.md)"
    elif isinstance(exc, Unavailable):
        fix = ("the store did not answer: check that it is up and reachable (for S3: --s3-endpoint or "
               "AWS_ENDPOINT_URL, `ddiloco s3 up` for a local one), then start again")
    elif isinstance(exc, Fenced):
        fix = "a newer syncer owns this run; this one stopped (nothing to do)"
    elif isinstance(exc, StoreError):
        fix = "check the location, its permissions and (for S3) the credentials"
    elif isinstance(exc, FormatError):
        fix = "an object is damaged or not from this project: `ddiloco replay URI` locates it"
    elif type(exc).__module__.startswith("zmq"):
        fix = ("another process holds that address, or it is not one this host has: pick other "
               "--ingest/--announce endpoints (tcp://HOST:PORT)")
    elif isinstance(exc, (ValueError, OSError)):
        return f"error: {text}"      # our ValueErrors already say what to do; OSError names the file
    else:
        return None
    return f"error: {text} — {fix}"


if __name__ == "__main__":
    sys.exit(main())
