"""The mutation check's patches (tests/mutants/, docs/faultsim.md "Mutation check") must apply to
the code as it is: a patch whose context went stale makes ``tests/mutants/check.py`` stop on that
mutant, and the evict-unacked pair did, unnoticed, for several commits after the sender changed."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "tests" / "mutants").glob("*.patch"))


def test_there_are_mutants():
    assert len(PATCHES) >= 6, PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_each_mutant_patch_applies_and_marks_its_lines(patch: Path):
    added = [line for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert any("MUTANT" in line for line in added), f"{patch.name}: no added line is marked MUTANT"
    # git apply works outside a repository too (a source tree without .git)
    done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"
