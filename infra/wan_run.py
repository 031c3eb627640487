"""``ddiloco run --regions N --wan SPEC``: the run topology plugin (entry-point group
``ddiloco.run_topology``, setup.cfg; the extension point is workers/run.py ``_topology_plugins``).

With ``--wan`` the run gets one SeaweedFS server per region and an emulated link on every path
between home and another region (infra/wan_topology.py); learner m runs in region r(m mod N) as in
a local ``--regions`` run. ``--no-bus`` is the bucket-only path: no ZeroMQ at all, so a learner
outside home reaches the syncer only through its region's bucket. ``--wan none`` is the same
servers without links (the benchmark's side-by-side baseline). The summary gains ``wan``: the link
spec and each link's bytes both ways (docs/regions.md "A run over the WAN").
"""
from __future__ import annotations

from pathlib import Path

from storage.errors import StoreError
from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.regions import open_region, verify_region
from storage.store import ObjectStore, open_store
from workers.cluster import ClusterConfig
from .wan_topology import HOME, RegionCluster, WanConfig, WanTopology


def configure_run(parser):
    """Add ``--wan`` to ``ddiloco run``; returns ``select(args, cfg, out)`` (None without ``--wan``)."""
    parser.add_argument("--wan", default=None, metavar="SPEC",
                        help="with --regions N >= 2: one local S3 server per region and an emulated link on every "
                             "cross-region path, e.g. 'rtt=100ms,bw=100mbit', per region 'rtt=100ms;r2:rtt=250ms' "
                             "(docs/regions.md; 'none': servers, no links); --no-bus: the bucket-only path")
    parser.add_argument("--wan-seed", type=int, default=0, help="seed of the links' jitter and loss")
    return select


def select(args, cfg, out: Path) -> "WanRun | None":
    """The WAN topology for ``ddiloco run``'s own flags ``args`` and its resolved config tree ``cfg``
    (workers/run_config.py ``RunConfig``)."""
    if args.wan is None:
        return None
    run = cfg.run
    if run.regions < 2:
        raise SystemExit(f"--wan needs --regions N >= 2 (the links are between regions), got --regions {run.regions}")
    if run.store is not None or run.s3_endpoint is not None:
        raise SystemExit("--wan starts its own S3 server per region: leave out --store and --s3-endpoint")
    try:
        wan = WanConfig.parse(run.regions, args.wan, bus=run.bus, seed=args.wan_seed)
    except ValueError as exc:
        raise SystemExit(f"--wan: {exc}") from None
    return WanRun(WanTopology(out, wan).start())


class WanRun:
    """What workers/run.py asks of a topology, over a started ``WanTopology``."""

    def __init__(self, topology: WanTopology):
        self.topology = topology
        topology.use_home_env()          # the launcher is a home-side process (creates the run, evaluates)
        self.store_uri = topology.store_uri
        self.regions = topology.regions

    def cluster(self, cfg: ClusterConfig) -> RegionCluster:
        return RegionCluster(cfg, self.topology)

    def summary(self) -> dict:
        """The links' figures and, per other region, whether its copy matches the home log
        (``storage.regions.verify_region``, as ``ddiloco replay --regions``). The servers stop
        with the run, so every region's store is also copied to ``OUT/stores/<region>``:
        ``ddiloco replay OUT`` (``--regions`` too), ``log OUT`` and ``export OUT`` read the copies."""
        out = self.topology.summary()
        home = open_store(self.store_uri, create=False)
        out["wan"]["regions_verified"] = verify_copies(home)
        stores = {}
        for name in self.topology.names:
            src = home if name == HOME else self.topology.open_direct(name)
            stores[name] = str(mirror(src, self.topology.out / "stores" / name))
        out["replay_uri"], out["region_stores"] = stores[HOME], stores
        return out

    def close(self) -> None:
        self.topology.close()


def mirror(src: ObjectStore, dest: Path) -> Path:
    """Copy every object of ``src`` into a local directory store at ``dest`` (byte for byte: the
    copy verifies as the original does)."""
    dst = open_store(str(dest))
    for key in src.list(""):
        dst.put(key, src.get(key))
    return dest


def verify_copies(home: ObjectStore) -> dict:
    """Per non-home region: ok, commits checked, the region's contiguous tail vs home's, and the
    first keys missing or differing (an unreachable region: its error)."""
    desc = read_descriptor(home)
    tail = CommitLog(home).tail()
    out = {}
    for spec in desc.regions.regions if desc.regions else ():
        if spec.name == desc.regions.home:
            continue
        try:
            c = verify_region(home, open_region(spec), spec.name, tail)
        except StoreError as exc:
            out[spec.name] = {"ok": False, "error": str(exc)}
            continue
        out[spec.name] = {"ok": c.ok and c.tail == tail, "checked": c.checked, "tail": c.tail, "home_tail": tail,
                          "missing": c.missing[:3], "mismatched": c.mismatched[:3]}
    return out
