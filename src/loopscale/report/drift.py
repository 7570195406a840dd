"""The drift law: how ‖H_K‖ grows with training steps, fitted per condition and extrapolated
to the paper's training length.

Data: every training log record (metrics.jsonl: `step`, `norm` = ‖H_k‖ per exit on the
training batch) of the completed runs of one size × condition, seeds pooled, from
FIT_FROM_FRACTION of the last logged step on (the early transient is left out). Two laws are
fitted by least squares:

  power   ‖H_K‖ = A · t^b          (a line in log ‖H_K‖ vs log t)
  log     ‖H_K‖ = a + b · log t    (a line in ‖H_K‖ vs log t)

Both are scored by R² of log ‖H_K‖ (the norms span decades, so errors count relatively);
the law with the higher R² is chosen (a log law that falls to a norm <= 0 by the target
step is not a candidate). The chosen law is extrapolated to the paper's step
count for its 44M model (4 epochs of WikiText-103 in 257-token windows every 128 tokens at
batch 64, `paper_steps`) with a bootstrap interval over the log records (BOOTSTRAP
resamples, fixed seed: the same runs give the same numbers). This is an extrapolation of a
small model's law over one to two orders of magnitude of steps, not a measurement: the
paper's 44M and 129M models are wider and trained on another corpus.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from . import paper
from .aggregate import Group, Table, training_norms
from .fmt import EMPTY, md_table, num
from .runs import finite

FIT_FROM_FRACTION = 0.2  # fit on the log records at step >= 0.2 × the last logged step
BOOTSTRAP = 500
BOOTSTRAP_SEED = 0
MIN_RECORDS = 4  # fewer records (or fewer than 2 distinct steps) than this: no fit


def paper_steps(n_tokens: int = paper.WIKITEXT103_TRAIN_TOKENS, seq_len: int = 256, stride: int = 128,
                batch_size: int = 64, epochs: float = 4.0) -> int:
    """Optimiser steps of the paper's recipe: windows of seq_len+1 tokens every `stride`
    tokens (as data.train_window_starts), `batch_size` windows per step, `epochs` passes."""
    windows = math.ceil((n_tokens - seq_len) / stride)
    return math.ceil(epochs * (windows // batch_size))


@dataclass
class Fit:
    law: str  # power | log
    a: float  # power: log A; log: a
    b: float
    r2: float  # of log ‖H_K‖

    def predict(self, t) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        if self.law == "power":
            return np.exp(self.a + self.b * np.log(t))
        return self.a + self.b * np.log(t)

    @property
    def formula(self) -> str:
        if self.law == "power":
            return f"{num(math.exp(self.a))} · t^{self.b:.3f}"
        return f"{num(self.a)} + {num(self.b)} · ln t"


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def _r2_log(y_obs: np.ndarray, y_pred: np.ndarray) -> float:
    """R² of ln ‖H_K‖; NaN when the law predicts a norm <= 0 at a fitted point (it does not
    describe the data there)."""
    if np.any(y_pred <= 0):
        return math.nan
    ly, lp = np.log(y_obs), np.log(y_pred)
    ss_res = float(np.sum((ly - lp) ** 2))
    ss_tot = float(np.sum((ly - ly.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan


def fit_laws(steps, norms) -> dict[str, Fit]:
    """Both laws fitted to (step, ‖H_K‖) points (steps > 0, norms > 0)."""
    t, n = np.asarray(steps, dtype=float), np.asarray(norms, dtype=float)
    out = {}
    a, b = _line(np.log(t), np.log(n))
    out["power"] = Fit("power", a, b, math.nan)
    a, b = _line(np.log(t), n)
    out["log"] = Fit("log", a, b, math.nan)
    for f in out.values():
        f.r2 = _r2_log(n, f.predict(t))
    return out


def choose(fits: dict[str, Fit], target: Optional[float] = None) -> Fit:
    """The law with the higher R² (power on a tie); a log law that predicts a norm <= 0 at
    `target` (a falling norm) is not a candidate: norms are positive, the power law stays so."""
    p, lg = fits["power"], fits["log"]
    if target is not None and not lg.predict(target) > 0:
        return p
    return lg if finite(lg.r2) and (not finite(p.r2) or lg.r2 > p.r2) else p


def fit_points(g: Group) -> tuple[np.ndarray, np.ndarray, int]:
    """(steps, ‖H_K‖) of the completed runs' log records used in the fit, and the seed count."""
    pts, seeds = [], 0
    for r in g.used:
        tr = [(s, v) for s, v in training_norms(r) if s > 0 and finite(v) and v > 0]
        if tr:
            seeds += 1
            pts += tr
    if not pts:
        return np.zeros(0), np.zeros(0), 0
    last = max(s for s, _ in pts)
    pts = [(s, v) for s, v in pts if s >= FIT_FROM_FRACTION * last]
    return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float), seeds


@dataclass
class DriftResult:
    group: Group
    steps: np.ndarray
    norms: np.ndarray
    seeds: int
    fits: Optional[dict] = None
    chosen: Optional[Fit] = None
    target: int = 0
    at_target: float = math.nan
    ci: tuple = (math.nan, math.nan)

    @property
    def ok(self) -> bool:
        return self.chosen is not None


def drift_law(g: Group, target: Optional[int] = None) -> DriftResult:
    """Fit both laws to one condition's log records, extrapolate the chosen one to `target`
    steps (default: the paper's 44M step count) with a bootstrap interval."""
    target = paper_steps() if target is None else target
    t, n, seeds = fit_points(g)
    res = DriftResult(g, t, n, seeds, target=target)
    if len(t) < MIN_RECORDS or len(np.unique(t)) < 2:
        return res
    res.fits = fit_laws(t, n)
    res.chosen = choose(res.fits, target)
    res.at_target = float(res.chosen.predict(target))
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    boot = []
    for _ in range(BOOTSTRAP):
        i = rng.integers(0, len(t), len(t))
        if len(np.unique(t[i])) < 2:
            continue
        boot.append(float(fit_laws(t[i], n[i])[res.chosen.law].predict(target)))
    if boot:
        res.ci = (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)))
    return res


def drift_results(groups: list[Group]) -> list[DriftResult]:
    return [drift_law(g) for g in groups]


def _r2(v: float) -> str:
    return f"{v:.3f}" if finite(v) else EMPTY


def _paper_norm(g: Group) -> str:
    ref = paper.reference(g.cond)
    return ref["norm_text"] or EMPTY


def drift_table(groups: list[Group]) -> Table:
    T = paper_steps()
    T129 = paper_steps(batch_size=64 // 2)
    rows, md_rows = [], []
    for res in drift_results(groups):
        g = res.group
        sq = math.sqrt(g.d_model) if g.d_model else math.nan
        last_step = int(res.steps.max()) if len(res.steps) else 0
        last = [v for s, v in zip(res.steps, res.norms) if s == last_step]
        obs = float(np.mean(last)) if last else math.nan
        f = res.fits or {}
        row = {"size": g.size.label, "params": g.size.params, "d_model": g.d_model, "condition": g.cond.label,
               "condition_id": g.cond.slug, "n_seeds": res.seeds, "n_records": len(res.steps),
               "fit_from_step": int(res.steps.min()) if len(res.steps) else 0, "last_step": last_step,
               "norm_K_last_step": obs, "law": res.chosen.law if res.ok else "",
               "power_A": math.exp(f["power"].a) if f else math.nan, "power_b": f["power"].b if f else math.nan,
               "power_r2": f["power"].r2 if f else math.nan,
               "log_a": f["log"].a if f else math.nan, "log_b": f["log"].b if f else math.nan,
               "log_r2": f["log"].r2 if f else math.nan,
               "target_steps": T, "norm_K_at_target": res.at_target, "ci_low": res.ci[0], "ci_high": res.ci[1],
               "norm_K_at_target_over_sqrt_d": res.at_target / sq, "paper_norm_K": _paper_norm(g)}
        rows.append(row)
        if not res.ok:
            md_rows.append([g.size.label, g.cond.label, str(res.seeds), str(len(res.steps)), num(obs),
                            "too few log records", EMPTY, EMPTY, EMPTY, EMPTY, _paper_norm(g)])
            continue
        md_rows.append([g.size.label, g.cond.label, str(res.seeds), str(len(res.steps)), num(obs),
                        f"{res.chosen.law}: {res.chosen.formula}",
                        f"{_r2(f['power'].r2)} / {_r2(f['log'].r2)}",
                        num(res.at_target), f"{num(res.ci[0])} – {num(res.ci[1])}", num(res.at_target / sq),
                        _paper_norm(g)])
    md = md_table(["Size", "Condition", "seeds", "records", "‖H_K‖ at last step", "law (chosen)",
                   "R² power / log", f"‖H_K‖ at {T:,} steps", "95% interval", "… /√d", "Paper ‖H_K‖"], md_rows)
    p44, p129 = paper.NORM_K_PER_LOOP_RMSNORM["44M"], paper.NORM_K_PER_LOOP_RMSNORM["129M"]
    md += (f"\n**An extrapolation, not a measurement.** ‖H_K‖ on the training batch (metrics.jsonl) from "
           f"{FIT_FROM_FRACTION:g} × the last logged step on, seeds pooled; power law A·t^b and log law a + b·ln t "
           f"fitted by least squares, the one with the higher R² (of ln ‖H_K‖) chosen and extrapolated to "
           f"{T:,} steps: the paper's 44M recipe (4 epochs of WikiText-103, "
           f"~{paper.WIKITEXT103_TRAIN_TOKENS / 1e6:.0f}M training tokens, 257-token windows every 128 tokens, "
           f"batch 64; the 129M model at batch 32 takes {T129:,} steps). 95% interval: bootstrap over the log "
           f"records ({BOOTSTRAP} resamples). The paper reports ‖H_K‖ ≈ {p44:,} (44M, {p44 / math.sqrt(512):,.0f}·√d) "
           f"and {p129:,} (129M, {p129 / math.sqrt(768):,.0f}·√d) for per-loop CE + RMSNorm readout; our models "
           f"are narrower and trained on another corpus, so compare the /√d column and the law's shape, not the "
           f"absolute number.\n")
    return Table("drift", f"Drift law: ‖H_K‖ vs training step, extrapolated to {T:,} steps", pd.DataFrame(rows), md)
