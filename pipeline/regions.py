"""The run topology (docs/regions.md "Topology"): the regions of a run and where each
keeps its store.

A run has one *home* region - the syncer and the authoritative commit log live in its store - and
any number of others, each with its own store (a bucket in that region). Learners read versions,
commit records and the round clock from their own region's store and spill there; the syncer
ingests every region's inbox and replicates each commit record and version to every other region
(workers/syncer/replicate.py). A run without a ``regions`` section is one region: today's single store.

The descriptor's ``regions`` section (docs/formats.md "Run descriptor", version 3) is a
``RegionsConfig``. It carries no secret: a credentials *profile name* (the AWS shared-config
profile the reader's own machine resolves), never keys, and URIs with user info are refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .errors import FormatError

__all__ = ["RegionSpec", "RegionsConfig", "REGION_NAME_RE", "parse_regions"]

REGION_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")   # fits a bucket name and an AWS region id
_PROFILE_RE = re.compile(r"^[A-Za-z0-9_.+=@-]{1,64}$")


def _no_secret(value: str, what: str) -> None:
    """A URI in the descriptor must not carry credentials: the descriptor is readable by every
    learner of every region, and stored in every region's bucket."""
    if "://" in value:
        parts = urlsplit(value)
        if "@" in parts.netloc:
            raise ValueError(f"{what} {value!r} carries user info; credentials never go in the descriptor "
                             "(name a profile instead)")
        if parts.query:
            raise ValueError(f"{what} {value!r} carries a query string (a presigned URL?); give a plain location")


@dataclass(frozen=True)
class RegionSpec:
    """One region: its ``name``, its store ``uri`` (a directory, ``file:///``, ``s3://bucket/prefix``),
    and optionally the S3 ``endpoint`` and the credentials ``profile`` name to open it with."""

    name: str
    uri: str
    endpoint: str | None = None
    profile: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not REGION_NAME_RE.match(self.name):
            raise ValueError(f"region name {self.name!r} must match {REGION_NAME_RE.pattern}")
        if not isinstance(self.uri, str) or not self.uri.strip():
            raise ValueError(f"region {self.name}: uri must be a non-empty string, got {self.uri!r}")
        _no_secret(self.uri, f"region {self.name}: uri")
        if self.endpoint is not None:
            if not isinstance(self.endpoint, str) or not re.match(r"^https?://[^/\s]+/?$", self.endpoint):
                raise ValueError(f"region {self.name}: endpoint must be http(s)://host[:port], got {self.endpoint!r}")
            _no_secret(self.endpoint, f"region {self.name}: endpoint")
        if self.profile is not None and (not isinstance(self.profile, str) or not _PROFILE_RE.match(self.profile)):
            raise ValueError(f"region {self.name}: profile must be a profile name matching {_PROFILE_RE.pattern}, "
                             f"got {self.profile!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "uri": self.uri, "endpoint": self.endpoint, "profile": self.profile}


@dataclass(frozen=True)
class RegionsConfig:
    """The regions of a run, ``home`` first-class: it names the region whose store holds the
    authoritative log. Names are unique, and so are (uri, endpoint) pairs; order is the launcher's
    (kept, so equal configurations write equal bytes)."""

    home: str
    regions: tuple[RegionSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.regions, tuple) or not self.regions \
                or not all(isinstance(r, RegionSpec) for r in self.regions):
            raise ValueError("regions must be a non-empty tuple of RegionSpec")
        names = [r.name for r in self.regions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"regions: names {dup} appear more than once")
        # The same bucket name on two endpoints is two stores; on one endpoint it is one store.
        places = [(r.uri, r.endpoint) for r in self.regions]
        dup = sorted({u for u, e in places if places.count((u, e)) > 1})
        if dup:
            raise ValueError(f"regions: uris {dup} appear more than once with the same endpoint (two regions "
                             "cannot share a store)")
        if self.home not in names:
            raise ValueError(f"regions: home {self.home!r} is not one of the regions {names}")

    def region(self, name: str) -> RegionSpec:
        """The region called ``name``; ValueError listing the run's regions otherwise."""
        for r in self.regions:
            if r.name == name:
                return r
        raise ValueError(f"no region {name!r} in this run; its regions are {[r.name for r in self.regions]}")

    @property
    def others(self) -> tuple[RegionSpec, ...]:
        """Every region but the home one: where the syncer replicates to."""
        return tuple(r for r in self.regions if r.name != self.home)

    def to_dict(self) -> dict[str, Any]:
        return {"home": self.home, "regions": [r.to_dict() for r in self.regions]}


def parse_regions(m: Any, path: str) -> RegionsConfig:
    """The ``regions`` section of a descriptor map; FormatError naming the field's path."""
    if not isinstance(m, dict) or set(m) != {"home", "regions"}:
        raise FormatError(f"{path} must be a map with exactly the fields ['home', 'regions'], got {m!r}"[:300])
    if not isinstance(m["regions"], list):
        raise FormatError(f"{path}.regions must be a list, got {type(m['regions']).__name__}")
    specs = []
    for i, r in enumerate(m["regions"]):
        fields = ("name", "uri", "endpoint", "profile")
        if not isinstance(r, dict) or set(r) != set(fields):
            raise FormatError(f"{path}.regions[{i}] must be a map with exactly the fields {list(fields)}")
        try:
            specs.append(RegionSpec(**{k: r[k] for k in fields}))
        except ValueError as exc:
            raise FormatError(f"{path}.regions[{i}]: {exc}") from None
    try:
        return RegionsConfig(m["home"], tuple(specs))
    except ValueError as exc:
        raise FormatError(f"{path}: {exc}") from None


def parse_region_spec(text: str) -> RegionSpec:
    """A region from the command line: ``NAME=URI[,endpoint=URL][,profile=NAME]`` (issue 29), e.g.
    ``r1=s3://bucket-b/run,endpoint=https://s3.eu-west-1.amazonaws.com,profile=eu``. ValueError
    naming what is wrong; credentials never appear here (a profile names them)."""
    if not isinstance(text, str) or "=" not in text:
        raise ValueError(f"--region {text!r}: expected NAME=URI[,endpoint=URL][,profile=NAME]")
    name, rest = text.split("=", 1)
    uri, *options = rest.split(",")
    fields: dict[str, str] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("endpoint", "profile") or key in fields or not value:
            raise ValueError(f"--region {text!r}: {opt!r} is not endpoint=URL or profile=NAME (each at most once)")
        fields[key] = value
    try:
        return RegionSpec(name.strip(), uri.strip(), fields.get("endpoint"), fields.get("profile"))
    except ValueError as exc:
        raise ValueError(f"--region {text!r}: {exc}") from None


def regions_from_specs(texts) -> RegionsConfig:
    """The regions of ``--region`` flags, home first (the run's authoritative log lives there)."""
    specs = tuple(parse_region_spec(t) for t in texts)
    if len(specs) < 2:
        raise ValueError(f"--region: a run with regions needs at least two, got {len(specs)} (one region is a plain "
                         "--store)")
    return RegionsConfig(specs[0].name, specs)
