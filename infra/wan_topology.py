"""Regions on one machine over an emulated WAN (docs/regions.md "A run over the WAN").

``WanTopology`` brings up what ``ddiloco run --regions N --wan SPEC`` needs: one SeaweedFS server
per region (infra/s3server.py, loopback only, bucket ``ddiloco-rK``), and a ``WanProxy`` (infra/wan.py)
on every path that crosses regions:

- ``s3:rK``: the home side's path to region rK's S3 server (the syncer's inbox reads and its
  replication writes; the launcher's seeding of rK at creation);
- ``s3:r0@rK``: region rK's path to the home S3 server (a learner's one descriptor look-up at start:
  it is started with the home store's URI and ``--region rK``);
- ``ingest:rK`` / ``announce:rK``: rK's learners' ZeroMQ sockets to the home syncer (with a bus;
  the bucket-only run, ``--no-bus``, has none: rK's learners reach the syncer through rK's bucket).

Each side resolves a region's endpoint itself, as on AWS: the descriptor names a credentials
*profile* per region and no endpoint, and each process reads an AWS config file of its side
(``AWS_CONFIG_FILE``) in which a profile's ``endpoint_url`` is the direct server for its own region
and the proxy for another. So one descriptor serves every side, and no learner can reach another
region's bucket except through the link. The credentials file (one profile per region, ``default``
for home) is shared; secrets stay in ``OUT/wan/credentials`` (0600), never in the descriptor.

``RegionCluster`` is the ``LocalCluster`` (workers/cluster.py) that starts each role with its
side's environment and gives a learner outside home the proxied bus endpoints.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.regions import RegionSpec, RegionsConfig
from workers.cluster import ClusterConfig, LocalCluster
from .s3server import S3Server
from .wan import WanProxy, WanStats
from .wan_link import LinkSpec

__all__ = ["WanConfig", "WanTopology", "RegionCluster", "region_name", "AWS_VARS"]

HOME = "r0"
BUCKET = "ddiloco-{}"
# Variables that would override the per-side config files (an endpoint for every store) or the
# shared credentials file: removed from each side's environment.
AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def region_name(k: int) -> str:
    return f"r{k}"


@dataclass(frozen=True)
class WanConfig:
    """``regions``: how many (r0 home, r1..); ``link``: the link spec of every cross-region path,
    or None for the same servers without proxies (the side-by-side baseline: every side reaches
    every server directly); ``per_region``: (region, spec) pairs that replace ``link`` on every
    path between home and that region (each region its own distance; not with ``link`` None);
    ``bus``: learners outside home use ZeroMQ through the link (False: the bucket-only path);
    ``prefix``: the run's key prefix in every bucket; ``seed``: the links' randomness (jitter, loss)."""

    regions: int
    link: LinkSpec | None
    bus: bool = True
    prefix: str = "run"
    seed: int = 0
    per_region: tuple[tuple[str, LinkSpec], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.regions, int) or self.regions < 2:
            raise ValueError(f"WanConfig.regions: a WAN needs at least 2 regions, got {self.regions!r}")
        if self.link is not None and not isinstance(self.link, LinkSpec):
            raise ValueError(f"WanConfig.link must be a LinkSpec or None, got {type(self.link).__name__}")
        if not re.match(r"^[a-z0-9][a-z0-9-]{0,62}$", self.prefix):
            raise ValueError(f"WanConfig.prefix must be a plain key prefix (a-z, 0-9, -), got {self.prefix!r}")
        others = [region_name(k) for k in range(1, self.regions)]
        names = [name for name, _ in self.per_region]
        for name, spec in self.per_region:
            if name not in others:
                raise ValueError(f"WanConfig.per_region: region {name!r} is not one of {others} (home {HOME} "
                                 "has no link of its own)")
            if not isinstance(spec, LinkSpec):
                raise ValueError(f"WanConfig.per_region[{name!r}] must be a LinkSpec, got {type(spec).__name__}")
        if len(set(names)) != len(names):
            raise ValueError(f"WanConfig.per_region names a region twice: {names}")
        if self.per_region and self.link is None:
            raise ValueError("WanConfig.per_region needs a link for the other regions (with no links, 'none', "
                             "there is nothing to override)")

    def link_for(self, region: str) -> LinkSpec | None:
        """The spec of the paths between home and ``region``."""
        return dict(self.per_region).get(region, self.link)

    @classmethod
    def parse(cls, regions: int, wan: str, bus: bool = True, seed: int = 0, prefix: str = "run") -> "WanConfig":
        """From ``--regions N --wan SPEC``; SPEC ``none`` (or ``off``): servers without proxies.
        Per region: ``"rtt=100ms,bw=100mbit;r2:rtt=250ms,bw=50mbit"`` - parts split by ``;``, a part
        ``rK:SPEC`` for region rK, the part without a name for every other region (needed unless
        every region is named)."""
        if wan.strip().lower() in ("none", "off"):
            return cls(regions, None, bus, prefix=prefix, seed=seed)
        default, named = None, []
        for part in (p.strip() for p in wan.split(";")):
            m = re.match(r"^(r\d+):(.*)$", part)
            if m:
                named.append((m.group(1), LinkSpec.parse(m.group(2))))
            elif default is not None:
                raise ValueError(f"--wan {wan!r}: more than one spec without a region name")
            else:
                default = LinkSpec.parse(part)
        others = {region_name(k) for k in range(1, regions)}
        for name, _ in named:
            if name not in others:
                raise ValueError(f"--wan {wan!r}: region {name!r} is not one of {sorted(others)} (home {HOME} has "
                                 "no link of its own)")
        if default is None:
            missing = sorted(others - {n for n, _ in named})
            if missing:
                raise ValueError(f"--wan {wan!r}: no spec for {missing} (add one without a region name for the rest)")
            default = named[0][1]
        return cls(regions, default, bus, prefix=prefix, seed=seed, per_region=tuple(named))


@dataclass
class _Link:
    name: str
    region: str                 # the non-home region whose partition cuts this link
    proxy: WanProxy


@dataclass
class WanTopology:
    """The servers and links of a multi-region run on this machine (module docstring). Start it
    from the thread that will outlive the servers (the main thread: see ``S3Server``)."""

    out: Path
    cfg: WanConfig
    servers: dict[str, S3Server] = field(default_factory=dict)
    links: list[_Link] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.dir = self.out / "wan"
        self.names = [region_name(k) for k in range(self.cfg.regions)]

    # -- bring-up ---------------------------------------------------------------------------------
    def start(self) -> "WanTopology":
        """Start one S3 server per region, the S3 links, and write each side's AWS files."""
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            for name in self.names:
                self.servers[name] = S3Server(self.dir / f"s3-{name}", bucket=BUCKET.format(name)).start()
            for name in self.names[1:]:
                self._link(f"s3:{name}", name, self.servers[name].port)          # home -> rK's bucket
                self._link(f"s3:{HOME}@{name}", name, self.servers[HOME].port)   # rK -> the home bucket
            self._write_credentials()
            for side in self.names:
                self._write_config(side)
        except BaseException:
            self.close()
            raise
        return self

    def bus_links(self, ingest: str, announce: str) -> None:
        """Links for the syncer's bus endpoints (``tcp://127.0.0.1:PORT``), one pair per non-home region."""
        if not self.cfg.bus:
            return
        for name in self.names[1:]:
            for kind, endpoint in (("ingest", ingest), ("announce", announce)):
                self._link(f"{kind}:{name}", name, int(endpoint.rsplit(":", 1)[1]))

    def _link(self, name: str, region: str, port: int) -> None:
        spec = self.cfg.link_for(region)
        if spec is None:
            return
        proxy = WanProxy("127.0.0.1", port, spec, seed=self.cfg.seed + len(self.links), name=name)
        proxy.start()
        self.links.append(_Link(name, region, proxy))

    def _proxy(self, name: str) -> WanProxy | None:
        return next((link.proxy for link in self.links if link.name == name), None)

    def _write_credentials(self) -> None:
        home = self.servers[HOME]
        lines = [f"[default]\naws_access_key_id = {home.access_key}\naws_secret_access_key = {home.secret_key}\n"]
        for name, s in self.servers.items():
            lines.append(f"[{name}]\naws_access_key_id = {s.access_key}\naws_secret_access_key = {s.secret_key}\n")
        path = self.dir / "credentials"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(lines))

    def endpoint(self, side: str, region: str) -> str:
        """The S3 endpoint that processes of region ``side`` use for ``region``'s bucket."""
        direct = self.servers[region].endpoint
        if side == region:
            return direct
        link = f"s3:{region}" if side == HOME else f"s3:{HOME}@{side}" if region == HOME else None
        proxy = self._proxy(link) if link else None
        return f"http://{proxy.endpoint}" if proxy is not None else direct

    def _write_config(self, side: str) -> None:
        """The AWS config of ``side``: ``default`` is the home bucket, profile rK region rK's, each
        with the endpoint this side reaches it at (another non-home region: direct; nothing uses it)."""
        out = [f"[default]\nregion = us-east-1\nendpoint_url = {self.endpoint(side, HOME)}\n"]
        for name in self.names:
            out.append(f"[profile {name}]\nregion = us-east-1\nendpoint_url = {self.endpoint(side, name)}\n")
        (self.dir / f"config-{side}").write_text("".join(out))

    # -- what a run needs ---------------------------------------------------------------------------
    @property
    def store_uri(self) -> str:
        """The run's home store (the syncer's, and the ``--store`` every role is started with)."""
        return self.servers[HOME].uri(self.cfg.prefix)

    @property
    def regions(self) -> RegionsConfig:
        """The descriptor's regions section: URIs and profile names, no endpoints (each side resolves them)."""
        return RegionsConfig(HOME, tuple(RegionSpec(n, s.uri(self.cfg.prefix), profile=n)
                                         for n, s in self.servers.items()))

    def env(self, side: str, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process in region ``side`` (``base``: default ``os.environ``)."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in AWS_VARS}
        env.update(AWS_CONFIG_FILE=str(self.dir / f"config-{side}"), AWS_SHARED_CREDENTIALS_FILE=str(self.dir / "credentials"),
                   AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        return env

    def use_home_env(self) -> None:
        """Make this process (the launcher) a home-side process."""
        for k in AWS_VARS:
            os.environ.pop(k, None)
        os.environ.update(self.env(HOME, {}))

    def open_direct(self, region: str):
        """Region ``region``'s store reached directly (for checks from outside the run; needs the
        credentials file in this process's environment, as ``use_home_env`` sets)."""
        from storage.regions import open_region
        spec = self.regions.region(region)
        return open_region(dataclasses.replace(spec, endpoint=self.servers[region].endpoint))

    def learner_bus(self, region: str) -> tuple[str, str] | None:
        """(ingest, announce) for a learner of ``region``: the proxies; None: the syncer's own."""
        ingest, announce = self._proxy(f"ingest:{region}"), self._proxy(f"announce:{region}")
        if region == HOME or ingest is None or announce is None:
            return None
        return f"tcp://{ingest.endpoint}", f"tcp://{announce.endpoint}"

    # -- faults and figures -----------------------------------------------------------------------
    def partition(self, region: str, mode: str = "reset") -> None:
        """Cut every link between home and ``region`` (S3 both ways and the bus)."""
        for link in self._links_of(region):
            link.proxy.partition(mode)

    def heal(self, region: str) -> None:
        for link in self._links_of(region):
            link.proxy.heal()

    def _links_of(self, region: str) -> list[_Link]:
        if region == HOME or region not in self.names:
            raise ValueError(f"region must be one of {self.names[1:]} (home {HOME} has no link of its own), "
                             f"got {region!r}")
        return [link for link in self.links if link.region == region]

    def stats(self) -> dict[str, WanStats]:
        return {link.name: link.proxy.stats() for link in self.links}

    def summary(self) -> dict:
        """The links' figures for a run summary: per link and in total, bytes both ways."""
        links = {n: vars(s) for n, s in self.stats().items()}
        return {"wan": {"link": None if self.cfg.link is None else vars(self.cfg.link),
                        "per_region": {name: vars(spec) for name, spec in self.cfg.per_region},
                        "regions": self.names, "bus_across": self.cfg.bus, "links": links,
                        "cross_region_bytes": sum(s["bytes_up"] + s["bytes_down"] for s in links.values())}}

    def close(self) -> None:
        for link in self.links:
            link.proxy.stop()
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> "WanTopology":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def learner_region(argv: Sequence[str], default: str = HOME) -> str:
    """The ``--region`` in a learner's flags (a learner without one lives at home)."""
    argv = list(argv)
    if "--region" in argv[:-1]:
        return argv[argv.index("--region") + 1]
    return default


class RegionCluster(LocalCluster):
    """A ``LocalCluster`` whose roles run in regions of a ``WanTopology``: each process gets its
    side's AWS files, a learner outside home the proxied bus (restarts included)."""

    def __init__(self, cfg: ClusterConfig, topology: WanTopology, **kw):
        super().__init__(cfg, **kw)
        self.topology = topology
        topology.bus_links(self.ingest, self.announce)
        self._base_env = self.env

    def spawn(self, name, role, argv, module="workers.cli", nice=0):
        # LocalCluster.spawn starts every process with self.env; the side's environment is put in
        # place for this one call (a cluster is driven from one thread), so restarts get it too.
        side = learner_region(argv) if role == "learner" else HOME
        self.env = dict(self.topology.env(side, self._base_env))
        try:
            return super().spawn(name, role, argv, module, nice)
        finally:
            self.env = self._base_env

    def start_learner(self, lid, extra=(), module="workers.cli", endpoints=None, bus=None):
        if endpoints is None and (self.cfg.bus if bus is None else bus):
            endpoints = self.topology.learner_bus(learner_region(extra))
        return super().start_learner(lid, extra, module, endpoints, bus)
