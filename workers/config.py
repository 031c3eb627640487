"""One configuration tree: typed dataclass sections become flags, a TOML file and a printable tree.

A *tree* is a frozen dataclass whose fields are *sections*, each a frozen dataclass whose plain
fields are *knobs* (int, float, str, bool, or one of those or None). A knob has one name,
``section.field``, everywhere: the flag ``--section.field``, the TOML key ``field`` under
``[section]``, the attribute ``tree.section.field``; and one default, the tree's. The sections
validate themselves (their ``__post_init__``), so a value is refused by the same code wherever it
came from. Precedence: the tree's defaults, then the file (``--config``), then the flags given.

This is torchtitan's JobConfig idea (typed sections, one TOML file, flags generated from it) with
torchft's eager validation: an unknown key, a value of the wrong type or one a section refuses
fails before anything starts, naming the key and where it came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

DEST = "tree:"          # argparse dest prefix of a knob's flag (``tree:policy.quorum``)
NONE = "none"           # how a knob that may be None says so in a flag or a TOML file (TOML has no null)
_PLAIN = (bool, int, float, str)
TAKES_VALUE = "<takes a value>"   # an Alias's ``const`` when the flag takes a value


@dataclass(frozen=True)
class Knob:
    """One setting: ``section.name`` of type ``type`` (``optional``: None is allowed)."""

    section: str
    name: str
    type: type
    optional: bool
    default: Any

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        return f"--{self.key}"

    @property
    def dest(self) -> str:
        return DEST + self.key


@dataclass(frozen=True)
class Alias:
    """A short flag kept for a knob (``--quorum`` for ``policy.quorum``); ``const``: the flag takes
    no value and sets this one (``--no-bus`` sets ``run.bus`` to False)."""

    flag: str
    key: str
    const: Any = TAKES_VALUE


def _knob_type(hint: Any) -> tuple[type, bool] | None:
    """(type, optional) of a plain knob; None for a field that is not one (a set, a map...)."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            return None
        hint, optional = args[0], True
    return (hint, optional) if hint in _PLAIN else None


def sections(tree: type) -> dict[str, type]:
    """The section classes of ``tree``, by section name, in declaration order - or in the tree's
    ``SECTION_ORDER`` when it declares one (inherited sections, such as pipeline/descriptor.py's
    ``RunSections``, otherwise come before the tree's own: ``[run]`` would print after the rules)."""
    hints = typing.get_type_hints(tree)
    names = [f.name for f in dataclasses.fields(tree)]
    order = getattr(tree, "SECTION_ORDER", None)
    if order is not None:
        if sorted(order) != sorted(names):
            raise ValueError(f"{tree.__name__}.SECTION_ORDER {list(order)} must name each of its sections once: {names}")
        names = list(order)
    return {name: hints[name] for name in names}


def knobs(tree: type, skip: Iterable[str] = ()) -> list[Knob]:
    """Every knob of ``tree`` (its default taken from the tree's default section), minus the
    fields named in ``skip`` (``section.field``: values the program derives, never set)."""
    skip = set(skip)
    defaults = tree()
    out = []
    for section, cls in sections(tree).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _knob_type(hints[f.name])
            if kind is None or f"{section}.{f.name}" in skip:
                continue
            out.append(Knob(section, f.name, kind[0], kind[1], getattr(getattr(defaults, section), f.name)))
    unknown = skip - {f"{s}.{f.name}" for s, c in sections(tree).items() for f in dataclasses.fields(c)}
    if unknown:
        raise ValueError(f"skip names fields the tree does not have: {sorted(unknown)}")
    return out


def from_args(args, tree: type, skip: Iterable[str], extra: Mapping[str, Any] | None = None):
    """The tree of a command: its defaults, then ``--config FILE``, then the flags given, then
    ``extra`` (values a command derives from flags of its own, e.g. repeated ``--region``).
    ``SystemExit`` naming the file or flag of a refused value."""
    try:
        values = read_toml(args.config, tree, skip) if args.config else {}
        sources = {k: args.config for k in values}
        flags = {**given(args), **(extra or {})}
        values.update(flags)
        sources.update({k: f"--{k}" for k in flags})
        return build(tree, values, sources)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


# -- values ---------------------------------------------------------------------------------------

def parse_text(knob: Knob, text: str) -> Any:
    """A knob's value from a flag's text (``ValueError`` naming the flag)."""
    if knob.optional and text.strip().lower() == NONE:
        return None
    try:
        if knob.type is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(text)
            return low in ("true", "1", "yes", "on")
        return knob.type(text)
    except ValueError:
        what = knob.type.__name__ + (f" or {NONE!r}" if knob.optional else "")
        raise ValueError(f"{knob.flag}: expected {what}, got {text!r}") from None


def check_value(knob: Knob, value: Any, source: str) -> Any:
    """``value`` for ``knob`` from a file (ints are taken for floats; bools are never numbers)."""
    if knob.optional and (value is None or (isinstance(value, str) and value.lower() == NONE)):
        return None
    if knob.type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (knob.type is bool) or not isinstance(value, knob.type):
        what = knob.type.__name__ + (f" or {NONE!r}" if knob.optional else "")
        raise ValueError(f"{source}: {knob.key} must be {what}, got {type(value).__name__} {value!r}")
    return value


# -- flags ----------------------------------------------------------------------------------------

def add_flags(parser: argparse.ArgumentParser, tree: type, *, skip: Iterable[str] = (),
              aliases: Iterable[Alias] = (), helps: Mapping[str, str] | None = None,
              choices: Mapping[str, Iterable[str]] | None = None) -> list[Knob]:
    """Add ``--section.field`` for every knob of ``tree``, one argument group per section, with
    its aliases; a flag's value is kept only when given (so a file's value is not overwritten by
    a default). Returns the knobs."""
    helps, choices = helps or {}, choices or {}
    found = knobs(tree, skip)
    by_key = {k.key: k for k in found}
    alias_list = list(aliases)
    for a in alias_list:
        if a.key not in by_key:
            raise ValueError(f"alias {a.flag} names {a.key!r}, which is not a knob of {tree.__name__}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for k in found:
        group = groups.get(k.section) or groups.setdefault(k.section, parser.add_argument_group(f"[{k.section}]"))
        names = [k.flag, *(a.flag for a in alias_list if a.key == k.key and a.const == TAKES_VALUE)]
        default = "none" if k.default is None else k.default
        options = f"; one of {', '.join(map(str, choices[k.key]))}" if k.key in choices else ""
        text = f"{helps.get(k.key, '')} (default: {default}{options})".strip()
        group.add_argument(*names, dest=k.dest, default=argparse.SUPPRESS, metavar=k.type.__name__.upper(),
                           type=_flag_type(k), help=text,
                           **({"choices": list(choices[k.key])} if k.key in choices else {}))
        for a in alias_list:
            if a.key == k.key and a.const != TAKES_VALUE:
                group.add_argument(a.flag, dest=k.dest, action="store_const", const=a.const,
                                   default=argparse.SUPPRESS, help=f"{k.key} = {a.const}")
    return found


def _flag_type(knob: Knob):
    """argparse's ``type`` for ``knob``: its refusal reads "argument --policy.quorum: expected int, got 'two'"."""
    def convert(text: str) -> Any:
        try:
            return parse_text(knob, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
    convert.__name__ = knob.type.__name__
    return convert


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs set by flags, by key."""
    return {name[len(DEST):]: v for name, v in vars(args).items() if name.startswith(DEST)}


# -- files ----------------------------------------------------------------------------------------

def read_toml(path: str | Path, tree: type, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The knobs a TOML file sets, by key; ``ValueError`` naming the file and the key for an
    unknown section or key, a value of the wrong type, or a file that is not TOML."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    by_key = {k.key: k for k in knobs(tree, skip)}
    names = list(sections(tree))
    out: dict[str, Any] = {}
    for section, table in doc.items():
        if section not in names:
            raise ValueError(f"{path}: unknown section [{section}] (sections: {', '.join(names)})")
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {section} must be a table ([{section}]), got {table!r}")
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in by_key:
                known = ", ".join(k.name for k in by_key.values() if k.section == section)
                raise ValueError(f"{path}: unknown key {key!r} ([{section}] has: {known})")
            out[key] = check_value(by_key[key], value, str(path))
    return out


def _toml_value(value: Any) -> str:
    if value is None:
        return f'"{NONE}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return ("-" if value < 0 else "") + ("nan" if math.isnan(value) else "inf")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(config: Any, skip: Iterable[str] = (), header: str = "") -> str:
    """The tree ``config`` as TOML, every knob with its value (``read_toml`` reads it back)."""
    lines = [f"# {line}" for line in header.splitlines()]
    section = None
    for k in knobs(type(config), skip):
        if k.section != section:
            section = k.section
            lines += ["", f"[{section}]"] if lines else [f"[{section}]"]
        lines.append(f"{k.name} = {_toml_value(getattr(getattr(config, k.section), k.name))}")
    return "\n".join(lines) + "\n"


# -- the resolved tree ----------------------------------------------------------------------------

def build(tree: type, values: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> Any:
    """``tree``'s defaults with ``values`` (by key) set; each section validates its own values, and
    a refusal names the section and where its values came from (``sources``: key -> origin)."""
    sources = sources or {}
    base = tree()
    parts = {}
    for section in sections(tree):
        mine = {k.split(".", 1)[1]: v for k, v in values.items() if k.split(".", 1)[0] == section}
        current = getattr(base, section)
        if not mine:
            parts[section] = current
            continue
        try:
            parts[section] = dataclasses.replace(current, **mine)
        except (ValueError, TypeError) as exc:
            origin = sorted({sources.get(f"{section}.{n}", "a flag") for n in mine})
            raise ValueError(f"[{section}] ({', '.join(origin)}): {exc}") from None
    return tree(**parts)
