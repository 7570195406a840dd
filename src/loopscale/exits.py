"""The exit confidences of per-token halting (the paper's three policies, Sec. 5).

Kept apart from halting.py (the calibration and benchmark, which need the data pipeline) so
that decoding (generate.py, hf.py) and the bundled Hugging Face remote code need torch only."""
from __future__ import annotations

import math

import torch

POLICIES = ("max_prob", "margin", "entropy")


def confidences(z: torch.Tensor, lse: torch.Tensor | None = None) -> dict:
    """The three confidence scores of float logits z [N, V] (lse: their logsumexp, if known)."""
    lse = torch.logsumexp(z, dim=-1) if lse is None else lse
    top = z.topk(2, dim=-1).values
    logp = z - lse[:, None]
    ent = -(torch.exp(logp) * logp).sum(-1)  # H = −Σ p·log p (not lse − Σ p·z: that cancels to < 0 when p is one-hot)
    return {"max_prob": torch.exp(top[:, 0] - lse), "margin": top[:, 0] - top[:, 1],
            "entropy": 1.0 - ent / math.log(z.shape[-1])}
