"""Placement as data (workers/common/placement.py): learner m in region m mod N and on shard m, read
back from a summary; an id's digits are read in one place only."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from workers.common.placement import Placement, default_shard, learner_names

ROOT = Path(__file__).resolve().parent.parent


def test_round_robin_places_learners_over_the_regions_and_reads_back_from_a_summary():
    p = Placement.round_robin(learner_names(5), ["r0", "r1"])
    assert [p.region(lid) for lid in learner_names(5)] == ["r0", "r1", "r0", "r1", "r0"]
    assert [p.shard(lid) for lid in learner_names(5)] == [0, 1, 2, 3, 4]
    assert p.in_region("r1") == ["l1", "l3"]
    assert Placement.from_dict(p.to_dict()) == p
    alone = Placement.round_robin(["a", "b"])
    assert alone.region("b") is None and alone.shard("b") == 1
    with pytest.raises(KeyError, match="learner 'l9' is not placed"):
        p.region("l9")


def test_an_id_without_a_shard_takes_its_number():
    assert default_shard("l12") == 12 and default_shard("worker") == 0


def test_no_other_module_parses_the_digits_of_a_learner_id():
    found = []
    for package in ("workers", "infra", "storage"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "placement.py" or "lab" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "isdigit" and "c.isdigit" in ast.unparse(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
