"""Where and how tensors run: the device, mixed precision, TF32, synchronisation, and PPL.

Training, the benchmark, the evaluations and the diagnostics all take these from here, so
what is measured runs exactly as what is trained. (torch is imported inside the functions
that need it, so the report can use `ppl` without loading torch.)
"""
from __future__ import annotations

import math
from contextlib import nullcontext

from .config import ConfigError

_PPL_MAX_CE = 700.0  # exp(700) ~ 1e304: above it PPL is reported as inf instead of overflowing


def resolve_device(name: str = "auto"):
    """`auto` -> cuda when available, else cpu. An explicit device must be available,
    otherwise a one-line ConfigError."""
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but CUDA is not available; use device=auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' requested but MPS is not available; use device=auto or cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; choose auto, cpu, cuda or mps") from None


def uses_bf16(device, precision: str) -> bool:
    """bf16 autocast on CUDA under precision `auto`, or wherever `bf16` is asked for."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(device, precision: str):
    """The mixed-precision context of a training step (a no-op in fp32)."""
    import torch
    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(device, precision) else nullcontext()


def enable_tf32(device) -> None:
    """TF32 tensor cores for the matmuls that autocast leaves in fp32 (CUDA only)."""
    import torch
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def sync(device) -> None:
    """Wait for the device's queued work (before reading a clock); a no-op on CPU."""
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ppl(ce) -> float:
    """Perplexity exp(CE): inf when CE is too large to exponentiate, NaN for a missing or NaN CE."""
    try:
        ce = float(ce)
    except (TypeError, ValueError):
        return math.nan
    if math.isnan(ce):
        return math.nan
    return math.exp(ce) if ce < _PPL_MAX_CE else math.inf
