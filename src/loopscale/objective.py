"""Training objective: per-exit cross-entropy, the loss choice and the norm penalty.

  terminal      L = CE(logits_K)
  per_loop      L = (1/K) Σ_k CE(logits_k)
  norm_penalty  L += λ · (1/K) Σ_k mean_{batch,pos,channel}(H_k²)   (all K loops, before any norm)
  exit_gate     (Ouro only) L = mean_tokens[Σ_k p_k·CE_k − β·H(p)] in place of the CE above,
                p the exit distribution of the model's early_exit_gate

logits_k = W_emb · r(H_k) (the tied head on exit k's readout); each CE goes through
`linear_ce.linear_cross_entropy`, which never builds a full [tokens, vocab] logit tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ObjectiveConfig
from .linear_ce import linear_cross_entropy


@dataclass
class LossOutput:
    total: torch.Tensor  # scalar the optimiser sees
    ce: torch.Tensor  # [n_loops] cross-entropy of every exit (detached, fp32)
    norms: torch.Tensor  # [n_loops] mean over tokens of the per-token L2 norm of H_k (detached, fp32)
    penalty: torch.Tensor  # unweighted norm penalty mean_k mean(H_k²) (detached, fp32)


def mean_token_norm(h: torch.Tensor) -> torch.Tensor:
    """‖H‖ as reported: mean over tokens of the per-token L2 norm over channels (fp32)."""
    return h.detach().float().norm(dim=-1).mean()


def compute_loss(model, states: list[torch.Tensor], targets: torch.Tensor, obj: ObjectiveConfig,
                 all_exits: bool = True) -> LossOutput:
    """Loss of one forward pass. `states` are [H_1..H_K] from `model(idx)`.

    With `all_exits`, exits outside the loss (terminal CE) are still measured, without grad,
    so every step can log the CE of every loop. No host synchronisation happens here."""
    K = len(states)
    ces, in_loss = [], []
    for k, h in enumerate(states):
        final = k == K - 1
        counts = obj.loss == "per_loop" or final
        if not counts and not all_exits:
            ces.append(torch.full((), float("nan"), device=h.device))
            continue
        with torch.set_grad_enabled(counts and torch.is_grad_enabled()):
            ce = linear_cross_entropy(model.readout(h, final, k=k + 1), model.head_weight, targets,
                                      obj.ce_impl, obj.ce_chunk_tokens)
        ces.append(ce)
        if counts:
            in_loss.append(ce)
    total = torch.stack(in_loss).mean()
    if obj.exit_gate:  # the Ouro track: its entropy-regularised expected loss over the exit steps
        total = exit_gate_loss(model, states, targets, obj.exit_beta)
    penalty = torch.stack([h.float().pow(2).mean() for h in states]).mean()
    if obj.regularizer == "norm_penalty":
        total = total + obj.penalty_weight * penalty
    return LossOutput(total=total, ce=torch.stack([c.detach().float() for c in ces]),
                      norms=torch.stack([mean_token_norm(h) for h in states]), penalty=penalty.detach())


def exit_gate_loss(model, states: list[torch.Tensor], targets: torch.Tensor, beta: float) -> torch.Tensor:
    """Σ_k p_k·CE_k − β·H(p) per token, averaged (loopscale.ouro.exit_loss), p the exit
    distribution of the model's gate (`exit_distribution`). Builds each exit's logits."""
    from .ouro import exit_loss
    K = len(states)
    pdf = model.exit_distribution(states)
    ce = torch.stack([F.cross_entropy(model.logits(h, k == K - 1, k=k + 1).float().flatten(0, -2),
                                      targets.reshape(-1), reduction="none") for k, h in enumerate(states)], dim=-1)
    return exit_loss(ce.view(pdf.shape), pdf, beta)
