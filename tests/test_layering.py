"""The dependency direction is workers -> storage -> pipeline; infra may use all.

pipeline/ stays pure: no sockets, clocks, randomness, cloud SDKs or environment reads, so the
syncer's state transitions replay bit for bit.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "pipeline": {"zmq", "boto3", "botocore", "socket", "time", "random", "storage", "workers", "infra",
                 "subprocess", "threading", "asyncio", "datetime"},
    "storage": {"workers", "infra", "zmq"},
    "workers": {"infra"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            out.append((node.lineno, "__import__"))
    return out


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package):
    bad = []
    for path in _files(package):
        for lineno, mod in _imports(path):
            if mod in FORBIDDEN[package] or mod == "__import__":
                bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {mod}")
    assert not bad, "\n".join(bad)


def test_pipeline_reads_no_environment():
    bad = []
    for path in _files("pipeline"):
        text = path.read_text()
        for needle in ("os.environ", "getenv", "open(", "import os"):
            if needle in text:
                bad.append(f"{path.relative_to(ROOT)} uses {needle}")
    assert not bad, "\n".join(bad)


def test_layering_check_catches_violations(tmp_path):
    # The checker itself must be able to fail.
    p = tmp_path / "x.py"
    p.write_text("import time\nfrom zmq import Context\nimport os.path\n")
    assert [m for _, m in _imports(p)] == ["time", "zmq", "os"]
