"""The norms a readout is made of, as small named modules: `NORMS` maps each kind that
`loopscale.registry.READOUTS` names (rmsnorm, layernorm, alpha, taper) to its builder.
AlphaReadout and TaperNorm follow the paper's official release (`src/models/refiner.py`);
their formulas: docs/architecture.md, "Inside the core modules". Nothing here imports the rest
of loopscale (the builders read any object with ModelConfig's fields).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn

S_REF_MODES = ("ema", "fixed", "learned")


class RMSNorm(nn.Module):
    """RMSNorm as Ouro computes it: in fp32, cast back to the input dtype, then the gain."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class AlphaReadout(nn.Module):
    """r(h) = s_ref^(1-α) · s^α · h/s, s the per-token RMS of h (computed in log space).

    Keyword-only settings: `init_alpha` (the learned α's start), `fixed_alpha` (a constant α
    instead of a learned one), `alpha_min`/`alpha_max` (the learned α's range), `s_ref`
    ("ema": log s_ref follows mean log s with `ema_decay`, updated in training mode only;
    "fixed": stays `init_log_s_ref`; "learned": a parameter), `gain` (a per-channel gain after
    the readout; the official module has none), `eps` (floor of s)."""

    def __init__(self, d_model: int, *, init_alpha: float = 0.5, fixed_alpha: Optional[float] = None,
                 alpha_min: float = 0.0, alpha_max: float = 1.0, s_ref: str = "ema", ema_decay: float = 0.99,
                 init_log_s_ref: float = 0.0, gain: bool = False, eps: float = 1e-6):
        super().__init__()
        if s_ref not in S_REF_MODES:
            raise ValueError(f"AlphaReadout: s_ref must be one of {', '.join(S_REF_MODES)}, got {s_ref!r}")
        if not 0.0 <= alpha_min < alpha_max <= 1.0:
            raise ValueError(f"AlphaReadout: need 0 <= alpha_min < alpha_max <= 1, got {alpha_min}, {alpha_max}")
        if fixed_alpha is not None and not 0.0 <= fixed_alpha <= 1.0:
            raise ValueError(f"AlphaReadout: fixed_alpha must be in [0, 1], got {fixed_alpha}")
        self.alpha_min, self.alpha_max = float(alpha_min), float(alpha_max)
        self.fixed_alpha = None if fixed_alpha is None else float(fixed_alpha)
        self.s_ref_mode, self.ema_decay, self.eps = s_ref, float(ema_decay), float(eps)
        if self.fixed_alpha is None:
            # the start, kept 1e-4 inside the range so the logit is finite
            a = min(max(float(init_alpha), self.alpha_min + 1e-4), self.alpha_max - 1e-4)
            unit = min(max((a - self.alpha_min) / (self.alpha_max - self.alpha_min), 1e-4), 1 - 1e-4)
            self.alpha_logit = nn.Parameter(torch.logit(torch.tensor(unit)))
        else:
            self.register_buffer("alpha_value", torch.tensor(self.fixed_alpha))
            self.register_buffer("alpha_logit", torch.tensor(0.0))  # unused; the official state holds it
        log_s_ref = torch.tensor(float(init_log_s_ref))
        if s_ref == "learned":
            self.log_s_ref = nn.Parameter(log_s_ref)
        else:
            self.register_buffer("log_s_ref", log_s_ref)
        self.register_buffer("ema_count", torch.tensor(0, dtype=torch.long))  # EMA updates so far
        self.weight = nn.Parameter(torch.ones(d_model)) if gain else None

    def alpha(self) -> torch.Tensor:
        if self.fixed_alpha is not None:
            return self.alpha_value
        return self.alpha_min + (self.alpha_max - self.alpha_min) * torch.sigmoid(self.alpha_logit)

    @torch.no_grad()
    def _update_s_ref(self, log_s: torch.Tensor) -> None:
        m = log_s.mean().to(self.log_s_ref.dtype)
        if int(self.ema_count) == 0:
            self.log_s_ref.copy_(m)
        else:
            self.log_s_ref.mul_(self.ema_decay).add_(m, alpha=1.0 - self.ema_decay)
        self.ema_count += 1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = h.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp(min=self.eps)
        log_s = s.log()
        if self.training and self.s_ref_mode == "ema":
            self._update_s_ref(log_s.detach())
        # a copy: later calls update the EMA buffer in place while this graph still needs the value
        log_s_ref = self.log_s_ref if self.s_ref_mode == "learned" else self.log_s_ref.detach().clone()
        a = self.alpha()
        out = ((1.0 - a) * log_s_ref + a * log_s).exp() * (h / s)
        return out if self.weight is None else out * self.weight

    def extra_repr(self) -> str:
        a = f"fixed_alpha={self.fixed_alpha}" if self.fixed_alpha is not None else \
            f"alpha in [{self.alpha_min}, {self.alpha_max}]"
        return f"{a}, s_ref={self.s_ref_mode}, gain={self.weight is not None}"


class TaperNorm(nn.Module):
    """gate·RMSNorm(h) + (1 - gate)·c·h·w_s (the RMSNorm form of TaperNorm).

    `gate` (a buffer, so checkpoints keep it) is set by the trainer through `set_gate`; until
    `calibrate` runs, training-mode calls collect EMAs of Σ(h·w)²/RMS(h) and Σ(h·w)² whose
    ratio becomes c, the constant that maps h·w to RMSNorm(h)·w in size."""

    def __init__(self, d_model: int, *, eps: float = 1e-6, ema_decay: float = 0.99):
        super().__init__()
        self.eps, self.ema_decay = float(eps), float(ema_decay)
        self.weight = nn.Parameter(torch.ones(d_model))  # the RMSNorm gain
        self.scale_weight = nn.Parameter(torch.ones(d_model))  # the gain of the sample-independent branch
        self.register_buffer("gate", torch.tensor(1.0))
        self.register_buffer("scale_coeff", torch.tensor(1.0))  # c
        self.register_buffer("ema_num", torch.tensor(0.0))
        self.register_buffer("ema_den", torch.tensor(0.0))
        self.register_buffer("ema_count", torch.tensor(0, dtype=torch.long))
        self.register_buffer("calibrated", torch.tensor(False))
        self._is_calibrated = False  # mirrors the buffer without a device sync per call

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._is_calibrated = bool(self.calibrated)

    @torch.no_grad()
    def set_gate(self, gate: float) -> None:
        self.gate.fill_(min(1.0, max(0.0, float(gate))))

    @torch.no_grad()
    def calibrate(self) -> None:
        """Start the sample-independent branch (once): w_s ← the gain, c ← the EMA ratio."""
        if self._is_calibrated:
            return
        self.scale_weight.copy_(self.weight)
        if int(self.ema_count) > 0 and float(self.ema_den) > 0:
            self.scale_coeff.copy_((self.ema_num / self.ema_den).clamp(1e-6, 1e6))
        else:
            self.scale_coeff.fill_(1.0)
        self.calibrated.fill_(True)
        self._is_calibrated = True

    @torch.no_grad()
    def _collect(self, h: torch.Tensor) -> None:
        x, w = h.float(), self.weight.float()
        sq = (x * w).pow(2).sum(dim=-1)
        rms = (x.pow(2).mean(dim=-1) + self.eps).sqrt()
        num, den = (sq / rms).mean(), sq.mean()
        if int(self.ema_count) == 0:
            self.ema_num.copy_(num)
            self.ema_den.copy_(den)
        else:
            self.ema_num.mul_(self.ema_decay).add_(num, alpha=1.0 - self.ema_decay)
            self.ema_den.mul_(self.ema_decay).add_(den, alpha=1.0 - self.ema_decay)
        self.ema_count += 1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        normed = h / (h.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt() * self.weight
        if self.training and not self._is_calibrated:
            self._collect(h.detach())
        g = self.gate.to(h.dtype)
        return g * normed + (1.0 - g) * (h * self.scale_weight * self.scale_coeff.to(h.dtype))


def taper_gate(step: int, total_steps: int, warmup_frac: float = 0.05,
               decay_frac: Optional[float] = None) -> tuple[float, int]:
    """TaperNorm's gate at optimiser step `step` of `total_steps`: (gate, warm-up steps).

    1 for the first round(warmup_frac·total) steps, then 0.5·(1 + cos(π·p)), p rising from 0
    to 1 over round(decay_frac·total) steps (default: the rest of training), then 0."""
    total = max(1, int(total_steps))
    warmup = max(0, int(round(total * warmup_frac)))
    decay = max(0, int(round(total * (max(0.0, 1.0 - warmup / total) if decay_frac is None else decay_frac))))
    if step < warmup:
        return 1.0, warmup
    if decay <= 0:
        return 0.0, warmup
    p = min(1.0, max(0.0, (step - warmup) / decay))
    return 0.5 * (1.0 + math.cos(math.pi * p)), warmup


def drive_tapers(model: nn.Module, step: int, total_steps: int, warmup_frac: float = 0.05,
                 decay_frac: Optional[float] = None) -> Optional[float]:
    """Set every TaperNorm of `model` to the gate of `step` (calibrating them once warm-up is
    over); the gate, or None when the model has no TaperNorm."""
    tapers = [m for m in model.modules() if isinstance(m, TaperNorm)]
    if not tapers:
        return None
    gate, warmup = taper_gate(step, total_steps, warmup_frac, decay_frac)
    for m in tapers:
        if step >= warmup:
            m.calibrate()
        m.set_gate(gate)
    return gate


# ---------------------------------------------------------------------------
# the norm kinds by name: builder(cfg, fp32, official) -> module; `fp32`: RMSNorm in fp32 (the
# architecture's fp32_norm), `official`: alpha readouts as the official Ouro trainer builds them
# (a learned s_ref, the other alpha_* settings at the module's defaults)
# ---------------------------------------------------------------------------
def _alpha(cfg, fp32: bool, official: bool) -> nn.Module:
    if official:
        return AlphaReadout(cfg.d_model, init_alpha=cfg.alpha_init, fixed_alpha=cfg.alpha_fixed, s_ref="learned",
                            eps=cfg.norm_eps)
    return AlphaReadout(cfg.d_model, init_alpha=cfg.alpha_init, fixed_alpha=cfg.alpha_fixed, alpha_min=cfg.alpha_min,
                        alpha_max=cfg.alpha_max, s_ref=cfg.alpha_s_ref, ema_decay=cfg.alpha_ema_decay,
                        init_log_s_ref=cfg.alpha_log_s_ref, eps=cfg.norm_eps)


NORMS: dict[str, Callable[..., nn.Module]] = {
    "rmsnorm": lambda cfg, fp32, official: RMSNorm(cfg.d_model, cfg.norm_eps) if fp32 else
    nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps),
    "layernorm": lambda cfg, fp32, official: nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=False),
    "alpha": _alpha,
    "taper": lambda cfg, fp32, official: TaperNorm(cfg.d_model, eps=cfg.norm_eps, ema_decay=cfg.taper_ema_decay),
}


def build_norm(kind: str, cfg, *, fp32: bool = False, official: bool = False) -> nn.Module:
    """The norm module of a kind (`NORMS`) for a model's settings."""
    if kind not in NORMS:
        raise ValueError(f"unknown readout norm {kind!r}; loopscale.readouts.NORMS has {', '.join(NORMS)}")
    return NORMS[kind](cfg, fp32, official)
