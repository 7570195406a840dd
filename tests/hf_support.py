"""Shared by the Hugging Face and lm-eval tests (test_hf, test_hf_attacks, test_harness,
test_ouro_pipeline): a small trained run directory and a multiple-choice task for lm-eval.
A helper module, not a test file."""
from __future__ import annotations

import json

import torch

from loopscale.artifacts import write_run_files
from loopscale.config import preset
from loopscale.model import LoopedLM


def make_run(path, smoke_data, seed=0, **model):
    """A run directory of an untrained (random, so varied greedy output) smoke model."""
    cfg = preset("smoke", {"model": {"vocab_size": 512, **model}, "data": {"vocab_size": 512}})
    torch.manual_seed(seed)
    lm = LoopedLM(cfg.model).eval()
    with torch.no_grad():  # smaller embeddings: greedy decoding does not just repeat the last token
        lm.tok_emb.weight.mul_(0.3)
    path.mkdir(parents=True)
    write_run_files(path, lm, {"config": cfg.to_dict(), "env": {}, "data": {}},
                    (smoke_data / "tokenizer.json").read_bytes())
    return path


QUESTIONS = [
    {"question": "The Congress of the United", "choices": ["States", "people", "war and peace"], "label": 0},
    {"question": "We the people of the", "choices": ["debts", "United States", "power"], "label": 1},
    {"question": "to pay the", "choices": ["defence", "debts", "taxes, duties"], "label": 1},
]


def write_mc_task(d):
    """QUESTIONS as lm-eval's local multiple-choice task `ls_mc` in folder d (its --include_path)."""
    (d / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (d / "ls_mc.yaml").write_text(f"""task: ls_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
