"""The demo job (workers/job/job.py): a small GPT on an offline corpus, the learner process that trains
it, and the in-process baselines. ``from workers.job import learner_process`` keeps working."""
from workers.job.job import (JobSettings, Pace, dp_baseline, job_from, learner_process, make_optimizer,
                             set_lr)

__all__ = ["JobSettings", "Pace", "dp_baseline", "job_from", "learner_process", "make_optimizer", "set_lr"]
