"""`python -m infra.lab.overhead --interleave`: sync on / off as an A/B inside one learner process.

Two separate processes running the same loop differ by up to +-4-5% on this machine (the control
alone, 14 processes back to back: medians 11.89-13.21 ms; docs/results-overhead.md "The other steps, taken
apart"), more than the 3% the issue allows, so comparing a control process with a learner process
needs many repeats to say anything. Here one process alternates: even steps are the plain loop
(zero_grad, forward, backward, AdamW: the control's body, *sync off*), odd steps go through
``Learner.step`` with a live syncer and bus (*sync on*: answers, versions applied, the guard and
the bookkeeping). Both share the process, its memory layout and the machine's drift, so their
ratio is free of the process-to-process spread.

What it cannot see: the sync machinery is alive during the plain steps too (the agent and the
syncer on the other core, the learner's reader thread), so a cost that spills over into the next
step (a neighbour's burst, a cache evicted) is charged to both sides; the separate-process
benchmark keeps that in (a real sync stack on the other core cost the plain loop +0.26%, measured
by infra/lab/overhead_ablate.py ``--ab stack``). Both figures go in the docs. The learner's clock is
its own steps: with a plain step between two of them, the syncer's global steps (and rounds) come
at half the rate of all steps, one answer in four learner steps as in the plain benchmark.

Run as ``python -m infra.lab.overhead_roles ... --interleave`` (the traced learner's flags); writes an
``ab-steps`` event: every step's seconds and whether it was a learner step, in order.
"""
from __future__ import annotations

import time


def interleaved(store, learner_id: str, bus, events, steps: int, config) -> dict:
    """``steps`` learner steps with a plain step before each (module docstring); the learner's stats."""
    import torch
    from storage.layout import read_descriptor
    from workers.job.data import Corpus
    from workers.job.job import job_from, make_optimizer, set_lr
    from workers.job.model import GPT
    from workers.learner.learner import Learner
    torch.set_num_threads(1)                     # what learner_process sets
    desc = read_descriptor(store)
    gcfg, job = job_from(desc)
    model = GPT(gcfg)                            # overwritten from storage by start()
    opt = make_optimizer(model, job)
    learner = Learner(model, opt, store, learner_id, config, bus=bus, events=events)
    batches = Corpus(job.data_config(gcfg.block_size)).batches(0, job.shards, desc.seed)
    learner.start()
    took, on = [], []
    for i in range(2 * steps):
        x, y = next(batches)
        set_lr(opt, job, i // 2)
        t0 = time.monotonic()
        if i % 2:
            learner.step(lambda: model(x, y)[1], tokens=x.numel())
        else:                                    # the control's body (infra/lab/overhead_roles.py control)
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            opt.step()
        took.append(time.monotonic() - t0)
        on.append(i % 2)
    drained = learner.close(flush=False)
    events.emit("ab-steps", took_s=[round(t, 7) for t in took], on=on)
    return {"steps": learner.step_count, "tokens": learner.tokens, "drained": drained, **learner.stats()}


def split(ab: dict, trace: dict) -> tuple[dict, dict]:
    """(the learner steps as a step trace, the plain steps as a control's figures): the learner's
    flags (answered, applied, gcs) come from its trace, both kinds' times from the ``ab-steps``
    event (one clock around either kind of step)."""
    mine = [t for t, o in zip(ab["took_s"], ab["on"]) if o]
    plain = [t for t, o in zip(ab["took_s"], ab["on"]) if not o]
    if len(mine) != len(trace["took_s"]):
        raise ValueError(f"ab-steps has {len(mine)} learner steps, the step trace {len(trace['took_s'])}")
    return {**trace, "took_s": mine}, {"step_times": plain, "gcs": [0] * len(plain)}
