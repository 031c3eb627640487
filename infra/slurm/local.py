"""A real SLURM on loopback, for tests and for trying ``ddiloco slurm submit`` on a laptop (issue 29).

    cluster = LocalSlurm(tmp_dir).start()      # munged, slurmctld, slurmd; SLURM_CONF in cluster.env()
    cluster = LocalSlurm(tmp_dir, nodes=2)     # two nodes n1, n2: one slurmd each, both on this host
    subprocess.run(["sbatch", ...], env={**os.environ, **cluster.env()})
    cluster.stop()

Debian's ``slurm-wlm`` and ``munge`` packages (``apt-get install slurm-wlm munge``; ``missing()``
names what is absent). Everything lives in ``DIR``: the munge key and socket, the controller's
state, the node's spool, logs and ``slurm.conf``. Both daemons bind 127.0.0.1 only
(``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny`` with the node and controller addresses
given as 127.0.0.1; slurmctld has no bind option of its own), on ports chosen here.

Settings that differ from a site's and why:

- ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups in a container.
- ``SlurmdParameters=config_overrides`` with ``CPUs=16``: the job slots the test needs (a syncer,
  learners, the stop job) on a 2-core machine; the jobs oversubscribe its cores, as processes do.
- ``nodes=N > 1``: N slurmd daemons on this host (Debian's slurmd is built with multiple-slurmd
  support), nodes ``n1..nN`` at 127.0.0.1 on ports of their own, each with its own spool, pid and log
  (``%n`` in their paths). A job of several nodes then really runs ``srun`` across slurmds, so a
  learner's torchrun group spans "nodes" as on a cluster; the nodes share this host's cores.
- ``AuthInfo=cred_expire=5``: a requeued job waits ``cred_expire`` + 1 s before it may start again
  (120 s by default: on a real cluster a requeued learner is back after about two minutes), and
  ``SchedulerParameters=sched_interval=1,bf_interval=1`` so the scheduler looks every second.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
INSTALL = "apt-get install -y slurm-wlm munge"
NODE, CLUSTER, PARTITION = "localhost", "ddiloco", "debug"
SLOTS = 16
READY_S = 60.0


def missing() -> str | None:
    """None when every daemon and client is installed, else which are not and the install command."""
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    return f"not installed: {', '.join(absent)} (install with: {INSTALL})" if absent else None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class LocalSlurm:
    """munged + slurmctld + one slurmd per node (one node named ``localhost``, or ``n1..nN`` with
    ``nodes=N``), all state under ``root``."""

    def __init__(self, root: str | Path, slots: int = SLOTS, nodes: int = 1) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.root = Path(root).resolve()
        self.slots = slots
        self.nodes = [NODE] if nodes == 1 else [f"n{i + 1}" for i in range(nodes)]
        self.conf = self.root / "slurm.conf"
        self._pids: dict[str, Path] = {}

    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, scontrol) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env()})
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return done

    def start(self) -> "LocalSlurm":
        why = missing()
        if why is not None:
            raise RuntimeError(f"local SLURM: {why}")
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        ctld_port, *slurmd_ports = _free_ports(1 + len(self.nodes))
        self.conf.write_text(self._conf(ctld_port, slurmd_ports))
        sock = self.root / "munge.sock"
        self._spawn("munged", [_which("munged"), "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={self.root / 'munge.seed'}"], self.root / "munged.pid")
        self._spawn("slurmctld", [_which("slurmctld"), "-i", "-f", str(self.conf)], self.root / "slurmctld.pid")
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-N", node, "-f", str(self.conf)],
                        self.root / f"slurmd-{node}.pid")
        self._wait_idle()
        return self

    def _conf(self, ctld_port: int, slurmd_ports: list[int]) -> str:
        r = self.root
        nodes = [f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={NODE} Port={port} CPUs={self.slots} RealMemory=4000 "
                 "State=UNKNOWN" for n, port in zip(self.nodes, slurmd_ports)]
        return "\n".join([
            f"ClusterName={CLUSTER}", f"SlurmctldHost={NODE}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_ports[0]}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge.sock'},cred_expire=5",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none", "SwitchType=switch/none",
            "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=1,bf_interval=1",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides",
            "ReturnToService=2", "JobRequeue=1", "KillWait=30", "MinJobAge=3600",
            *nodes,
            f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
            ""])

    def _spawn(self, name: str, argv: list[str], pidfile: Path) -> None:
        """Start a daemon (each forks into the background and writes its pid file)."""
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={**os.environ, **self.env()})
        if done.returncode != 0:
            raise RuntimeError(f"local SLURM: {name} did not start ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-800:]}")
        self._pids[name] = pidfile

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + READY_S
        state = ""
        while time.monotonic() < deadline:
            done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
            state = " ".join(f"{n}={states.get(n, '?')}" for n in self.nodes)
            if all(states.get(n) in ("idle", "mix", "alloc") for n in self.nodes):
                return
            time.sleep(0.3)
        logs = "\n".join(f.read_text()[-1500:] for f in sorted((self.root / "log").glob("slurm*.log")))
        self.stop()
        raise RuntimeError(f"local SLURM: nodes not idle within {READY_S:g} s ({state}):\n{logs}")

    def stop(self) -> None:
        """Cancel every job, stop the daemons, then SIGKILL whatever still carries this cluster's
        ``SLURM_CONF`` (a job step's slurmstepd and its processes outlive slurmd)."""
        if self.conf.exists() and self._pids:
            self.run("scancel", "--full", "--signal=KILL", "-u", "root", check=False)
            self.run("scancel", "-u", "root", check=False)
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmctld", *(f"slurmd-{n}" for n in self.nodes), "munged"):
            pidfile = self._pids.pop(name, None)
            try:
                pid = int(pidfile.read_text().split()[0]) if pidfile is not None else None
            except (OSError, ValueError, IndexError):
                pid = None
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        self._sweep()

    def _sweep(self) -> None:
        mark = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
