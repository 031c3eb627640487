"""`ddiloco run`'s one config tree (workers/config.py, workers/run_config.py): the flags of earlier
releases make the same descriptors as before the tree (goldens made by the flat-settings code),
``--print-config`` round-trips through ``--config``, and bad files fail naming the key."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

import pytest

from workers import config
from workers.cli import main
from workers.run_config import ALIASES, SKIP, RunConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
_spec = importlib.util.spec_from_file_location("goldens", FIXTURES / "make_run_config_goldens.py")
goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goldens)
GOLDEN = json.loads((FIXTURES / "run_config_goldens.json").read_text())


def _plain(doc: dict) -> dict:
    return json.loads(json.dumps(doc, sort_keys=True, default=str))


@pytest.mark.parametrize("name", sorted(goldens.CASES))
def test_the_flags_of_earlier_releases_make_the_same_descriptor_as_before_the_tree(name):
    got = _plain(goldens.describe(goldens.CASES[name]))
    assert got == GOLDEN[name]


def _print_config(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(["run", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_print_config_round_trips_through_config_and_makes_the_same_run(tmp_path, capsys):
    argv = GOLDEN["outer-and-grace"]["argv"] + ["--learners", "3", "--policy.cap_s", "0.5", "--guard.cap", "none"]
    text = _print_config(argv, capsys)
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert _print_config(["--config", str(path)], capsys) == text
    from_file = _plain(goldens.describe(["--config", str(path)]))
    from_flags = _plain(goldens.describe(argv))
    assert {**from_file, "argv": None} == {**from_flags, "argv": None}
    assert from_file["descriptor"]["policy"]["cap_s"] == 0.5 and from_file["descriptor"]["guard"]["cap"] is None


def test_a_flag_overrides_the_file_and_the_file_overrides_the_default(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[policy]\nquorum = 2\n[run]\nlearners = 3\n[codec]\nscheme = "int8"\n')
    text = _print_config(["--config", str(path), "--compression", "bf16"], capsys)
    assert 'quorum = 2' in text and 'learners = 3' in text and 'scheme = "bf16"' in text


@pytest.mark.parametrize("body, message", [
    ("[policy]\nquorom = 2\n", r"unknown key 'policy.quorom' \(\[policy\] has: quorum, overlap, gamma, cap_s\)"),
    ("[polcy]\nquorum = 2\n", r"unknown section \[polcy\]"),
    ('[policy]\nquorum = "2"\n', r"policy.quorum must be int, got str '2'"),
    ("[guard]\nenabled = 1\n", r"guard.enabled must be bool, got int 1"),
    ("[schedule]\nfragments = 4\nsync_every = 2\n", r"\[schedule\] \(.*run.toml\): sync_every \(H=2\) must be >= "),
    ("[run]\nlearners = 2\n[policy]\nquorum = 3\n", r"quorum K=3 exceeds the 2 learner\(s\)"),
    ("[policy\n", r"not valid TOML"),
])
def test_a_bad_config_file_fails_naming_the_file_and_the_key(tmp_path, capsys, body, message):
    path = tmp_path / "run.toml"
    path.write_text(body)
    assert main(["run", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err or "exceeds" in err, err
    assert re.search(message, err), err


def test_a_bad_flag_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--policy.quorum", "two", "--print-config"])
    assert "argument --policy.quorum/--quorum: expected int, got 'two'" in capsys.readouterr().err


def test_every_knob_has_a_flag_and_every_alias_sets_a_knob():
    parser = argparse.ArgumentParser()
    found = config.add_flags(parser, RunConfig, skip=SKIP, aliases=ALIASES)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {k.flag for k in found} <= flags
    assert {a.flag for a in ALIASES} <= flags
    keys = {k.key for k in found}
    assert not [a for a in ALIASES if a.key not in keys]
    # derived fields are not knobs: setting them would be overwritten by the derivation
    assert not set(SKIP) & keys
    defaults = RunConfig()
    assert all(getattr(getattr(defaults, k.section), k.name) == k.default for k in found)
