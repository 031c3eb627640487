"""Issue 30: lock-step DiLoCo (``--mode diloco``) sends its replicas' deltas through the run's codec,
as a decoupled learner's blobs go, so the two quality rows carry the same quantisation error. fp32
is the exact round trip; int4 changes the merged model; the run's summary names the codec."""
from __future__ import annotations

import json

import numpy as np

from pipeline.codec import CodecConfig
from workers.common.events import EventLog
from workers.job.job import JobSettings
from workers.job.lockstep import OuterSettings, _through, diloco_baseline
from workers.job.model import GPTConfig

TINY = GPTConfig(n_layer=1, n_embd=16, n_head=2)
JOB = JobSettings(steps=8, batch_size=2, max_bytes=200_000)


def _final(codec: CodecConfig | None) -> float:
    res = diloco_baseline(TINY, JOB, 2, 0, EventLog(None, "diloco", "diloco"),
                          OuterSettings(sync_every=4, codec=codec), eval_every=1000)
    assert res["codec"] == (codec.scheme if codec else "exact")
    return res["final_eval_loss"]


def test_the_deltas_take_the_codecs_round_trip():
    x = np.random.default_rng(0).standard_normal((3, 70)).astype(np.float32)
    assert np.array_equal(_through(x, None), x) and np.array_equal(_through(x, CodecConfig(scheme="fp32")), x)
    q = _through(x, CodecConfig(scheme="int4"))
    assert q.shape == x.shape and not np.array_equal(q, x)
    assert np.abs(q - x).max() <= np.abs(x).max() / 7 + 1e-6        # within one int4 step of the block scale


def test_lock_step_with_int4_differs_from_exact_and_fp32_is_exact():
    exact = _final(None)
    assert _final(CodecConfig(scheme="fp32")) == exact
    assert _final(CodecConfig(scheme="int4")) != exact


def test_ddiloco_run_mode_diloco_records_its_codec(tmp_path):
    from workers import cli
    out = tmp_path / "d"
    assert cli.main(["run", "--mode", "diloco", "--learners", "2", "--steps", "8", "--layers", "1", "--width", "16",
                     "--batch-size", "2", "--sync-every", "4", "--plain", "--out", str(out),
                     "--compression", "int8"]) == 0
    assert json.loads((out / "summary.json").read_text())["settings"]["codec"] == "int8"
