"""Calibrated post-hoc halting: when may a looped LM stop looping?

Every exit k = 1..K of a full pass is read out (the exit readouts the model was trained
with), and three confidence scores are computed per token from exit k's logits z:

  max_prob   max_v softmax(z)_v
  margin     z_top1 − z_top2                       (logit margin)
  entropy    1 − H(softmax z) / log V              (normalised-entropy confidence, 1 = certain)

A policy exits at the first loop k < K whose confidence reaches a threshold τ (else at K):
  sequence   per window: the window's mean token confidence decides; all its tokens use exit k
  token      per token: each token takes the first exit whose confidence passes; its loss is that
             exit's CE (post hoc only: a causal model cannot skip loops for single tokens)

τ is calibrated on the first half of the halting windows: among the observed confidence
quantiles (and "never exit early"), the one reaching PPL ≤ (1+ε)·PPL_full with the fewest mean
loops. It is then reported on the disjoint second half. For the sequence policy the model is
also run for real with dynamic depth (finished sequences leave the batch) and timed against
full-depth execution on the same second half.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from . import data as D
from .evaluate import EvalRun, batches, windows
from .runtime import ppl, sync

POLICIES = ("max_prob", "margin", "entropy")
GRANULARITIES = ("sequence", "token")
N_QUANTILES = 201
_CHUNK = 4096  # tokens per logits chunk


def exit_token_stats(model, h: torch.Tensor, y: torch.Tensor, final: bool,
                     k: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    """Per-token CE and confidences (float32, flattened) of one exit read from state h."""
    hr = model.readout(h, final, k=k).reshape(-1, h.shape[-1])
    yf = y.reshape(-1)
    ces, confs = [], {p: [] for p in POLICIES}
    for s in range(0, hr.shape[0], _CHUNK):
        z = F.linear(hr[s:s + _CHUNK], model.head_weight).float()
        lse = torch.logsumexp(z, dim=-1)
        ces.append(lse - z.gather(1, yf[s:s + _CHUNK, None]).squeeze(1))
        for p, c in confidences(z, lse).items():
            confs[p].append(c)
    return torch.cat(ces), {k: torch.cat(v) for k, v in confs.items()}


def confidences(z: torch.Tensor, lse: torch.Tensor | None = None) -> dict:
    """The three confidence scores of float logits z [N, V] (lse: their logsumexp, if known)."""
    lse = torch.logsumexp(z, dim=-1) if lse is None else lse
    top = z.topk(2, dim=-1).values
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)  # H = lse − Σ p·z
    return {"max_prob": torch.exp(top[:, 0] - lse), "margin": top[:, 0] - top[:, 1],
            "entropy": 1.0 - ent / math.log(z.shape[-1])}


@torch.inference_mode()
def collect(run: EvalRun, starts: np.ndarray) -> tuple[np.ndarray, dict]:
    """CE [windows, T, K] and confidences {policy: [windows, T, K]} of every exit (float64)."""
    K, T, model = run.K, run.seq_len, run.model
    ce_all, conf_all = [], {p: [] for p in POLICIES}
    for x, y in batches(run, starts, "halting"):
        states = model(x)
        ce_k, conf_k = [], {p: [] for p in POLICIES}
        for k, h in enumerate(states):
            ce, conf = exit_token_stats(model, h, y, final=k == K - 1, k=k + 1)
            ce_k.append(ce.view(-1, T))
            for p in POLICIES:
                conf_k[p].append(conf[p].view(-1, T))
        ce_all.append(torch.stack(ce_k, -1).double().cpu())
        for p in POLICIES:
            conf_all[p].append(torch.stack(conf_k[p], -1).double().cpu())
    return torch.cat(ce_all).numpy(), {p: torch.cat(v).numpy() for p, v in conf_all.items()}


def outcomes(ce: np.ndarray, conf: np.ndarray, taus: np.ndarray, granularity: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each threshold: mean CE over tokens, mean loops, and the exit index [n_tau, units] (0-based).

    ce, conf: [windows, T, K]. A unit (window or token) exits at the first k < K whose
    confidence is >= τ, else at K. τ = +inf never exits early."""
    K = ce.shape[-1]
    if granularity == "sequence":
        c, e = conf.mean(axis=1), ce.mean(axis=1)  # [S, K]: equal tokens per window
    else:
        c, e = conf.reshape(-1, K), ce.reshape(-1, K)
    mean_ce, mean_loops, exits = [], [], []
    for i in range(0, len(taus), 16):  # bounded memory
        t = taus[i:i + 16, None, None]
        passed = np.concatenate([c[None, :, :K - 1] >= t, np.ones((len(t), c.shape[0], 1), bool)], axis=-1)
        kstar = passed.argmax(-1)  # first passing exit
        sel = np.take_along_axis(np.broadcast_to(e, (len(t),) + e.shape), kstar[..., None], -1)[..., 0]
        mean_ce.append(sel.mean(1))
        mean_loops.append((kstar + 1).mean(1))
        exits.append(kstar)
    return np.concatenate(mean_ce), np.concatenate(mean_loops), np.concatenate(exits)


def candidate_thresholds(conf: np.ndarray, granularity: str) -> np.ndarray:
    """Observed confidence quantiles at the early exits (1..K−1), plus +inf (never exit early)."""
    K = conf.shape[-1]
    c = conf.mean(axis=1) if granularity == "sequence" else conf.reshape(-1, K)
    early = c[:, :K - 1].ravel()
    qs = np.unique(np.quantile(early, np.linspace(0, 1, N_QUANTILES))) if early.size else np.zeros(0)
    return np.concatenate([qs, [np.inf]])


def calibrate(ce: np.ndarray, conf: np.ndarray, granularity: str, epsilon: float) -> float:
    """The threshold meeting PPL <= (1+ε)·PPL_full on (ce, conf) with the fewest mean loops."""
    taus = candidate_thresholds(conf, granularity)
    mean_ce, mean_loops, _ = outcomes(ce, conf, taus, granularity)
    full = ce[..., -1].mean()
    ok = mean_ce <= full + math.log1p(epsilon) + 1e-12
    # fewest loops, then lowest CE, then the highest (safest) threshold
    order = np.lexsort((-taus, mean_ce, mean_loops))
    best = next(i for i in order if ok[i])  # τ = inf is always feasible
    return float(taus[best])


def _report(ce: np.ndarray, conf: np.ndarray, tau: float, granularity: str, epsilon: float) -> dict:
    mean_ce, mean_loops, exits = outcomes(ce, conf, np.array([tau]), granularity)
    full = float(ce[..., -1].mean())
    K = ce.shape[-1]
    ratio = ppl(float(mean_ce[0])) / ppl(full)
    return {"mean_loops": float(mean_loops[0]), "ce": float(mean_ce[0]), "ppl": ppl(float(mean_ce[0])),
            "ppl_full": ppl(full), "ppl_ratio": ratio, "meets_target": bool(ratio <= 1 + epsilon + 1e-9),
            "exit_counts": np.bincount(exits[0], minlength=K).tolist()}


# ---------------------------------------------------------------------------
# real dynamic-depth execution (sequence policy)
# ---------------------------------------------------------------------------
@torch.inference_mode()
def dynamic_batch(model, x: torch.Tensor, y: torch.Tensor, policy: Optional[str], tau: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one batch loop by loop; after loop k < K, windows whose mean confidence is >= τ
    leave the batch and are scored at exit k. Returns (sum of token CE, sum of token loops)
    as device tensors. policy=None (or τ=None) runs full depth with one final readout."""
    K = model.cfg.n_loops
    T = x.shape[1]
    h_in = model.embed(x)
    ce_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    loops = torch.zeros((), dtype=torch.float64, device=x.device)
    for k in range(1, K + 1):
        h = model.loop(h_in)
        if k == K or policy is None or tau is None:
            if k < K:
                h_in = model.feed(h)
                continue
            hr = model.readout(h, True).reshape(-1, h.shape[-1])
            yf = y.reshape(-1)
            for s in range(0, hr.shape[0], _CHUNK):
                z = F.linear(hr[s:s + _CHUNK], model.head_weight).float()
                ce_sum += F.cross_entropy(z, yf[s:s + _CHUNK], reduction="sum").double()
            loops += K * y.numel()
            break
        ce, conf = exit_token_stats(model, h, y, final=False, k=k)
        c = conf[policy].view(-1, T).double().mean(1)
        halt = c >= tau
        ce_sum += (ce.view(-1, T).double().sum(1) * halt).sum()
        loops += k * T * halt.sum()
        keep = ~halt
        if not bool(keep.any()):
            break
        h, y = h[keep], y[keep]
        h_in = model.feed(h)
    return ce_sum, loops


def timed_passes(run: EvalRun, data: list, variants: dict) -> dict:
    """Time several executions of the same pre-loaded batches, interleaved batch by batch (so
    a change in machine load hits all of them alike). variants: {name: (policy, τ)}.
    Returns {name: (seconds, mean CE, mean loops)}."""
    model, dev = run.model, run.device
    secs = {v: 0.0 for v in variants}
    ce_sum = {v: torch.zeros((), dtype=torch.float64, device=dev) for v in variants}
    loops = {v: torch.zeros((), dtype=torch.float64, device=dev) for v in variants}
    for x, y in data:
        for v, (policy, tau) in variants.items():
            sync(dev)
            t0 = time.perf_counter()
            c, l = dynamic_batch(model, x, y, policy, tau)
            sync(dev)
            secs[v] += time.perf_counter() - t0
            ce_sum[v] += c
            loops[v] += l
    n = sum(y.numel() for _, y in data)
    return {v: (secs[v], float(ce_sum[v]) / n, float(loops[v]) / n) for v in variants}


def halting(run: EvalRun) -> tuple[dict, int]:
    e, K = run.ecfg, run.K
    starts = windows(run, e.halting_tokens)
    if len(starts) < 2:
        raise D.DataError(f"halting needs at least 2 validation windows (calibration + test); "
                          f"{run.data_dir} has {len(starts)} of seq_len {run.seq_len}")
    n_cal = len(starts) // 2
    ce, conf = collect(run, starts)
    parts = {"calib": slice(0, n_cal), "test": slice(n_cal, len(starts))}

    static = {part: [{"k": k + 1, "ce": float(ce[sl, :, k].mean()), "ppl": ppl(float(ce[sl, :, k].mean()))}
                     for k in range(K)] for part, sl in parts.items()}
    policies = {}
    for g in GRANULARITIES:
        for p in POLICIES:
            cal = parts["calib"]
            tau = calibrate(ce[cal], conf[p][cal], g, e.halting_epsilon)
            policies[f"{p}/{g}"] = {
                "policy": p, "granularity": g,
                "threshold": tau if math.isfinite(tau) else None, "early_exit": math.isfinite(tau),
                **{part: _report(ce[sl], conf[p][sl], tau, g, e.halting_epsilon) for part, sl in parts.items()}}

    # real dynamic depth on the test windows (sequence policy), timed against full depth
    test_starts = starts[n_cal:]
    bs = e.batch_size
    data = []
    for i in range(0, len(test_starts), bs):
        x, y = D.get_batch(run.tokens, test_starts[i:i + bs], run.seq_len)
        data.append((x.to(run.device), y.to(run.device)))
    early = {p: policies[f"{p}/sequence"]["threshold"] for p in POLICIES}
    variants = {"full_depth": (None, None), **{p: (p, tau) for p, tau in early.items() if tau is not None}}
    for policy, tau in variants.values():  # warm-up: one batch of each execution
        dynamic_batch(run.model, *data[0], policy, tau)
    timed = timed_passes(run, data, variants)
    full_s, full_ce, _ = timed["full_depth"]
    dynamic = {"full_depth": {"time_s": full_s, "ppl": ppl(full_ce), "mean_loops": float(K)}}
    for p in POLICIES:
        pol = policies[f"{p}/sequence"]
        if p in timed:
            dt, dce, dloops = timed[p]
        else:  # never exits early: the dynamic execution is the full-depth one
            dt, dce, dloops = full_s, full_ce, float(K)
        dynamic[p] = {"threshold": early[p], "time_s": dt, "speedup": full_s / dt if dt > 0 else None,
                      "mean_loops": dloops, "ppl": ppl(dce), "ppl_ratio": ppl(dce) / ppl(full_ce),
                      "posthoc_ppl": pol["test"]["ppl"]}
    payload = {"k_train": K, "epsilon": e.halting_epsilon, "target_ppl_ratio": 1 + e.halting_epsilon,
               "windows": {"calib": n_cal, "test": len(starts) - n_cal}, "seq_len": run.seq_len,
               "tokens_per_part": {"calib": n_cal * run.seq_len, "test": (len(starts) - n_cal) * run.seq_len},
               "static_exits": static, "policies": policies,
               "dynamic": {"batch_size": bs, "granularity": "sequence", **dynamic}}
    return payload, len(starts) * run.seq_len
