"""The processes of a run: learner, syncer, ZeroMQ bus, CLI, replay and inspection tools."""
