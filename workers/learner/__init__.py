"""The learner role (SPEC §3): the training replica, its background sender and receiver, and the
non-finite guard. ``from workers.learner import Learner, LearnerConfig`` keeps working."""
from workers.learner.learner import Learner, LearnerConfig

__all__ = ["Learner", "LearnerConfig"]
