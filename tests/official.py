"""Loading the official release's fixture checkpoints into loopscale (tests only).

`tests/fixtures/official/` holds checkpoints written by the unmodified official trainer
(`Rituraj003/readout-blind-spot`, `src/train_ar_looplm.py`), their validation token stream
and the official evaluation scripts' outputs (see its README.md). `load_official(cond_dir)`
turns one `<cond>/last.pt` into a loopscale `LoopedLM` (with its RunConfig); `official_run`
opens it for the diagnostics on the official validation ids, so the code a test runs is
the one `loopscale eval` runs.

The conversion is `loopscale.convert.load_official`, what `loopscale convert-paper` runs
(no flags: readout, recurrence, damping, gate and tokenizer from the official keys).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from loopscale.config import EvalConfig, RunConfig
from loopscale import convert
from loopscale.evaluate import EvalRun, tokens_run
from loopscale.model import LoopedLM

OFFICIAL = Path(__file__).resolve().parent / "fixtures" / "official"
CHECKPOINTS = sorted(OFFICIAL.glob("*/last.pt"))

# the official evaluation budget (README "Evaluation budget and windows"): the first 32
# non-overlapping validation windows of seq_len 32
N_WINDOWS = 32


def cond_params(oracle: bool = True) -> list:
    """pytest params over every fixture checkpoint directory (`oracle` kept for callers:
    every official option converts, so every checkpoint is compared)."""
    return [pytest.param(p.parent, id=p.parent.name) for p in CHECKPOINTS]


@lru_cache(maxsize=None)
def load_official(cond_dir: Path) -> tuple[LoopedLM, RunConfig]:
    """The fixture checkpoint `<cond_dir>/last.pt` as a loopscale model (fp32, eval mode),
    converted with no flags as `loopscale convert-paper` does."""
    model, cfg, _, _ = convert.load_official(Path(cond_dir) / "last.pt")
    model = model.float()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), cfg


@lru_cache(maxsize=None)
def validation_ids() -> np.ndarray:
    """The official validation stream (`build_dataset()`'s val_ids; the eval scripts' stream)."""
    return np.asarray(json.loads((OFFICIAL / "token_ids" / "validation_ids.json").read_text()), dtype=np.int64)


def official_run(cond_dir: Path, **eval_settings) -> EvalRun:
    """An EvalRun of the converted checkpoint on the official validation ids (the first
    N_WINDOWS windows for every diagnostic unless `eval_settings` say otherwise)."""
    model, cfg = load_official(Path(cond_dir))
    budget = N_WINDOWS * cfg.model.seq_len
    settings = {"batch_size": 8, "norm_tokens": budget, "lemma_tokens": budget, "clamp_tokens": budget,
                "scale_tokens": budget, "device": "cpu", **eval_settings}
    return tokens_run(model, cfg, validation_ids(), EvalConfig.from_dict(settings), "cpu",
                      source=str(Path(cond_dir) / "last.pt"))
