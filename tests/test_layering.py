"""Layering rules, checked on the source with ``ast`` (README "Layout"; SPEC §7: the log replays
bit for bit). The dependency direction is infra -> workers -> storage -> pipeline; no arrow up.

What is forbidden where, and why:

- **pipeline/** is pure, deterministic math - the syncer's state transition, which replay must
  recompute exactly (docs/replay.md). It imports none of ``FORBIDDEN["pipeline"]``: no sockets,
  clocks, threads, processes, cloud SDKs, ``importlib``, ``uuid``/``secrets``, and no ``os`` at
  all (so neither ``os.environ`` nor ``from os import environ``); it calls no ``open``.
- **storage/** holds the object stores and the run's key layout. It imports no ``workers``,
  ``infra``, ``zmq`` or ``importlib``. It reads no environment variable (``os.environ``,
  ``os.getenv``, ``from os import environ`` ...), except storage/s3.py, and there only literal
  ``AWS_*`` names: the standard AWS configuration chain, which boto3 reads anyway.
- **numpy randomness** in pipeline/ and storage/: only a generator seeded explicitly,
  ``np.random.default_rng(seed)``, and the ``np.random.Generator`` type. Any call on numpy's global
  random state (``np.random.seed``, ``rand``, ``shuffle``...), ``default_rng()`` without a seed,
  and ``from numpy.random import ...`` / ``from numpy import random`` (which hide the calls from
  this check) are refused.
- **workers/** imports no ``infra``, and the syncer's own modules (any workers/ path naming
  ``syncer``) read no environment at all: fault injection is passed in from outside
  (``Syncer(before_commit=...)``, infra/chaos/faulty_syncer.py), never switched on by a variable the
  production syncer reads (issue 12).
- **object keys** come from storage/layout.py only (SPEC §7; docs/storage.md draws the tree): no
  other file of the four packages holds a string (or an f-string) that starts with one of the
  layout's keys or prefixes (``"log/"``, ``f"versions/..."``, ``"run.descriptor"`` ...); docstrings
  may name them.
- **everywhere** (the four packages): a relative import stays inside its own top-level package -
  ``from ..workers import x`` in pipeline/ would climb a layer where the import rules above, which
  read absolute names, do not look - and nothing calls ``__import__``.

``check_tree(root)`` returns the violations of a tree; the tests run it on this repository, and on
temporary copies with one violation planted each, to prove every rule can fail.
"""
from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

import pytest

from storage import layout

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "storage", "workers", "infra")
FORBIDDEN = {
    "pipeline": {"zmq", "boto3", "botocore", "socket", "time", "random", "storage", "workers", "infra",
                 "subprocess", "threading", "asyncio", "datetime", "os", "importlib", "uuid", "secrets"},
    "storage": {"workers", "infra", "zmq", "importlib"},
    "workers": {"infra"},
}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
NO_ENV = ("storage",)                      # packages whose files read no environment ...
SYNCER_MODULES = ("workers", "syncer")     # ... and files under workers/ whose path names the syncer
ENV_ALLOWED = {"storage/s3.py": "AWS_"}    # ... except these files, and only literal names with this prefix
SEEDED_RNG = ("pipeline", "storage")       # packages where numpy randomness must be explicitly seeded
RNG_TYPES = {"Generator"}                  # np.random attributes that may be named without a call
ROLES = ("workers/learner", "workers/syncer", "workers/bus", "workers/common", "workers/job")   # ... never
TOOLS = "workers.tools"                    # ... import the tools: replay, log, export use the roles, not back
LAB = "infra/lab"                          # investigations: not installed, so nothing outside imports them
KEY_OWNER = "storage/layout.py"
KEY_STARTS = tuple(sorted(v for k, v in vars(layout).items()   # DESCRIPTOR_KEY, LOG_PREFIX, ...
                          if k.isupper() and k.endswith(("_KEY", "_PREFIX")) and isinstance(v, str)))


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _climbs(rel: Path, node: ast.ImportFrom) -> bool:
    """Whether a relative import reaches above the top-level package of the file ``rel``."""
    package = rel.parent.parts                 # for pkg/__init__.py too: the package is its folder
    return node.level - 1 >= len(package)


def _import_rules(rel: Path, tree: ast.AST, top: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom):
            if _climbs(rel, node):
                dots = "." * node.level
                out.append((node.lineno, f"relative import climbs out of {top}/: from {dots}{node.module or ''} "
                                         f"(import other layers by their absolute name)"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            out.append((node.lineno, "dynamic import: __import__"))
        for name in names:
            if name.split(".")[0] in FORBIDDEN.get(top, ()):
                out.append((node.lineno, f"imports {name.split('.')[0]} ({top}/ must not)"))
        if rel.as_posix().startswith(tuple(r + "/" for r in ROLES)) and _names(TOOLS, rel, node, names):
            out.append((node.lineno, f"imports {TOOLS} (the roles and what they share never import the tools)"))
        if not rel.as_posix().startswith(LAB + "/") and _names(LAB.replace("/", "."), rel, node, names):
            out.append((node.lineno, f"imports {LAB}/ (lab code is not installed: nothing in the package may)"))
    return out


def _names(package: str, rel: Path, node: ast.AST, names: list[str]) -> bool:
    """Whether an import names the dotted ``package`` (e.g. infra.lab), absolutely or relatively."""
    if any(n == package or n.startswith(package + ".") for n in names):
        return True
    if isinstance(node, ast.ImportFrom) and node.level:
        base = rel.parent.parts[:len(rel.parent.parts) - node.level + 1]
        target = ".".join([*base, *(node.module.split(".") if node.module else [])])
        parent, _, leaf = package.rpartition(".")
        return target == package or target.startswith(package + ".") or (
            target == parent and any(a.name == leaf for a in node.names))
    return False


def _env_rules(rel: Path, tree: ast.AST, parents: dict) -> list[tuple[int, str]]:
    prefix = ENV_ALLOWED.get(rel.as_posix())

    def literal_allowed(node: ast.AST | None) -> bool:
        return prefix is not None and isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and node.value.startswith(prefix)

    def allowed(attr: ast.Attribute) -> bool:
        up = parents.get(attr)
        if attr.attr == "environ" and isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Load):
            return literal_allowed(up.slice)                              # os.environ["AWS_X"]
        if attr.attr == "environ" and isinstance(up, ast.Attribute) and up.attr == "get":
            call = parents.get(up)                                        # os.environ.get("AWS_X", ...)
            return isinstance(call, ast.Call) and call.func is up and bool(call.args) and literal_allowed(call.args[0])
        if attr.attr == "getenv" and isinstance(up, ast.Call) and up.func is attr:
            return bool(up.args) and literal_allowed(up.args[0])          # os.getenv("AWS_X")
        return False

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and node.level == 0:
            bad = [a.name for a in node.names if a.name in ENV_NAMES or a.name == "*"]
            if bad:
                out.append((node.lineno, f"reads the environment: from os import {', '.join(bad)}"))
        elif isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and not allowed(node):
            only = f" (only literal {prefix}* names here)" if prefix else ""
            out.append((node.lineno, f"reads the environment: .{node.attr}{only}"))
    return out


def _rng_rules(tree: ast.AST, parents: dict) -> list[tuple[int, str]]:
    aliases = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "numpy":
                    aliases.add(a.asname or "numpy")
                elif a.name.startswith("numpy.random"):
                    out.append((node.lineno, f"numpy random imported as a module: import {a.name} "
                                             "(use np.random.default_rng(seed))"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (
                (node.module or "").startswith("numpy.random")
                or (node.module == "numpy" and any(a.name in ("random", "*") for a in node.names))):
            out.append((node.lineno, f"numpy random imported by name: from {node.module} import ... "
                                     "(use np.random.default_rng(seed))"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr == "random" and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            continue
        up = parents.get(node)
        name = up.attr if isinstance(up, ast.Attribute) else None
        call = parents.get(up) if name else None
        called = isinstance(call, ast.Call) and call.func is up
        if name == "default_rng" and called and _seeded(call):
            continue
        if name in RNG_TYPES and not called:
            continue
        what = f"np.random.{name}{'()' if called else ''}" if name else "np.random as a value"
        out.append((node.lineno, f"global or unseeded numpy random: {what} (only np.random.default_rng(seed))"))
    return out


def _seeded(call: ast.Call) -> bool:
    seed = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "seed"), None)
    return seed is not None and not (isinstance(seed, ast.Constant) and seed.value is None)


def _key_rules(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = {node.body[0].value for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    out, inside_fstring = [], set()
    for node in ast.walk(tree):      # breadth first: an f-string is met before the constants in it
        if isinstance(node, ast.JoinedStr):
            inside_fstring.update(node.values)
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and str(head.value).startswith(KEY_STARTS):
                out.append((node.lineno, f"builds an object key outside {KEY_OWNER}: f{head.value!r}..."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(KEY_STARTS) \
                and node not in docstrings and node not in inside_fstring:
            out.append((node.lineno, f"names an object key outside {KEY_OWNER}: {node.value!r}"))
    return out


def _file_rules(rel: Path, tree: ast.AST, top: str) -> list[tuple[int, str]]:
    out = []
    if top == "pipeline":
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", "") == "open"
                                               or getattr(node.func, "attr", "") == "open"):
                out.append((node.lineno, "opens a file (pipeline/ reads no files)"))
    return out


def _is_syncer_module(rel_posix: str) -> bool:
    return rel_posix.startswith(SYNCER_MODULES[0] + "/") and SYNCER_MODULES[1] in rel_posix


@functools.lru_cache(maxsize=None)
def _check_file(rel_posix: str, text: str) -> tuple[str, ...]:
    """Violations of one file (cached by path and text: planted copies re-check one file only)."""
    rel = Path(rel_posix)
    top = rel.parts[0]
    tree = ast.parse(text, filename=rel_posix)
    parents = _parents(tree)
    found = _import_rules(rel, tree, top) + _file_rules(rel, tree, top)
    if rel_posix != KEY_OWNER:
        found += _key_rules(tree)
    if top in NO_ENV or _is_syncer_module(rel_posix):
        found += _env_rules(rel, tree, parents)
    if top in SEEDED_RNG:
        found += _rng_rules(tree, parents)
    return tuple(f"{rel_posix}:{line}: {what}" for line, what in sorted(found))


def check_tree(root: Path) -> list[str]:
    """Every violation of the rules above in ``root``'s four packages, as ``path:line: what``."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            out += _check_file(path.relative_to(root).as_posix(), path.read_text())
    return out


def test_the_tree_obeys_the_layering_rules():
    bad = check_tree(ROOT)
    assert not bad, "\n".join(bad)
    # the syncer rule must not pass by finding no syncer (say, after a move into a sub-package)
    assert any(_is_syncer_module(p.relative_to(ROOT).as_posix()) for p in (ROOT / "workers").rglob("*.py"))


# -- every rule can fail: one violation planted in a copy of the tree ------------------------------

def _copy_tree(dst: Path) -> Path:
    for package in PACKAGES:
        for src in (ROOT / package).rglob("*.py"):
            target = dst / src.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
    return dst


PLANTED = [
    # (file in the copy: appended to, or created; planted code; what the single violation says, None: allowed)
    ("pipeline/planted.py", "from os import environ\n", "imports os"),
    ("pipeline/planted.py", "import os\n", "imports os"),
    ("pipeline/planted.py", "import importlib\n", "imports importlib"),
    ("pipeline/planted.py", "from uuid import uuid4\n", "imports uuid"),
    ("pipeline/planted.py", "with open('x') as f:\n    pass\n", "opens a file"),
    ("pipeline/planted.py", "m = __import__('zmq')\n", "__import__"),
    ("storage/planted.py", "from importlib import import_module\n", "imports importlib"),
    ("storage/planted.py", "from os import environ\n", "from os import environ"),
    ("storage/planted.py", "from os import getenv as g\n", "from os import getenv"),
    ("storage/planted.py", "import os\nHOME = os.getenv('HOME')\n", "reads the environment: .getenv"),
    ("storage/planted.py", "import os\nE = os.environ.get('AWS_ENDPOINT_URL')\n", "reads the environment: .environ"),
    ("storage/planted.py", "import os as _o\nE = dict(_o.environ)\n", "reads the environment: .environ"),
    ("storage/s3.py", "\nHOME = os.environ.get('HOME')\n", "only literal AWS_* names"),
    ("storage/s3.py", "\nNAME = 'AWS_REGION'\nR = os.environ[NAME]\n", "only literal AWS_* names"),
    ("storage/s3.py", "\nR = os.environ['AWS_REGION'] + os.getenv('AWS_PROFILE', '')\n", None),
    ("pipeline/planted.py", "import numpy as np\nnp.random.seed(0)\n", "np.random.seed()"),
    ("pipeline/planted.py", "import numpy as np\nR = np.random.default_rng()\n", "np.random.default_rng()"),
    ("pipeline/planted.py", "import numpy as np\nR = np.random.default_rng(seed=None)\n", "np.random.default_rng()"),
    ("pipeline/planted.py", "import numpy\nX = numpy.random.rand(3)\n", "np.random.rand()"),
    ("pipeline/planted.py", "import numpy as np\nr = np.random\n", "np.random as a value"),
    ("pipeline/planted.py", "from numpy.random import default_rng\n", "imported by name"),
    ("pipeline/planted.py", "from numpy import random\n", "imported by name"),
    ("pipeline/planted.py", "import numpy.random\n", "imported as a module"),
    ("storage/planted.py", "import numpy as np\nnp.random.shuffle([1, 2])\n", "np.random.shuffle()"),
    ("pipeline/planted.py", "import numpy as np\nR = np.random.default_rng([7, 1])\nG: np.random.Generator = R\n",
     None),
    ("pipeline/planted.py", "from ..workers import syncer\n", "climbs out of pipeline/"),
    ("storage/planted.py", "from ..pipeline import types\n", "climbs out of storage/"),
    ("infra/chaos/planted.py", "from ...workers import syncer\n", "climbs out of infra/"),
    ("pipeline/__init__.py", "from .. import workers\n", "climbs out of pipeline/"),
    ("infra/chaos/planted.py", "from ..benchmark import main\n", None),
    ("storage/planted.py", "import workers.syncer\n", "imports workers"),
    ("workers/planted.py", "from infra.chaos import runner\n", "imports infra"),
    ("workers/syncer/syncer.py", "\nimport os\nFAULT = os.environ.get('DDILOCO_FAULT', '')\n", "reads the environment"),
    ("workers/syncer/ingest.py", "\nfrom os import getenv\n", "from os import getenv"),
    ("workers/planted.py", "import os\nDEBUG = os.environ.get('DDILOCO_DEBUG')\n", None),
    ("workers/planted.py", "def f(seq):\n    return f'log/{seq:020d}'\n", "builds an object key"),
    ("infra/chaos/planted.py", "def f(store):\n    return store.list('versions/')\n", "names an object key"),
    ("workers/planted.py", "MISSING = 'run.descriptor'\n", "names an object key"),
    ("storage/planted.py", "Q = 'quarantine/' + 'ab'\n", "names an object key"),
    ("workers/planted.py", "def f():\n    '''Reads log/ and versions/.'''\n    return f'{1}/log/'\n", None),
    ("storage/layout.py", "\nEXTRA_KEY = 'hints/extra'\n", None),
    ("infra/planted.py", "from infra.lab.overhead import main\n", "imports infra/lab/"),
    ("infra/planted.py", "from .lab import overhead\n", "imports infra/lab/"),
    ("infra/planted.py", "from . import lab\n", "imports infra/lab/"),
    ("infra/chaos/planted.py", "from ..lab.overhead import main\n", "imports infra/lab/"),
    ("infra/lab/planted.py", "from .overhead import main\nfrom infra.lab import bench_cli\n", None),
    ("workers/syncer/planted.py", "from workers.tools.replay_verify import replay_run\n", "imports workers.tools"),
    ("workers/common/planted.py", "from ..tools import logview\n", "imports workers.tools"),
    ("workers/learner/planted.py", "from .. import tools\n", "imports workers.tools"),
    ("workers/tools/planted.py", "from workers.syncer.gc import configure\nfrom ..common import refold\n", None),
]


@pytest.mark.parametrize("rel, code, expect", PLANTED, ids=[f"{r}:{c.strip()[:40]}" for r, c, _ in PLANTED])
def test_a_planted_violation_is_flagged(tmp_path, rel, code, expect):
    tree = _copy_tree(tmp_path)
    target = tree / rel
    target.write_text((target.read_text() if target.exists() else "") + code)
    bad = check_tree(tree)
    if expect is None:
        assert bad == []
    else:
        assert len(bad) == 1 and bad[0].startswith(rel + ":") and expect in bad[0], bad
