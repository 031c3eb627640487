"""The processes of a run (SPEC §3-§7), grouped by role:

- ``workers.learner``  the learner: training replica, sender, receiver, non-finite guard
- ``workers.syncer``   the syncer: ingest, rounds, commits, recovery, replication, retention
- ``workers.bus``      the ZeroMQ fast path, key files and signatures
- ``workers.common``   delta/version reading, event logs, metrics
- ``workers.job``      the demo job (model, data, learner process, lock-step baselines)
- ``workers.tools``    replay, log, export, report, bench
- top level: ``cli`` / ``commands`` (the ``ddiloco`` command), ``launch`` (creating a run),
  ``cluster`` (the local orchestrator) and ``run`` (``ddiloco run``).
"""
