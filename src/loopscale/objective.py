"""Training objective: per-exit cross-entropy, the loss choice and the norm penalty.

  terminal      L = CE(logits_K)
  per_loop      L = (1/K) Σ_k CE(logits_k)
  norm_penalty  L += λ · (1/K) Σ_k mean_{batch,pos,channel}(H_k²)   (all K loops, before any norm)

The vocabulary head is evaluated through `linear_cross_entropy`, which by default never
materialises a full [tokens, vocab] logit tensor: it walks the tokens in chunks and
recomputes each chunk's logits in the backward pass. Values and gradients equal the plain
`F.cross_entropy(x @ W.T, y)` up to float rounding (tests/test_objective.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ObjectiveConfig


class _ChunkedLinearCE(torch.autograd.Function):
    """mean_i CE(x_i @ W.T, y_i), chunked over tokens, logits recomputed in backward."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        n = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
        lse = torch.empty(n, dtype=acc, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        for s in range(0, n, chunk):
            logits = (x[s:s + chunk] @ weight.t()).to(acc)
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, targets[s:s + chunk, None]).squeeze(1)
            total += (lse[s:s + chunk] - tgt).sum()
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.chunk = chunk
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, targets, lse = ctx.saved_tensors
        n, chunk = x.shape[0], ctx.chunk
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        scale = grad_out.to(acc) / n
        for s in range(0, n, chunk):
            xc = x[s:s + chunk]
            probs = torch.exp((xc @ weight.t()).to(acc) - lse[s:s + chunk, None])
            probs[torch.arange(xc.shape[0], device=x.device), targets[s:s + chunk]] -= 1.0
            g = (probs * scale).to(x.dtype)
            if grad_x is not None:
                grad_x[s:s + chunk] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ xc).to(acc)
        return grad_x, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         impl: str = "chunked", chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean cross-entropy of logits = x @ weight.T against targets, over all leading dims."""
    x = x.reshape(-1, x.shape[-1])
    targets = targets.reshape(-1)
    if impl == "plain":
        return F.cross_entropy(F.linear(x, weight).float(), targets)
    if torch.is_autocast_enabled(x.device.type):  # match autocast's matmul dtype, then leave it
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _ChunkedLinearCE.apply(x, weight, targets, chunk_tokens)


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
            ce = linear_cross_entropy(model.readout(h, final), model.head_weight, targets,
                                      obj.ce_impl, obj.ce_chunk_tokens)
        ces.append(ce)
        if counts:
            in_loss.append(ce)
    total = torch.stack(in_loss).mean()
    penalty = torch.stack([h.float().pow(2).mean() for h in states]).mean()
    if obj.regularizer == "norm_penalty":
        total = total + obj.penalty_weight * penalty
    return LossOutput(total=total, ce=torch.stack([c.detach().float() for c in ces]),
                      norms=torch.stack([mean_token_norm(h) for h in states]), penalty=penalty.detach())
