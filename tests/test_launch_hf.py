"""Issue 28: the Hugging Face example under `ddiloco launch` - a Llama-style causal LM built from a config,
byte tokens, local text. It trains (held-out loss down), replays, and its `--format hf` export loads with
`from_pretrained` into a model whose held-out loss is the evaluator's last figure."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from storage.log import CommitLog
from storage.store import open_store
from tests.test_launch import DEADLINE_S, _env, _events, _launch_cmd, _replay

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_causal_lm.py"


def test_the_hugging_face_example_trains_replays_and_exports_for_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM
    out = tmp_path / "hf"
    done = subprocess.run(_launch_cmd(out, EXAMPLE, 120, "--eval"), capture_output=True, text=True, env=_env(),
                          timeout=DEADLINE_S * 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.0, summary
    _replay(out)
    model_dir = tmp_path / "model"
    exported = subprocess.run([sys.executable, "-m", "workers.cli", "export", str(out), "--latest", "--format", "hf",
                               "-o", str(model_dir)], capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "model.safetensors"]
    model = LlamaForCausalLM.from_pretrained(model_dir)
    last = [e for e in _events(out, "evaluator") if e.get("event") == "eval"][-1]
    assert last["seq"] == CommitLog(open_store(str(out / "store"), create=False)).tail()   # the final model
    spec = importlib.util.spec_from_file_location("hf_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = example.corpus()
    held = torch.cat([example.batch(data[len(data) * 9 // 10:], "held-out", i) for i in range(4)])
    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=held, labels=held).loss)
    assert abs(loss - last["loss"]) < 1e-4, (loss, last["loss"])


def test_an_hf_export_of_a_run_without_a_hugging_face_config_says_so(tmp_path):
    from tests.test_evaluator import _run
    _run(tmp_path)
    done = subprocess.run([sys.executable, "-m", "workers.cli", "export", str(tmp_path / "run"), "--latest", "--format",
                           "hf", "-o", str(tmp_path / "m")], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode != 0 and "records no Hugging Face config" in done.stderr
    assert not (tmp_path / "m").exists()
