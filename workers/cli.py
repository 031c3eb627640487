"""`ddiloco`: the command line.

Subcommands are plugins registered under the entry-point group ``ddiloco.commands``
(see setup.cfg). Each entry point names a ``configure(parser) -> handler`` function: it adds its
arguments to ``parser`` and returns ``handler(args) -> int`` (the exit status). Loading is lazy, so
one broken or slow-to-import command never breaks the others, and workers/ never imports infra/.
"""
from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv[1:])
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
