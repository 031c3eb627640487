"""The learner role (SPEC §3): the training replica, its background sender and receiver, and the
non-finite guard. ``from workers.learner import Learner, LearnerConfig`` keeps working; it is
loaded on first use, so that the learner's sync agent (workers/learner/agent_main.py, a process
without torch) does not import torch through this package."""

__all__ = ["Learner", "LearnerConfig"]


def __getattr__(name: str):
    if name in __all__:
        from workers.learner import learner
        return getattr(learner, name)
    raise AttributeError(f"module 'workers.learner' has no attribute {name!r}")
