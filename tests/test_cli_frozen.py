"""The command line is frozen: every subcommand's options, listed in tests/fixtures/cli_options.txt.
Adding, renaming or removing an option is a deliberate change: rewrite the list with
``.venv/bin/python tests/test_cli_frozen.py`` and say why in the commit."""
from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

FROZEN = Path(__file__).resolve().parent / "fixtures" / "cli_options.txt"


def _options(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                out += _options(sub, f"{prefix} {name}")
        elif action.option_strings:
            out += [f"{prefix} {s}" for s in action.option_strings if s not in ("-h", "--help")]
        else:
            out.append(f"{prefix} <{action.dest}>")
    return out


def cli_options() -> list[str]:
    """``ddiloco COMMAND OPTION`` for every option of every subcommand (plugins included)."""
    lines = []
    for ep in sorted(metadata.entry_points(group="ddiloco.commands"), key=lambda e: e.name):
        parser = argparse.ArgumentParser(prog=f"ddiloco {ep.name}")
        ep.load()(parser)
        lines += _options(parser, f"ddiloco {ep.name}")
    return sorted(set(lines))


def test_the_command_line_is_the_frozen_one():
    frozen = FROZEN.read_text().splitlines()
    now = cli_options()
    added, removed = sorted(set(now) - set(frozen)), sorted(set(frozen) - set(now))
    assert not added and not removed, (
        f"the CLI changed: added {added}, removed {removed}; if deliberate, run "
        f"`.venv/bin/python tests/test_cli_frozen.py` and say why in the commit")


if __name__ == "__main__":
    sys.path.insert(0, str(FROZEN.parents[2]))
    FROZEN.write_text("\n".join(cli_options()) + "\n")
    print(f"wrote {FROZEN}")
