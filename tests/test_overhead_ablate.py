"""The overhead ablation tool (infra/lab/overhead_ablate.py) and the control's ablation options
(infra/lab/overhead_roles.py ``control``): what each variant turns on, and which steps are marked as
having it. No timing is asserted here (timing claims live in the benchmark's output)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infra.lab.overhead_ablate import parse_variant
from infra.lab.overhead_roles import control


def test_variant_words():
    assert parse_variant("plain") == {"guard": False, "load": None, "syncer": False, "stack": False}
    assert parse_variant("guard+mem30") == {"guard": True, "load": ("mem", 0.30), "syncer": False, "stack": False}
    assert parse_variant("stack")["stack"]
    assert parse_variant("spin100")["load"] == ("spin", 1.0)
    assert parse_variant("syncer")["syncer"]
    for bad in ("spin0", "spin101", "mem", "gaurd", "torchx"):
        with pytest.raises(ValueError, match="unknown variant word"):
            parse_variant(bad)


def test_control_marks_the_guarded_steps(tmp_path):
    out = tmp_path / "c.json"
    control(str(out), 6, 0, None, guard="alternate")
    res = json.loads(out.read_text())
    assert res["b"] == [0, 1, 0, 1, 0, 1] and len(res["step_times"]) == 6


def test_control_stops_and_resumes_the_neighbour_in_blocks(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "c.json"
        control(str(out), 8, 0, None, neighbour=[sleeper.pid], block=2)
        assert json.loads(out.read_text())["b"] == [0, 0, 1, 1, 0, 0, 1, 1]
        state = open(f"/proc/{sleeper.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        assert state != "T", "the neighbour was left stopped"
    finally:
        sleeper.kill()
        sleeper.wait()
