"""Training objective: per-exit cross-entropy, the loss choice and the norm penalty.

  terminal      L = CE(logits_K)
  per_loop      L = (1/K) Σ_k CE(logits_k)
  adaptive      L = Σ_k mean_tokens(p_k · CE_k) − w · mean_tokens(H(p)), p the exit gate's
                survival chain (LoopedLM.exit_pdf), w = entropy_weight (official
                supervision.mode=adaptive: the gate learns where to stop, the entropy keeps p spread)
  norm_penalty  L += λ · (1/K) Σ_k mean_{batch,pos,channel}(H_k²)   (all K loops, before any norm)
  scale_anchor  L += w · (sqrt((1/K) Σ_k mean(H_k²)) − target)²       (official supervision.scale_anchor_*)

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
    if obj.loss == "adaptive":
        return _adaptive_loss(model, states, targets, obj)
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
    return _regularized(torch.stack(in_loss).mean(), ces, states, obj)


def _regularized(total: torch.Tensor, ces: list[torch.Tensor], states: list[torch.Tensor],
                 obj: ObjectiveConfig) -> LossOutput:
    """The loss plus the regularizer, with the per-exit records."""
    penalty = torch.stack([h.float().pow(2).mean() for h in states]).mean()
    if obj.regularizer == "norm_penalty":
        total = total + obj.penalty_weight * penalty
    elif obj.regularizer == "scale_anchor":
        total = total + obj.anchor_weight * (penalty.sqrt() - obj.anchor_target) ** 2
    return LossOutput(total=total, ce=torch.stack([c.detach().float() for c in ces]),
                      norms=torch.stack([mean_token_norm(h) for h in states]), penalty=penalty.detach())


def _adaptive_loss(model, states: list[torch.Tensor], targets: torch.Tensor, obj: ObjectiveConfig) -> LossOutput:
    """Σ_k mean(p_k·CE_k) − w·mean(H(p)): per-token CEs weighted by the exit distribution.

    The gate's gradient rests on the differences between the exits' per-token CEs, which
    bf16 logits would drown, so the gate and the logits run in fp32 (outside autocast)."""
    K = len(states)
    with torch.autocast(states[0].device.type, enabled=False):
        dt = torch.promote_types(states[0].dtype, torch.float32)  # bf16 -> fp32; fp32, fp64 stay
        hs = [h.to(dt) for h in states]
        pdf = model.exit_pdf(hs)  # [K, B, T]
        ces, total = [], 0.0
        for k, h in enumerate(hs):
            logits = model.logits(h, k == K - 1, k=k + 1)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            total = total + (pdf[k].reshape(-1) * ce).mean()
            ces.append(ce.mean())
        entropy = -(pdf * pdf.clamp_min(1e-8).log()).sum(dim=0).mean()
    return _regularized(total - obj.entropy_weight * entropy, ces, states, obj)
