"""The mutation check of issue 25 (docs/faultsim.md "Mutation check"): reintroduce each fixed defect
one at a time and show that the simulated fault campaign catches it.

    .venv/bin/python tests/mutants/check.py [--runs 200] [--jobs 2] [NAME ...]

A mutant is either a patch in this folder (``NAME.patch``: the defect put back into the code, each
changed line marked ``MUTANT``), applied to a scratch git worktree of HEAD, or an old decision rule
the descriptor can still name (``RULES``: runs written before issue 25 replay by them), run with
``--rules``. For each it runs seeds 0.. of ``ddiloco chaos campaign --sim`` and prints how many
seeds it took to catch it (the first failing seed + 1), how many of them failed, and which checks
broke. Exit status 0 when every mutant was caught, 1 otherwise. Not part of the test command: a
mutant needs 1-3 minutes per 200 seeds on two cores.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Defects whose old rule the code keeps for old runs' replay (world.py ``marks``, ``guard_version``).
RULES = {
    "overtaken-as-duplicate": "marks=1",      # one high-water mark per learner: an overtaken answer "duplicate"
    "outlier-on-totals": "guard_version=2",   # the norm guard on whole-delta norms, not per step
}


def mutants() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.patch")) + sorted(RULES)


def run_campaign(cwd: Path, runs: int, jobs: int, out: Path, rules: str | None) -> dict:
    cmd = [sys.executable, "-m", "workers.cli", "chaos", "campaign", "--sim", "--seed", "0", "--runs", str(runs),
           "--jobs", str(jobs), "--out", str(out)] + (["--rules", rules] if rules else [])
    subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=False)
    return json.loads((out / "campaign.json").read_text())


def scratch_tree(name: str, base: Path) -> Path:
    """A worktree of HEAD with ``name``'s patch applied (and the built C kernels copied in)."""
    tree = base / name
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), "HEAD"], cwd=ROOT, check=True)
    subprocess.run(["git", "apply", str(HERE / f"{name}.patch")], cwd=tree, check=True)
    for so in (ROOT / "pipeline").glob("_ckernels*.so"):
        shutil.copy2(so, tree / "pipeline" / so.name)
    probe = subprocess.run([sys.executable, "-c", "import pipeline, workers; print(pipeline.__file__)"], cwd=tree,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not probe.startswith(str(tree)):
        raise SystemExit(f"mutant {name}: the scratch tree's modules are not the ones imported ({probe})")
    return tree


def check(name: str, runs: int, jobs: int, base: Path) -> dict:
    rules = RULES.get(name)
    cwd = ROOT if rules else scratch_tree(name, base)
    try:
        report = run_campaign(cwd, runs, jobs, base / f"{name}-out", rules)
    finally:
        if not rules:
            subprocess.run(["git", "worktree", "remove", "--force", str(cwd)], cwd=ROOT, check=False)
    failed = [r for r in report["results"] if not r["ok"]]
    checks = Counter(f.split(":")[0] for r in failed for f in r["failed"])
    return {"mutant": name, "runs": runs, "caught": bool(failed),
            "seeds_to_catch": failed[0]["seed"] + 1 if failed else None, "failed_seeds": len(failed),
            "checks": dict(checks.most_common()), "first": failed[0]["replay"] if failed else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"mutants to check (default: all of {', '.join(mutants())})")
    ap.add_argument("--runs", type=int, default=200, help="seeds per mutant (0..runs-1)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.names) - set(mutants()))
    if unknown:
        ap.error(f"no mutant {', '.join(unknown)} (known: {', '.join(mutants())})")
    if args.runs < 1 or args.jobs < 1:
        ap.error("--runs and --jobs must be >= 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-mutants-") as tmp:
        for name in args.names or mutants():
            r = check(name, args.runs, args.jobs, Path(tmp))
            results.append(r)
            verdict = (f"caught after {r['seeds_to_catch']} seed(s); {r['failed_seeds']} of {r['runs']} failed: "
                       f"{r['checks']}") if r["caught"] else f"NOT caught in {r['runs']} seeds"
            print(f"{name}: {verdict}", flush=True)
            if r["first"]:
                print(f"    first: {r['first']}" + (f" --rules {RULES[name]}" if name in RULES and
                                                     "--rules" not in r["first"] else ""), flush=True)
    print(json.dumps(results, indent=1))
    return 0 if all(r["caught"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
