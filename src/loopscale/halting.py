"""Calibrated post-hoc halting (paper Sec. 5): when may a looped LM stop looping?

Every exit's per-token confidences (max_prob, margin, entropy); thresholds calibrated on one
half of the halting windows and reported on the other (sequence and token policies); the real
dynamic-depth run timed against full depth; and beside it `paper`, the paper's own protocol
(Table 8 and the early-exit curves). Definitions: docs/diagnostics.md, "halting".
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

from .exits import POLICIES, confidences  # noqa: E402,F401  (decoding needs them without the data pipeline)
GRANULARITIES = ("sequence", "token")
N_QUANTILES = 201
# the paper's protocol: its policy names and the official scripts' default threshold counts
PAPER_POLICY = {"max_prob": "max_prob", "margin": "logit_margin", "entropy": "confidence_entropy"}
PAPER_CURVE_THRESHOLDS = 31  # early_exit_curve.py --num-thresholds
PAPER_HALT_THRESHOLDS = 51  # adaptive_halt_benchmark.py --num-thresholds
ALL_EXITS = "all_exits"  # timed_passes variant: full depth, every exit read out (the paper's baseline)
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


@torch.inference_mode()
def collect(run: EvalRun, starts: np.ndarray) -> tuple[np.ndarray, dict]:
    """CE [windows, T, K] and confidences {policy: [windows, T, K]} of every exit (float64)."""
    K, T, model = run.K, run.seq_len, run.model
    ce_all, conf_all = [], {p: [] for p in POLICIES}
    for x, y in batches(run, starts, "halting"):
        stats = [exit_token_stats(model, h, y, final=k == K - 1, k=k + 1) for k, h in enumerate(model(x))]
        ce_all.append(torch.stack([ce.view(-1, T) for ce, _ in stats], -1).double().cpu())
        for p in POLICIES:
            conf_all[p].append(torch.stack([conf[p].view(-1, T) for _, conf in stats], -1).double().cpu())
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
# the paper's protocol (Table 8; official early_exit_curve.py, adaptive_halt_benchmark.py)
# ---------------------------------------------------------------------------
def paper_units(ce: np.ndarray, conf: np.ndarray, granularity: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(summed CE [units, K], tokens [units], confidence [units, K]) of windows or tokens.

    ce, conf: [windows, T, K]. A window's confidence is its tokens' mean, its CE their sum.
    Confidences are float32 (the official scripts' precision, so the threshold sweep's
    quantiles and their deduplication are the same; `paper_window_score`)."""
    K = ce.shape[-1]
    c32 = conf.astype(np.float32)  # exact: conf holds float32 values
    if granularity == "sequence":
        score = paper_window_score(torch.from_numpy(np.moveaxis(c32, -1, 0).copy())).numpy().T
        return ce.sum(axis=1), np.full(ce.shape[0], float(ce.shape[1])), score
    return ce.reshape(-1, K), np.ones(ce.shape[0] * ce.shape[1]), c32.reshape(-1, K)


def paper_window_score(conf: torch.Tensor) -> torch.Tensor:
    """A window's confidence under the paper's protocol: the float32 mean of its tokens'
    confidences (sum / T over the last axis), as the official scripts compute it."""
    c = conf.float()
    return c.sum(-1) / c.shape[-1]


def paper_thresholds(score: np.ndarray, n: int) -> np.ndarray:
    """The paper's sweep: min − 1e-6, n quantiles (deduplicated) and max + 1e-6 of the finite
    confidences at the early exits 1..K−1 (exit 1 alone when K = 1)."""
    K = score.shape[-1]
    s = score[:, :max(1, K - 1)].ravel()
    s = s[np.isfinite(s)]
    if s.size == 0:
        return np.zeros(0)
    return np.concatenate([[s.min() - 1e-6], np.unique(np.quantile(s, np.linspace(0.0, 1.0, n))), [s.max() + 1e-6]])


def paper_exit_index(score: np.ndarray, tau: float) -> np.ndarray:
    """0-based exit of every unit: the first k < K whose confidence is >= τ, else K."""
    K = score.shape[-1]
    if K == 1:  # no early exit exists
        return np.zeros(score.shape[0], dtype=np.int64)
    eligible = score[:, :K - 1] >= tau
    return np.where(eligible.any(axis=1), eligible.argmax(axis=1), K - 1)


def paper_point(unit_ce: np.ndarray, tokens: np.ndarray, exit_idx: np.ndarray) -> dict:
    """PPL, CE (per token) and mean loops of the units exiting at `exit_idx`."""
    K = unit_ce.shape[-1]
    ce = float(unit_ce[np.arange(len(exit_idx)), exit_idx].sum() / tokens.sum())
    loops = float(np.mean(exit_idx + 1))
    return {"avg_loops": loops, "avg_loop_fraction": loops / K, "ppl": ppl(ce), "ce": ce,
            "num_items": int(len(exit_idx)), "num_tokens": int(tokens.sum()),
            "exit_counts": np.bincount(exit_idx, minlength=K).tolist()}


def paper_curve(ce: np.ndarray, conf: dict, granularity: str, n_thresholds: int = PAPER_CURVE_THRESHOLDS) -> list:
    """The early-exit curve (official early_exit_curve.py): rows fixed_K1..fixed_KK, then
    each policy's threshold sweep ordered by (mean loops, PPL)."""
    K = ce.shape[-1]
    unit_ce, tokens, _ = paper_units(ce, ce, granularity)
    rows = [{"policy": f"fixed_K{k + 1}", "threshold": None,
             **paper_point(unit_ce, tokens, np.full(len(tokens), k))} for k in range(K)]
    for p in POLICIES:
        score = paper_units(ce, conf[p], granularity)[2]
        sweep = [{"policy": p, "threshold": float(t), **paper_point(unit_ce, tokens, paper_exit_index(score, t))}
                 for t in paper_thresholds(score, n_thresholds)]
        rows += sorted(sweep, key=lambda r: (r["avg_loops"], r["ppl"]))  # stable: ties keep threshold order
    return rows


def paper_calibrate(unit_ce: np.ndarray, tokens: np.ndarray, score: np.ndarray, target_ratio: float,
                    n_thresholds: int = PAPER_HALT_THRESHOLDS) -> dict:
    """The paper's calibration (official adaptive_halt_benchmark.py): the first threshold of
    the sweep with PPL ≤ target_ratio·PPL_K and the fewest mean loops; none: never exit early."""
    fixed = ppl(float(unit_ce[:, -1].sum() / tokens.sum()))
    best = None
    for t in paper_thresholds(score, n_thresholds):
        pt = paper_point(unit_ce, tokens, paper_exit_index(score, t))
        if pt["ppl"] <= target_ratio * fixed and (best is None or pt["avg_loops"] < best["calib_dynamic_avg_loops"]):
            best = {"threshold": float(t), "calib_dynamic_ppl": pt["ppl"], "calib_dynamic_avg_loops": pt["avg_loops"]}
    if best is None:
        early = score[:, :max(1, score.shape[-1] - 1)]
        finite = early[np.isfinite(early)]
        best = {"threshold": float(finite.max() + 1e-6) if finite.size else math.inf,
                "calib_dynamic_ppl": fixed, "calib_dynamic_avg_loops": float(unit_ce.shape[-1])}
    return {**best, "calib_fixed_ppl": fixed}


def paper_protocol(run: EvalRun, ce: np.ndarray, conf: dict, starts: np.ndarray) -> dict:
    """The paper's halting protocol on the windows `starts` (ce, conf: their exit statistics):
    curves, in-sample calibration, and the real dynamic-depth run timed against the paper's
    fixed-depth baseline (every exit read out) on the same windows."""
    target = 1 + run.ecfg.halting_epsilon
    unit_ce, tokens, _ = paper_units(ce, ce, "sequence")
    calibrated = {p: {"policy": p, "official_policy": PAPER_POLICY[p],
                      **paper_calibrate(unit_ce, tokens, paper_units(ce, conf[p], "sequence")[2], target)}
                  for p in POLICIES}
    data = list(batches(run, starts, "halting (paper): loading"))  # on the device before any timing
    variants = {ALL_EXITS: (ALL_EXITS, None),
                **{p: (p, c["threshold"], "paper") for p, c in calibrated.items() if math.isfinite(c["threshold"])}}
    timed = timed_passes(run, data, variants)
    n_tok = int(tokens.sum())
    fixed_s, fixed_ce, _ = timed[ALL_EXITS]
    for p, c in calibrated.items():
        dt, dce, dloops = timed.get(p, timed[ALL_EXITS])
        c.update({"bench_fixed_ppl": ppl(fixed_ce), "bench_fixed_seconds": fixed_s,
                  "bench_fixed_tokens_per_second": n_tok / fixed_s if fixed_s > 0 else None,
                  "bench_dynamic_ppl": ppl(dce), "bench_dynamic_avg_loops": dloops,
                  "bench_dynamic_seconds": dt, "bench_dynamic_tokens_per_second": n_tok / dt if dt > 0 else None,
                  "bench_speedup": fixed_s / dt if dt > 0 else None})
        if not math.isfinite(c["threshold"]):
            c["threshold"] = None
    return {"protocol": "in-sample: calibration and benchmark on the same windows (paper Table 8)",
            "windows": len(starts), "target_ppl_ratio": target,
            "thresholds": {"curve": PAPER_CURVE_THRESHOLDS, "calibration": PAPER_HALT_THRESHOLDS},
            "curve": {g: paper_curve(ce, conf, g) for g in GRANULARITIES}, "calibrated": calibrated}


# ---------------------------------------------------------------------------
# real dynamic-depth execution (sequence policy)
# ---------------------------------------------------------------------------
@torch.inference_mode()
def dynamic_batch(model, x: torch.Tensor, y: torch.Tensor, policy: Optional[str], tau: Optional[float],
                  paper: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch at dynamic depth (docs/diagnostics.md, `dynamic`): (Σ token CE, Σ token loops)
    as device tensors; policy=None (or τ=None): full depth, one final readout; `paper`: the
    window confidence of the paper's protocol (paper_window_score)."""
    K = model.cfg.n_loops
    T = x.shape[1]
    h_in = model.embed(x)
    ce_sum, loops = (torch.zeros((), dtype=torch.float64, device=x.device) for _ in range(2))
    for k in range(1, K):  # the early exits
        h = model.loop(h_in)
        if policy is not None and tau is not None:
            ce, conf = exit_token_stats(model, h, y, final=False, k=k)
            c = paper_window_score(conf[policy].view(-1, T)) if paper else conf[policy].view(-1, T).double().mean(1)
            halt = c >= tau
            ce_sum += (ce.view(-1, T).double().sum(1) * halt).sum()
            loops += k * T * halt.sum()
            keep = ~halt
            if not bool(keep.any()):
                return ce_sum, loops
            h, y = h[keep], y[keep]
        h_in = model.feed(h, k)
    _add_exit_ce(ce_sum, model, model.loop(h_in), y, True)
    loops += K * y.numel()
    return ce_sum, loops


@torch.inference_mode()
def all_exits_batch(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's fixed-depth baseline: a full K-loop pass that reads out every exit (as the
    official forward computes all_logits), scored at exit K. Returns (Σ token CE, Σ token loops)."""
    K = model.cfg.n_loops
    ce_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    for k, h in enumerate(model(x)):
        _add_exit_ce(ce_sum, model, h, y, k == K - 1, k + 1, score=k == K - 1)
    return ce_sum, torch.tensor(float(K * y.numel()), dtype=torch.float64, device=x.device)


def _add_exit_ce(ce_sum: torch.Tensor, model, h: torch.Tensor, y: torch.Tensor, final: bool,
                 k: Optional[int] = None, score: bool = True) -> None:
    """Add one exit's token CE to `ce_sum` (float64, in place), its logits computed chunk by
    chunk; `score=False` computes the logits alone (the paper's baseline reads out every exit)."""
    hr, yf = model.readout(h, final, k=k).reshape(-1, h.shape[-1]), y.reshape(-1)
    for s in range(0, hr.shape[0], _CHUNK):
        z = F.linear(hr[s:s + _CHUNK], model.head_weight).float()
        if score:
            ce_sum += F.cross_entropy(z, yf[s:s + _CHUNK], reduction="sum").double()


def _execute(model, x, y, policy, tau, protocol: str = "held_out"):
    """One batch of a timed variant: the paper's all-exits baseline or dynamic_batch."""
    if policy == ALL_EXITS:
        return all_exits_batch(model, x, y)
    return dynamic_batch(model, x, y, policy, tau, paper=protocol == "paper")


def timed_passes(run: EvalRun, data: list, variants: dict) -> dict:
    """Time the executions `variants` ({name: (policy, τ[, protocol])}; policy ALL_EXITS: the
    paper's baseline, protocol "paper": its window confidence) interleaved on the same batches
    (docs/diagnostics.md, "halting"). Returns {name: (seconds, mean CE, mean loops)}."""
    model, dev = run.model, run.device
    for spec in variants.values():  # warm-up: one batch of each execution
        _execute(model, *data[0], *spec)
    secs = {v: 0.0 for v in variants}
    sums = {v: torch.zeros(2, dtype=torch.float64, device=dev) for v in variants}  # CE, loops
    for x, y in data:
        for v, spec in variants.items():
            sync(dev)
            t0 = time.perf_counter()
            c, l = _execute(model, x, y, *spec)
            sync(dev)
            secs[v] += time.perf_counter() - t0
            sums[v] += torch.stack([c, l])
    n = sum(y.numel() for _, y in data)
    return {v: (secs[v], float(sums[v][0]) / n, float(sums[v][1]) / n) for v in variants}


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
    policies, cal = {}, parts["calib"]
    for g in GRANULARITIES:
        for p in POLICIES:
            tau = calibrate(ce[cal], conf[p][cal], g, e.halting_epsilon)
            policies[f"{p}/{g}"] = {
                "policy": p, "granularity": g,
                "threshold": tau if math.isfinite(tau) else None, "early_exit": math.isfinite(tau),
                **{part: _report(ce[sl], conf[p][sl], tau, g, e.halting_epsilon) for part, sl in parts.items()}}

    # real dynamic depth on the test windows (sequence policy), timed against full depth
    data = list(batches(run, starts[n_cal:], "halting: loading"))  # on the device before any timing
    early = {p: policies[f"{p}/sequence"]["threshold"] for p in POLICIES}
    variants = {"full_depth": (None, None), **{p: (p, tau) for p, tau in early.items() if tau is not None}}
    timed = timed_passes(run, data, variants)
    full_s, full_ce, _ = timed["full_depth"]
    dynamic = {"full_depth": {"time_s": full_s, "ppl": ppl(full_ce), "mean_loops": float(K)}}
    for p in POLICIES:
        # never exits early (not timed): the dynamic execution is the full-depth one
        dt, dce, dloops = timed.get(p, (full_s, full_ce, float(K)))
        dynamic[p] = {"threshold": early[p], "time_s": dt, "speedup": full_s / dt if dt > 0 else None,
                      "mean_loops": dloops, "ppl": ppl(dce), "ppl_ratio": ppl(dce) / ppl(full_ce),
                      "posthoc_ppl": policies[f"{p}/sequence"]["test"]["ppl"]}
    payload = {"k_train": K, "epsilon": e.halting_epsilon, "target_ppl_ratio": 1 + e.halting_epsilon,
               "windows": {"calib": n_cal, "test": len(starts) - n_cal}, "seq_len": run.seq_len,
               "tokens_per_part": {"calib": n_cal * run.seq_len, "test": (len(starts) - n_cal) * run.seq_len},
               "static_exits": static, "policies": policies,
               "dynamic": {"batch_size": e.batch_size, "granularity": "sequence", **dynamic},
               "paper": paper_protocol(run, ce, conf, starts)}
    return payload, len(starts) * run.seq_len
