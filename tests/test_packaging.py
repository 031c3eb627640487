"""Packaging: the package declares ranges, the exact CPU build lives in constraints.txt, and CI runs
exactly the README's test command (the project's contract, README "Quickstart")."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _install_requires() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [line.strip() for line in cfg["options"]["install_requires"].splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_the_package_declares_ranges_and_constraints_pin_the_cpu_torch():
    exact = [req for req in _install_requires() if "==" in req]
    assert not exact, f"setup.cfg pins {exact}: declare a range, pin in constraints.txt"
    torch = [req for req in _install_requires() if re.match(r"torch\b", req)]
    assert torch and ">=" in torch[0], torch
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert "torch==2.13.0" in pins, pins


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Set up and run the test suite:", 1)[1].split("```", 2)[1].strip()
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines()
          if line and not line.startswith("#")]
    assert ci[-1] == block, (ci[-1], block)
    assert "-c constraints.txt" in block


def test_the_installed_package_holds_no_lab_code():
    import setuptools
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    find = cfg["options.packages.find"]
    lines = lambda key: [x.strip() for x in find.get(key, "").splitlines() if x.strip()]   # noqa: E731
    packages = setuptools.find_packages(str(ROOT), include=lines("include"), exclude=lines("exclude"))
    assert "infra" in packages and "workers.tools" in packages
    assert not [p for p in packages if p == "infra.lab" or p.startswith("infra.lab.")], packages
    assert (ROOT / "infra" / "lab" / "__init__.py").exists()      # the lab is there, in the checkout only
