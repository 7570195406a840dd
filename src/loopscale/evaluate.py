"""Teacher-forced evaluation shared by training and the depth evaluation.

Windows are non-overlapping (seq_len+1 tokens stepping by seq_len, so every target token
is scored once), the model runs in fp32 with dropout off.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import data as D
from .config import RunConfig
from .io import CheckpointError, load_checkpoint
from .model import LoopedLM
from .linear_ce import linear_cross_entropy
from .objective import mean_token_norm
from .runtime import ppl


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
    ce_sum = torch.zeros(n_loops, dtype=torch.float64)
    norm_sum = torch.zeros(n_loops, dtype=torch.float64)
    n_tok = 0
    try:
        for i in range(0, len(starts), batch_size):
            x, y = D.get_batch(tokens, starts[i:i + batch_size], seq)
            x, y = x.to(device), y.to(device)
            states = model(x, n_loops=n_loops)
            m = y.numel()
            for k, h in enumerate(states):
                final = final_readout_only or k == n_loops - 1
                ce = linear_cross_entropy(model.readout(h, final), model.head_weight, y)
                ce_sum[k] += ce.double().cpu() * m
                norm_sum[k] += mean_token_norm(h).double().cpu() * m
            n_tok += m
    finally:
        model.train(was_training)
    ce = (ce_sum / max(n_tok, 1)).tolist()
    return {"tokens": n_tok, "ce": ce, "ppl": [ppl(c) for c in ce],
            "norm": (norm_sum / max(n_tok, 1)).tolist()}


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[LoopedLM, RunConfig, dict]:
    """Load a trained model (`model.pt` or a training `state.pt`) with its resolved config."""
    ckpt = load_checkpoint(path, map_location=device)
    try:
        cfg = RunConfig.from_dict(ckpt["config"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} carries an invalid config: {e}") from None
    model = LoopedLM(cfg.model)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not match its config's model shape: "
                              f"{str(e).splitlines()[0][:200]}") from None
    return model.to(device).eval(), cfg, ckpt
