"""Goodput simulator and bandwidth model (SPEC §9, §10; docs/simulator.md).

Pure numpy: ``config`` (parameters), ``calibrate`` (the one fitted number), ``events`` (vectorised
failure traces), ``intervals`` (interval algebra), ``systems`` (dp, elastic_dp, decoupled),
``speed`` (lock-step straggler efficiency), ``sweep`` (seeds until the CI is tight), ``eventlog``
(the ``--events`` fault schedule), ``bandwidth``, ``plot``, ``cli``.
"""
from .bandwidth import BandwidthConfig, bandwidth
from .calibrate import calibrate, dp_goodput_analytic, solve_repair_mean
from .config import Dist, ModelConfig, SweepConfig, parse_dist
from .eventlog import Event, EventLog, read_event_log, read_events, scale, write_events
from .events import FailureTrace, generate_trace
from .sweep import Row, SweepResult, run_sweep

__all__ = ["BandwidthConfig", "bandwidth", "calibrate", "dp_goodput_analytic", "solve_repair_mean", "Dist",
           "ModelConfig", "SweepConfig", "parse_dist", "Event", "EventLog", "read_event_log", "read_events",
           "scale", "write_events", "FailureTrace", "generate_trace", "Row", "SweepResult", "run_sweep"]
