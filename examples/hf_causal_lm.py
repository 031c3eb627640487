"""A Hugging Face causal LM (a small Llama) trained as decoupled learners, on local text with byte tokens:

    ddiloco launch --learners 2 --eval --out runs/hf -- python examples/hf_causal_lm.py
    ddiloco export runs/hf --latest --format hf -o runs/hf/model    # then LlamaForCausalLM.from_pretrained(...)

Nothing is downloaded: the model is built from a config and the corpus is this Python's own standard
library sources (or the ``*.py``/``*.txt`` files under ``TEXT_DIR``), bytes as tokens (vocabulary 256).
The learner records the model's config, so the run's export is a ``save_pretrained`` directory.
"""
import json
import os
import pathlib
import zlib

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers.evaluator import Evaluator
from workers.learner.learner import Learner

BLOCK, BATCH = 64, 8
CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=BLOCK, tie_word_embeddings=False,
                     architectures=["LlamaForCausalLM"])


def corpus(max_bytes: int = 400_000) -> np.ndarray:
    root = pathlib.Path(os.environ.get("TEXT_DIR") or pathlib.Path(os.__file__).parent)
    files = sorted(p for p in root.glob("*") if p.suffix in (".py", ".txt") and p.is_file())
    data = b"\n".join(p.read_bytes() for p in files)[:max_bytes]
    if len(data) < 10 * BLOCK:
        raise SystemExit(f"{root}: too little text ({len(data)} bytes) for a corpus")
    return np.frombuffer(data, dtype=np.uint8)


def batch(data: np.ndarray, learner_id: str, step: int) -> torch.Tensor:
    """Batch ``step`` of a learner: BATCH windows drawn from a seed of (id, step), its data position."""
    starts = np.random.default_rng(zlib.crc32(f"{learner_id}/{step}".encode())).integers(0, len(data) - BLOCK, BATCH)
    return torch.from_numpy(np.stack([data[s:s + BLOCK] for s in starts]).astype(np.int64))


def main() -> None:
    data = corpus()
    cut = len(data) * 9 // 10            # the last tenth is held out
    torch.manual_seed(os.getpid())       # each learner its own draw: the run starts from one of them
    model = LlamaForCausalLM(CONFIG)
    if os.environ.get("DDILOCO_ROLE") == "evaluator":     # ddiloco launch --eval
        held = torch.cat([batch(data[cut:], "held-out", i) for i in range(4)])
        Evaluator(model).follow(lambda m: m(input_ids=held, labels=held).loss)
        return
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                      model_config={"hf_config": json.loads(CONFIG.to_json_string())}).start()
    for step in learner.range(int(os.environ.get("DDILOCO_STEPS", "300"))):
        x = batch(data[:cut], learner.id, step)
        loss = learner.step(lambda: model(input_ids=x, labels=x).loss, tokens=x.numel())
        if step % 50 == 0:
            print(f"{learner.id} step {step} loss {loss:.3f}", flush=True)
    learner.close()


if __name__ == "__main__":
    main()
