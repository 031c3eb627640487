"""The two processes `python -m infra.lab.overhead` times (infra/lab/overhead.py), one at a time.

``python -m infra.lab.overhead_roles control --out F --steps N --seed S``: the *sync-off control*, the
default job's model, data, optimizer and learning-rate schedule trained by a plain loop (no Learner,
no threads), timed exactly as ``Learner.step`` times a step (zero_grad, forward, backward,
optimizer step; the batch and the learning rate are set outside the timing in both).

``python -m infra.lab.overhead_roles --id l0 --store URI --log F ...`` (``LocalCluster.start_learner``'s
flags): the *sync-on* learner, ``ddiloco learner`` (the same ``learner_process``) with a step
trace (infra/lab/steptrace.py) as its step observer, so its ``step-trace`` event says what each step
held. It also logs ``thread-cpu``: the CPU seconds each of its threads (sender, receiver and their pools,
threads Python did not start such as ZeroMQ's) used between the first and the last step, read
from /proc/self/task (Linux). Both take ``--cpus`` (e.g. ``0`` or ``0-1``): the process's
allowed cores, set before any thread starts.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from workers.common.cpus import parse_cpus, pin, process_cpu


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by Python thread name
    (threads Python did not start are summed as ``other``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "other")
        name = name.split("_")[0] if name.startswith(("receiver-fetch", "sender-encode")) else name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def children() -> list[int]:
    """Pids of this process's children (Linux /proc)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            out += [int(c) for c in Path(f"/proc/self/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return out


def control(out: str, steps: int, seed: int, cpus: set[int] | None, guard: str = "off",
            neighbour: list[int] | None = None, block: int = 10, model_from: str | None = None) -> None:
    """The sync-off loop (module docstring); writes step times and per-step collection counts.

    Ablation only (infra/lab/overhead_ablate.py; ``python -m infra.lab.overhead`` runs neither):
    ``guard`` "on" adds the learner's non-finite check (``float(loss)``, ``grads_finite``) between
    backward and the optimizer step as ``Learner.step`` does, "alternate" on every odd step;
    ``neighbour``: processes (pids) that are let run (SIGCONT) in alternate blocks of ``block`` steps
    and stopped (SIGSTOP) in the others, switched outside the timed window. The per-step ``b``
    column says which steps had the feature (guard, or the neighbour running): an A/B inside one
    process, free of the +-3% that separate processes differ by on this machine."""
    pin(cpus)
    import torch
    from workers.job.data import Corpus
    from workers.job.job import JobSettings, make_optimizer, set_lr
    from workers.job.model import GPTConfig, build_model
    from workers.learner.nonfinite import grads_finite
    from workers.run_config import RunConfig
    torch.set_num_threads(1)                  # what learner_process sets
    gcfg, job = GPTConfig(), JobSettings(steps=steps, batch_size=RunConfig().job.batch_size, shards=1)
    if model_from is not None:     # the model and job of a created run (benchmark --run-args)
        from storage.layout import read_descriptor
        from storage.store import open_store
        from workers.job.job import job_from
        gcfg, job = job_from(read_descriptor(open_store(model_from, create=False)))
    corpus = Corpus(job.data_config(gcfg.block_size))
    model = build_model(gcfg, seed)
    opt = make_optimizer(model, job)
    batches = corpus.batches(0, job.shards, seed)
    gcs = [0]
    counter = lambda phase, info: gcs.__setitem__(0, gcs[0] + (phase == "start"))   # noqa: E731
    gc.callbacks.append(counter)
    times, collections, marks = [], [], []
    for i in range(steps):
        x, y = next(batches)
        set_lr(opt, job, i)
        gcs[0] = 0
        if neighbour and i % block == 0:
            for pid in neighbour:
                os.kill(pid, signal.SIGCONT if (i // block) % 2 else signal.SIGSTOP)
        check = guard == "on" or (guard == "alternate" and i % 2 == 1)
        b = check or (bool(neighbour) and (i // block) % 2 == 1)
        t0 = time.monotonic()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        if check and not (math.isfinite(float(loss.detach())) and grads_finite(model.parameters())):
            raise SystemExit(f"control: non-finite step {i}")
        opt.step()
        times.append(time.monotonic() - t0)
        collections.append(gcs[0])
        marks.append(int(b))
    gc.callbacks.remove(counter)
    for pid in neighbour or ():
        os.kill(pid, signal.SIGCONT)
    Path(out).write_text(json.dumps({"step_times": times, "gcs": collections, "b": marks,
                                     "params": sum(p.numel() for p in model.parameters())}))


def learner_ab(out: str, run: str, steps: int, cpus: set[int] | None, sync_process: bool) -> None:
    """Ablation only (infra/lab/overhead_ablate.py ``--ab learner``): the default job's model and
    optimizer on run ``run`` (unsigned, no syncer: no round ever opens, so every learner step is an
    "other" step), stepping through ``Learner.step`` on odd steps and through the plain loop
    (``control``'s body) on even ones, one process: the learner's own per-step cost, A/B inside
    one process. Writes ``step_times`` and ``b`` (1: a learner step)."""
    pin(cpus)
    import torch
    from storage.layout import read_descriptor
    from storage.store import open_store
    from workers.common.events import EventLog
    from workers.job.data import Corpus
    from workers.job.job import job_from, make_optimizer, set_lr
    from workers.job.model import GPT
    from workers.learner.learner import Learner, LearnerConfig
    torch.set_num_threads(1)                  # what learner_process sets
    store = open_store(run, create=False)
    gcfg, job = job_from(read_descriptor(store))
    model = GPT(gcfg)
    opt = make_optimizer(model, job)
    learner = Learner(model, opt, store, "l0", LearnerConfig(sync_process=sync_process),
                      events=EventLog(None, "learner", "l0"))
    learner.start()
    batches = Corpus(job.data_config(gcfg.block_size)).batches(0, job.shards, 0)
    times, marks = [], []
    try:
        for i in range(steps):
            x, y = next(batches)
            set_lr(opt, job, i)
            t0 = time.monotonic()
            if i % 2:
                learner.step(lambda: model(x, y)[1], tokens=x.numel())
            else:
                opt.zero_grad(set_to_none=True)
                loss = model(x, y)[1]
                loss.backward()
                opt.step()
            times.append(time.monotonic() - t0)
            marks.append(i % 2)
    finally:
        learner.close(flush=False)
    Path(out).write_text(json.dumps({"step_times": times, "b": marks}))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infra.lab.overhead_roles", description=__doc__.splitlines()[0])
    for flag in ("--store", "--id", "--log", "--ingest", "--announce"):
        p.add_argument(flag, required=True)
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--key", default=None)
    p.add_argument("--syncer-key", default=None)
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--cpus", default=None, help="allowed cores of the whole process (e.g. 0 or 0-1)")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
    p.add_argument("--sync-process", action="store_true", help="LearnerConfig.sync_process (workers/learner/agent.py)")
    p.add_argument("--agent-cpus", default=None, help="with --sync-process: cores of the sync agent process")
    p.add_argument("--interleave", action="store_true",
                   help="a plain step before each learner step, one process (infra/lab/overhead_interleave.py)")
    return p


def learner(argv: list[str]) -> int:
    """The traced sync-on learner (module docstring)."""
    args = _parser().parse_args(argv)
    pin(parse_cpus(args.cpus))
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    from storage.store import open_store
    from workers.bus.bus import BusConfig, BusCounters
    from workers.bus.keys import KeyRing, load_identity, load_public
    from workers.common.events import EventLog
    from workers.job.job import learner_process
    from workers.learner.learner import LearnerConfig
    from .steptrace import StepTrace
    store = open_store(args.store, s3_endpoint=args.s3_endpoint, create=False)
    keys = None if args.insecure else KeyRing(load_identity(args.key), load_public(args.syncer_key))
    events = EventLog(args.log, "learner", args.id)
    calls, marks = [0], {}

    def stop() -> bool:       # called before every step: the CPU of the threads over the steps
        calls[0] += 1
        if calls[0] in (1, args.steps):
            marks[calls[0]] = thread_cpu()
            marks[calls[0]]["agent process"] = sum(process_cpu(c) for c in children())
        return False
    bus = BusConfig(args.ingest, args.announce, counters=BusCounters())
    trace = StepTrace(LearnerConfig.stats_window)
    config = LearnerConfig(keys=keys, step_observer=trace, sync_process=args.sync_process,
                           agent_cpus=parse_cpus(args.agent_cpus) if args.sync_process else None)
    if args.interleave:
        from infra.lab.overhead_interleave import interleaved
        stats = interleaved(store, args.id, bus, events, args.steps, config)
    else:
        stats = learner_process(store, args.id, 0, bus, events, steps=args.steps, stop=stop, config=config)
    events.emit("step-trace", **trace.columns())      # closed with the learner
    first, last = marks.get(1, {}), marks.get(args.steps, {})
    events.emit("thread-cpu", steps=args.steps - 1,
                cpu_s={k: round(v - first.get(k, 0.0), 3) for k, v in sorted(last.items())})
    events.emit("learner-done", **stats)
    return 0 if stats.get("drained") else 4


def main(argv: list[str]) -> int:
    if argv and argv[0] == "learner-ab":
        p = argparse.ArgumentParser(prog="python -m infra.lab.overhead_roles learner-ab")
        for flag in ("--out", "--run"):
            p.add_argument(flag, required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--cpus", default=None)
        p.add_argument("--sync-process", action="store_true")
        a = p.parse_args(argv[1:])
        learner_ab(a.out, a.run, a.steps, parse_cpus(a.cpus), a.sync_process)
        return 0
    if argv and argv[0] == "control":
        p = argparse.ArgumentParser(prog="python -m infra.lab.overhead_roles control")
        p.add_argument("--out", required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--cpus", default=None)
        p.add_argument("--guard", choices=("off", "on", "alternate"), default="off",
                       help="ablation: add the learner's non-finite check (every step, or every odd step)")
        p.add_argument("--neighbour", default=None,
                       help="ablation: pids (comma-separated) run/stopped in alternate blocks")
        p.add_argument("--block", type=int, default=10, help="ablation: steps per --neighbour block")
        p.add_argument("--model-from", default=None, help="a run's store: its model and job (default: the demo's)")
        a = p.parse_args(argv[1:])
        control(a.out, a.steps, a.seed, parse_cpus(a.cpus), guard=a.guard,
                neighbour=[int(x) for x in a.neighbour.split(",")] if a.neighbour else None, block=a.block,
                model_from=a.model_from)
        return 0
    return learner(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
