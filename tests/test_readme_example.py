"""Issue 11 item 16: the README's "Your own model without the launcher" example works as written. The test takes the
code block and the syncer command from README.md itself, runs them in a fresh directory (with a
small MyModel and my_batches: 200 steps of 512 tokens), then checks what `ddiloco log` and
`ddiloco replay` say about the run. Old code: the CLI syncer refused the library's unsigned run,
and `ddiloco log` reported 401k tokens merged and 809k dropped for 102k tokens trained."""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from workers import cli

from runhelpers import wait_for

README = Path(__file__).resolve().parent.parent / "README.md"
STEPS, BATCH, WIDTH = 200, 32, 16          # 200 steps x 512 tokens = 102,400 tokens


def example() -> tuple[str, str, str]:
    """(code before the syncer starts, code after, the syncer command line) from the README."""
    section = README.read_text().split("## Your own model without the launcher", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"`(ddiloco syncer [^`]*)`", code).group(1)
    before, after = code.split("learner = Learner(", 1)
    return before, "learner = Learner(" + after, command


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def my_batches():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(WIDTH, 10, generator=g)
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=g)
        time.sleep(0.02)        # a real model's step takes a while; the syncer's rounds follow the clock
        yield x, (x @ w).argmax(dim=1)


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    before, after, command = example()
    assert command.split()[:4] == ["ddiloco", "syncer", "--store", "runs/mine"], command
    monkeypatch.chdir(tmp_path)
    scope = {"MyModel": MyModel, "my_batches": my_batches}
    exec(compile(before, "README.md (Train your own model)", "exec"), scope)
    err = open(tmp_path / "syncer.stderr", "w")
    syncer = subprocess.Popen([sys.executable, "-m", "workers.cli", *shlex.split(command)[1:],
                               "--log", str(tmp_path / "syncer.jsonl")],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        exec(compile(after, "README.md (Train your own model)", "exec"), scope)
        store = scope["store"]
        wait_for(lambda: not store.list("spill/") or syncer.poll() is not None, 60, "the syncer to merge every delta")
        assert syncer.poll() is None, (tmp_path / "syncer.stderr").read_text()
    finally:
        syncer.send_signal(signal.SIGTERM)
        rc = syncer.wait(30)
    stderr = (tmp_path / "syncer.stderr").read_text()
    assert rc == 0 and "Traceback" not in stderr, stderr
    assert "is unsigned" in stderr                    # joined, and said so

    capsys.readouterr()
    assert cli.main(["log", "runs/mine", "--json"]) == 0
    totals = json.loads(capsys.readouterr().out.splitlines()[-1])
    trained = STEPS * BATCH * WIDTH
    assert scope["learner"].tokens == trained
    assert totals["deltas_merged"] > 0
    assert 0.3 * trained < totals["tokens_merged"] <= trained, totals
    assert totals["tokens_dropped"] <= 0.1 * trained, totals
    print(f"trained {trained} tokens; log: {totals['tokens_merged']} merged, {totals['tokens_dropped']} lost, "
          f"{totals['deltas_merged']} deltas merged, {totals['deltas_dropped']} dropped "
          f"({totals['deltas_harmless']} harmless)")
    capsys.readouterr()
    assert cli.main(["replay", "runs/mine"]) == 0, capsys.readouterr().err     # shorter than the retention window
    assert cli.main(["gc", "runs/mine"]) == 0         # a dry run: prints the replay from the oldest kept checkpoint
    replay = re.search(r"`ddiloco (replay [^`]*)`", capsys.readouterr().out)
    if replay:
        assert cli.main(replay.group(1).split()) == 0, capsys.readouterr().err
