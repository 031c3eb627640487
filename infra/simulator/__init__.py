"""Goodput simulator and bandwidth model (SPEC §9, §10; docs/simulator.md).

Pure numpy plus one small event loop: ``dists`` (duration laws, incl. the exponentiated Weibull),
``config`` (parameters), ``calibrate`` (the one fitted number: the restart time), ``events``
(vectorised failure traces), ``engine`` (the restart and elastic state machines and the spare
pool), ``systems`` (dp, elastic_dp, decoupled), ``intervals`` (interval algebra), ``speed``
(lock-step straggler efficiency), ``sweep`` (seeds until the CI is tight), ``eventlog`` (the
``--events`` fault schedule), ``validate`` (simulated vs real chaos runs), ``bandwidth``, ``plot``,
``cli``.
"""
from .bandwidth import BandwidthConfig, bandwidth
from .calibrate import calibrate, dp_goodput_analytic, solve_restart_mean
from .config import ModelConfig, SweepConfig
from .dists import Dist, parse_dist
from .eventlog import Event, EventLog, read_event_log, read_events, scale, write_events
from .events import FailureTrace, generate_trace
from .sweep import Row, SweepResult, run_sweep

__all__ = ["BandwidthConfig", "bandwidth", "calibrate", "dp_goodput_analytic", "solve_restart_mean", "Dist",
           "ModelConfig", "SweepConfig", "parse_dist", "Event", "EventLog", "read_event_log", "read_events",
           "scale", "write_events", "FailureTrace", "generate_trace", "Row", "SweepResult", "run_sweep"]
