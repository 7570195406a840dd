"""Loading the official release's fixture checkpoints into loopscale (tests only).

`tests/fixtures/official/` holds checkpoints written by the unmodified official trainer
(`Rituraj003/readout-blind-spot`, `src/train_ar_looplm.py`), their validation token stream
and the official evaluation scripts' outputs (see its README.md). `load_official(cond_dir)`
turns one `<cond>/last.pt` into a loopscale `LoopedLM` (with its RunConfig); `official_run`
opens it for the diagnostics on the official validation ids, so the code a test runs is
the one `loopscale eval` runs.

The conversion is `loopscale.convert.load_official`, what `loopscale convert-paper` runs
(no flags: readout, recurrence, damping, gate and tokenizer from the official keys).

Every count, size and budget a test needs is read from the fixture files, never taken from
the visible set's particular numbers: the checkpoints' `config`, `token_ids/`, and
`scripts/commands.sh` (the literal command list that produced the set: which conditions were
trained and with which flags each official evaluation script ran). Another official fixture
set written the same way runs through the tests unchanged: point
LOOPSCALE_OFFICIAL_FIXTURES at its folder (default: tests/fixtures/official).
"""
from __future__ import annotations

import json
import os
import shlex
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from loopscale.config import EvalConfig, RunConfig
from loopscale import convert
from loopscale.evaluate import EvalRun, tokens_run
from loopscale.model import LoopedLM

VISIBLE = Path(__file__).resolve().parent / "fixtures" / "official"  # the copy in this repository
OFFICIAL = Path(os.environ.get("LOOPSCALE_OFFICIAL_FIXTURES") or VISIBLE).resolve()
CHECKPOINTS = sorted(OFFICIAL.glob("*/last.pt"))

# the official scripts that load a fixed DataLoader batch (not a flag): scale_sensitivity.py and
# ar_looplm_analysis.py read `batch_size=32` windows per --max-batches
SCRIPT_BATCH = {"scale_sensitivity": 32, "ar_looplm_analysis": 32}
# the flag that counts the batches of each official evaluation script
BATCHES_FLAG = {"radial_clamp_intervention": "--max-batches", "early_exit_curve": "--max-batches",
                "scale_sensitivity": "--max-batches", "ar_looplm_analysis": "--max-batches",
                "token_norm_stats": "--num-batches", "lemma2_verification": "--num-batches",
                "adaptive_halt_benchmark": "--calib-batches"}


@lru_cache(maxsize=None)
def _commands(root: Path = OFFICIAL) -> tuple:
    """scripts/commands.sh as (script stem, {flag: [values]}) per command, redirections cut."""
    out = []
    for line in (root / "scripts" / "commands.sh").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) < 2 or words[0] != "$PY" or not words[1].endswith(".py"):
            continue
        flags, key = {}, None
        for w in words[2:]:
            if w in (">", "2>&1") or w.startswith(">"):
                break
            if w.startswith("--"):
                key = w
                flags.setdefault(key, [])
            elif key is not None:
                flags[key].append(w)
        out.append((Path(words[1]).stem, flags))
    return tuple(out)


def trained_conditions(root: Path = OFFICIAL) -> list[str]:
    """The conditions the official trainer was run for (train.output_dir=outputs/<cond>)."""
    conds = []
    for script, flags in _commands(root):
        if script == "train_ar_looplm":
            (out_dir,) = [v.split("=", 1)[1] for v in flags["--set"] if v.startswith("train.output_dir=")]
            conds.append(Path(out_dir).name)
    return conds


def script_flags(script: str, cond: str, output: str | None = None) -> dict[str, list[str]]:
    """The flags official `script` ran with for checkpoint `cond` (the one command whose
    --output-dir ends in `output`, where a script ran more than once per checkpoint)."""
    found = [f for s, f in _commands(OFFICIAL) if s == script
             and f["--checkpoint"][0].split("=", 1)[0] == cond
             and (output is None or Path(f["--output-dir"][0]).name == output)]
    assert len(found) == 1, f"scripts/commands.sh: {len(found)} {script} commands for {cond} {output or ''}"
    return found[0]


def flag(script: str, cond: str, name: str, output: str | None = None) -> str:
    (value,) = script_flags(script, cond, output)[name]
    return value


def eval_windows(script: str, cond: str, output: str | None = None) -> int:
    """How many validation windows official `script` evaluated for `cond`: batch size times
    batches, as its command in scripts/commands.sh set them."""
    batch = SCRIPT_BATCH.get(script) or int(flag(script, cond, "--batch-size", output))
    return batch * int(flag(script, cond, BATCHES_FLAG[script], output))


def checkpoint_config(cond_dir: Path) -> dict:
    """The resolved config the official trainer saved in `<cond_dir>/last.pt`."""
    return _raw_config(str(Path(cond_dir) / "last.pt"))


@lru_cache(maxsize=None)
def _raw_config(path: str) -> dict:
    import torch
    return torch.load(path, map_location="cpu", weights_only=True)["config"]


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


def official_budget(cond: str, seq_len: int) -> dict:
    """loopscale's eval settings for the windows and loops each official script used on `cond`."""
    tokens = {key: eval_windows(script, cond) * seq_len for key, script in (
        ("norm_tokens", "token_norm_stats"), ("lemma_tokens", "lemma2_verification"),
        ("clamp_tokens", "radial_clamp_intervention"), ("scale_tokens", "scale_sensitivity"))}
    return {"batch_size": int(flag("radial_clamp_intervention", cond, "--batch-size")),
            "lemma_loops": int(flag("lemma2_verification", cond, "--target-K")), **tokens}


def official_run(cond_dir: Path, **eval_settings) -> EvalRun:
    """An EvalRun of the converted checkpoint on the official validation ids (for every
    diagnostic the windows the official script used, unless `eval_settings` say otherwise)."""
    model, cfg = load_official(Path(cond_dir))
    settings = {**official_budget(Path(cond_dir).name, cfg.model.seq_len), "device": "cpu", **eval_settings}
    return tokens_run(model, cfg, validation_ids(), EvalConfig.from_dict(settings), "cpu",
                      source=str(Path(cond_dir) / "last.pt"))
