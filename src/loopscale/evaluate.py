"""Evaluation plumbing shared by training, the diagnostics and halting.

`exit_losses` is the teacher-forced evaluation (validation during training, the depth
evaluation); `open_run` opens a trained model with its data for the diagnostics, which
read batches of its validation windows (`windows`, `batches`) and put `header` on top of
every result file. Windows are non-overlapping (seq_len+1 tokens stepping by seq_len, so
every target token is scored once), the model runs in fp32 with dropout off.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from . import data as D
from .artifacts import load, read_record
from .config import EvalConfig, RunConfig, load_eval_config
from .io import CheckpointError
from .linear_ce import linear_cross_entropy
from .model import LoopedLM
from .objective import mean_token_norm
from .runtime import ppl, resolve_device


def depth_ce(model: LoopedLM, x: torch.Tensor, y: torch.Tensor, k: int, fwd=None) -> torch.Tensor:
    """CE of the final readout after exactly k loops: what evaluation at depth k runs (the
    throughput diagnostic and the benchmark time this). `fwd`: the model or its compiled wrapper."""
    h = (fwd or model)(x, n_loops=k)[-1]
    return linear_cross_entropy(model.readout(h, final=True), model.head_weight, y)


@torch.no_grad()
def exit_losses(model: LoopedLM, tokens, batch_size: int, max_tokens: int = 0,
                n_loops: int | None = None, device: torch.device | str = "cpu",
                final_readout_only: bool = False) -> dict:
    """CE of every exit k = 1..n_loops of one pass (exit n_loops uses the final readout).

    With `final_readout_only`, every exit k is read as if the pass had stopped there (the
    truncated/extended depth evaluation: final readout at every k). Returns mean CE, PPL and
    mean per-token ‖H_k‖ per exit, plus the number of scored tokens."""
    was_training = model.training
    model.eval()
    seq = model.cfg.seq_len
    n_loops = model.cfg.n_loops if n_loops is None else n_loops
    starts = D.eval_window_starts(len(tokens), seq, max_tokens)
    ce_sum, norm_sum = (torch.zeros(n_loops, dtype=torch.float64) for _ in range(2))
    n_tok = 0
    try:
        for i in range(0, len(starts), batch_size):
            x, y = D.get_batch(tokens, starts[i:i + batch_size], seq)
            x, y = x.to(device), y.to(device)
            states = model(x, n_loops=n_loops)
            m = y.numel()
            for k, h in enumerate(states):
                final = final_readout_only or k == n_loops - 1
                ce = linear_cross_entropy(model.readout(h, final, k=k + 1), model.head_weight, y)
                ce_sum[k] += ce.double().cpu() * m
                norm_sum[k] += mean_token_norm(h).double().cpu() * m
            n_tok += m
    finally:
        model.train(was_training)
    ce = (ce_sum / max(n_tok, 1)).tolist()
    return {"tokens": n_tok, "ce": ce, "ppl": [ppl(c) for c in ce],
            "norm": (norm_sum / max(n_tok, 1)).tolist()}


# ---------------------------------------------------------------------------
# one run, opened for evaluation
# ---------------------------------------------------------------------------
@dataclass
class EvalRun:
    """A trained model with everything a diagnostic needs."""
    model: LoopedLM
    cfg: RunConfig  # the run's training config (from the checkpoint)
    ecfg: EvalConfig  # the evaluation settings
    tokens: Optional[np.ndarray]  # validation split (None for a diverged model)
    device: torch.device
    step: Optional[int]
    status: str  # "ok" | "diverged"
    model_path: Path
    data_dir: Path
    progress: bool = True

    @property
    def K(self) -> int:
        return self.cfg.model.n_loops

    @property
    def seq_len(self) -> int:
        return self.cfg.model.seq_len


def check_data_matches(cfg: RunConfig, meta: dict, model_path, data_dir, recorded: Optional[dict] = None) -> None:
    """Refuse a data directory that is not the one the run was trained on (one-line error).

    `recorded`: the data record inside the checkpoint (train.py writes it); without one, the
    run record beside the model file (artifacts.read_record)."""
    trained_on = recorded
    if not trained_on:
        with contextlib.suppress(CheckpointError):
            trained_on = read_record(Path(model_path).parent)[0].get("data")
    here = meta.get("vocab_size")
    ours = (trained_on or {}).get("vocab_size")
    if ours is None or here is None:  # no record of the run's data: compare the settings
        ours = cfg.data.vocab_size
        here = (meta.get("data_config") or {}).get("vocab_size", here)
    if here is not None and ours is not None and int(here) != int(ours):
        raise CheckpointError(f"checkpoint {model_path} was trained on vocabulary {ours} but data dir {data_dir} "
                              f"has {here}: evaluate with the run's own data")
    if meta.get("vocab_size") is not None and int(meta["vocab_size"]) > cfg.model.vocab_size:
        raise CheckpointError(f"checkpoint {model_path} has an embedding for {cfg.model.vocab_size} tokens but data dir "
                              f"{data_dir} uses {meta['vocab_size']}: evaluate with the run's own data")
    if meta.get("tokenizer") and meta["tokenizer"] != cfg.data.tokenizer:
        raise CheckpointError(f"checkpoint {model_path} was trained with the {cfg.data.tokenizer} tokenizer but data dir "
                              f"{data_dir} uses {meta['tokenizer']}: evaluate with the run's own data")
    a, b = (trained_on or {}).get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if a and b and a != b:
        raise CheckpointError(f"checkpoint {model_path} was trained with another tokenizer than data dir "
                              f"{data_dir} (tokenizer_sha256 {a[:12]} vs {b[:12]}): evaluate with the run's own data")


def open_run(model_path, data_dir, overrides: Optional[list[str]] = None, device: Optional[str] = None,
             progress: bool = True, eval_config: Optional[EvalConfig] = None) -> EvalRun:
    """Load a model file and the validation split of its data dir for evaluation, with the
    evaluation settings `eval_config` (default: EvalConfig()) + `--set eval.KEY=VALUE` overrides.

    Raises CheckpointError (missing/corrupt model file, data of another run), DataError
    (missing data, a validation split shorter than one window) or ConfigError (bad override)."""
    ecfg = load_eval_config(overrides=overrides, base=eval_config) if overrides else (eval_config or EvalConfig())
    model_path, data_dir = Path(model_path), Path(data_dir)
    if not model_path.is_file():  # before touching the device
        raise CheckpointError(f"checkpoint {model_path} not found; train the run first (loopscale train)")
    model, _, cfg = got = load(model_path)
    ckpt = got.checkpoint
    dev = resolve_device(device or ecfg.device)
    meta = D.load_meta(data_dir)
    check_data_matches(cfg, meta, model_path, data_dir, ckpt.get("data"))
    status = "diverged" if ckpt.get("status") == "diverged" else "ok"
    tokens = None
    if status == "ok":
        tokens = D.load_split(data_dir, "validation")
        if len(tokens) < cfg.model.seq_len + 1:
            raise D.DataError(f"the validation split of {data_dir} has {len(tokens)} tokens, fewer than one "
                              f"window of seq_len+1 = {cfg.model.seq_len + 1} of checkpoint {model_path}")
    model = model.to(dev).float().eval().requires_grad_(False)
    return EvalRun(model=model, cfg=cfg, ecfg=ecfg, tokens=tokens, device=dev, step=ckpt.get("step"),
                   status=status, model_path=model_path, data_dir=data_dir, progress=progress)


def tokens_run(model: LoopedLM, cfg: RunConfig, tokens, eval_config: Optional[EvalConfig] = None,
               device: str | torch.device = "cpu", source: str = "tokens", progress: bool = False) -> EvalRun:
    """An EvalRun of a model already in memory on a validation token stream given directly
    (e.g. the official release's validation ids): what `open_run` builds from files, for the
    same diagnostics. `source` names where the model and tokens came from (result headers)."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if len(tokens) < cfg.model.seq_len + 1:
        raise D.DataError(f"{source}: {len(tokens)} tokens, fewer than one window of seq_len+1 = "
                          f"{cfg.model.seq_len + 1}")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= cfg.model.vocab_size):
        raise D.DataError(f"{source}: token ids must lie in [0, {cfg.model.vocab_size}) (the model's vocabulary), "
                          f"got {int(tokens.min())}..{int(tokens.max())}")
    dev = resolve_device(str(device))
    model = model.to(dev).float().eval().requires_grad_(False)
    return EvalRun(model=model, cfg=cfg, ecfg=eval_config or EvalConfig(), tokens=tokens, device=dev, step=None,
                   status="ok", model_path=Path(source), data_dir=Path(source), progress=progress)


def header(name: str, run: EvalRun, tokens: int = 0) -> dict:
    """Top-level keys shared by every result file."""
    m, o = run.cfg.model, run.cfg.objective
    return {
        "diagnostic": name,
        "status": run.status,
        "model_step": run.step,
        "condition": {"readout": m.readout, "loss": o.loss, "regularizer": o.regularizer,
                      "recurrence": m.recurrence, "n_loops": m.n_loops, "d_model": m.d_model,
                      "n_layers": m.n_layers},
        "seed": run.cfg.train.seed,
        "tokens": int(tokens),
        "device": str(run.device),
        "threads": torch.get_num_threads(),
        "model": str(run.model_path),
        "data": str(run.data_dir),
        "eval": dataclasses.asdict(run.ecfg),
    }


# ---------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------
def windows(run: EvalRun, max_tokens: int) -> np.ndarray:
    """Start offsets of the non-overlapping validation windows holding `max_tokens` targets (0: all)."""
    return D.eval_window_starts(len(run.tokens), run.seq_len, max_tokens)


def batches(run: EvalRun, starts: np.ndarray, desc: str = "") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) batches of `eval.batch_size` windows on the run's device, with a progress bar."""
    bs = run.ecfg.batch_size
    for i in tqdm(range(0, len(starts), bs), desc=desc, disable=not run.progress, leave=False,
                  mininterval=1.0, dynamic_ncols=True):
        x, y = D.get_batch(run.tokens, starts[i:i + bs], run.seq_len)
        yield x.to(run.device), y.to(run.device)
