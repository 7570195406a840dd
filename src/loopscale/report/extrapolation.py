"""The drift law of one experiment: how ‖H_K‖ grows with training steps, fitted per
condition (a power law and a log law) and extrapolated to the paper's training lengths with
bootstrap intervals. The data, the laws, the choice between them and the bootstrap:
docs/studies.md, "The drift law"; `drift_law.py` fits one law across experiments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from . import paper
from .groups import Group, Table, training_norms
from .markdown import EMPTY, md_table, num
from .runs import finite

FIT_FROM_FRACTION = 0.2  # fit on the log records at step >= 0.2 × the last logged step
BOOTSTRAP = 500
BOOTSTRAP_SEED = 0
MIN_RECORDS = 4  # fewer records (or fewer than 2 distinct steps) than this: no fit


def paper_steps(n_tokens: int = paper.WIKITEXT103_TRAIN_TOKENS, seq_len: int = 256, stride: int = 128,
                batch_size: int = 64, epochs: float = 4.0) -> int:
    """Optimiser steps of the paper's recipe as the official trainer counts them: windows of
    seq_len+1 tokens every `stride` tokens, `batch_size` windows per step (the last batch of
    an epoch may be short), `epochs` passes (loopscale.data.train_steps, 'official')."""
    from ..data import train_steps
    return train_steps(n_tokens, seq_len, stride, batch_size, epochs)["official"]


@dataclass
class Fit:
    law: str  # power | log
    a: float  # power: log A; log: a
    b: float
    r2: float  # of log ‖H_K‖

    def predict(self, t) -> np.ndarray:
        v = self.a + self.b * np.log(np.asarray(t, dtype=float))
        return np.exp(v) if self.law == "power" else v

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
    out = {"power": Fit("power", *_line(np.log(t), np.log(n)), math.nan),
           "log": Fit("log", *_line(np.log(t), n), math.nan)}
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
    ci: tuple = (math.nan, math.nan)  # the chosen law's 95% interval at `target`
    by_law: dict = field(default_factory=dict)  # (law, target name) -> (prediction, low, high)

    @property
    def ok(self) -> bool:
        return self.chosen is not None

    def band(self, name: str) -> tuple[float, float]:
        """The spread over both laws at target `name`: the lowest low and highest high of the
        laws whose prediction there is a positive norm."""
        got = [v for (law, n), v in self.by_law.items() if n == name and finite(v[0]) and v[0] > 0]
        if not got:
            return math.nan, math.nan
        return min(v[1] for v in got), max(v[2] for v in got)


def _run_points(g: Group) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per completed run, its (steps, ‖H_K‖) log records used in the fit."""
    runs = [[(s, v) for s, v in training_norms(r) if s > 0 and finite(v) and v > 0] for r in g.used]
    if not any(runs):
        return []
    last = max(s for tr in runs for s, _ in tr)
    out = []
    for tr in runs:
        kept = [(s, v) for s, v in tr if s >= FIT_FROM_FRACTION * last]
        if kept:
            out.append((np.array([p[0] for p in kept], float), np.array([p[1] for p in kept], float)))
    return out


BLOCKS = 5  # a single run's log is resampled in this many blocks of consecutive records


def bootstrap_resamples(parts: list[tuple[np.ndarray, np.ndarray]], n: int = BOOTSTRAP,
                        seed: int = BOOTSTRAP_SEED):
    """Yield (steps, norms) resamples: whole runs drawn with replacement when there are
    several, else blocks of consecutive records of the one run (a moving-block bootstrap)."""
    rng = np.random.default_rng(seed)
    if len(parts) == 1:
        t, y = parts[0]
        size = max(1, len(t) // BLOCKS)
        starts = np.arange(0, max(1, len(t) - size + 1))
        for _ in range(n):
            i = np.concatenate([np.arange(s0, s0 + size) for s0 in rng.choice(starts, BLOCKS)])
            yield t[i], y[i]
        return
    for _ in range(n):
        pick = rng.integers(0, len(parts), len(parts))
        yield (np.concatenate([parts[i][0] for i in pick]), np.concatenate([parts[i][1] for i in pick]))


def drift_law(g: Group, target: Optional[int] = None, targets: Optional[dict] = None) -> DriftResult:
    """Fit both laws to one condition's log records and extrapolate both to `target` steps
    (default: the paper's 44M step count) and to every step count of `targets`, with
    bootstrap intervals over runs (or blocks of one run's records)."""
    target = paper_steps() if target is None else target
    targets = dict(PAPER_TARGETS() if targets is None else targets)
    parts = _run_points(g)
    t = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
    n = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    res = DriftResult(g, t, n, len(parts), target=target)
    if len(t) < MIN_RECORDS or len(np.unique(t)) < 2:
        return res
    res.fits = fit_laws(t, n)
    res.chosen = choose(res.fits, target)
    res.at_target = float(res.chosen.predict(target))
    at = {"target": target, **targets}
    boot: dict = {(law, name): [] for law in res.fits for name in at}
    for bt, bn in bootstrap_resamples(parts):
        if len(np.unique(bt)) < 2:
            continue
        fits = fit_laws(bt, bn)
        for (law, name), acc in boot.items():
            acc.append(float(fits[law].predict(at[name])))
    for (law, name), acc in boot.items():
        pred = float(res.fits[law].predict(at[name]))
        lo, hi = (float(np.percentile(acc, 2.5)), float(np.percentile(acc, 97.5))) if acc else (math.nan, math.nan)
        res.by_law[(law, name)] = (pred, lo, hi)
    res.ci = res.by_law[(res.chosen.law, "target")][1:]
    return res


def PAPER_TARGETS() -> dict:
    """The paper's step counts: {'44M': steps, '129M': steps}."""
    return {name: paper_steps(batch_size=m["batch_size"]) for name, m in paper.PAPER_MODELS.items()}


def drift_results(groups: list[Group]) -> list[DriftResult]:
    return [drift_law(g) for g in groups]


def _r2(v: float) -> str:
    return f"{v:.3f}" if finite(v) else EMPTY


def _paper_norm(g: Group) -> str:
    return paper.reference(g.cond)["norm_text"] or EMPTY


def drift_table(groups: list[Group]) -> Table:
    targets = PAPER_TARGETS()
    T, T129 = targets["44M"], targets["129M"]
    rows, md_rows = [], []
    for res in drift_results(groups):
        g = res.group
        sq = math.sqrt(g.d_model) if g.d_model else math.nan
        last_step = int(res.steps.max()) if len(res.steps) else 0
        obs = float(res.norms[res.steps == last_step].mean()) if len(res.steps) else math.nan
        f = res.fits or {law: Fit(law, math.nan, math.nan, math.nan) for law in ("power", "log")}
        row = {"size": g.size.label, "params": g.size.params, "d_model": g.d_model, "condition": g.cond.label,
               "condition_id": g.cond.slug, "n_seeds": res.seeds, "n_records": len(res.steps),
               "fit_from_step": int(res.steps.min()) if len(res.steps) else 0, "last_step": last_step,
               "norm_K_last_step": obs, "law": res.chosen.law if res.ok else "",
               "power_A": math.exp(f["power"].a), "power_b": f["power"].b, "power_r2": f["power"].r2,
               "log_a": f["log"].a, "log_b": f["log"].b, "log_r2": f["log"].r2,
               "target_steps": T, "norm_K_at_target": res.at_target, "ci_low": res.ci[0], "ci_high": res.ci[1],
               "norm_K_at_target_over_sqrt_d": res.at_target / sq, "paper_norm_K": _paper_norm(g),
               "bootstrap": ("runs" if res.seeds > 1 else "blocks of one run") if res.ok else ""}
        for name, steps in targets.items():
            tag = name.lower()
            row[f"steps_{tag}"] = steps
            for law in ("power", "log"):
                pred, lo, hi = res.by_law.get((law, name), (math.nan,) * 3)
                row[f"{law}_at_{tag}"], row[f"{law}_{tag}_low"], row[f"{law}_{tag}_high"] = pred, lo, hi
            row[f"band_{tag}_low"], row[f"band_{tag}_high"] = res.band(name)
        rows.append(row)
        head = [g.size.label, g.cond.label, str(res.seeds), str(len(res.steps)), num(obs)]
        if not res.ok:
            md_rows.append(head + ["too few log records", EMPTY, EMPTY, EMPTY, EMPTY, _paper_norm(g)])
            continue

        def at(name: str) -> str:
            p_, lg = res.by_law[("power", name)][0], res.by_law[("log", name)][0]
            lo, hi = res.band(name)
            return f"power {num(p_)}, log {num(lg)}; band {num(lo)} – {num(hi)}"

        md_rows.append(head + [f"{res.chosen.law}: {res.chosen.formula}", f"{_r2(f['power'].r2)} / {_r2(f['log'].r2)}",
                               at("44M"), at("129M"), num(res.band("44M")[1] / sq), _paper_norm(g)])
    md = md_table(["Size", "Condition", "seeds", "records", "‖H_K‖ at last step", "law (higher R²)",
                   "R² power / log", f"‖H_K‖ at {T:,} steps (44M)", f"at {T129:,} steps (129M)",
                   "band top at 44M /√d", "Paper ‖H_K‖"], md_rows)
    p44, p129 = paper.NORM_K_PER_LOOP_RMSNORM["44M"], paper.NORM_K_PER_LOOP_RMSNORM["129M"]
    md += (f"\n**An extrapolation, not a measurement.** ‖H_K‖ on the training batch (metrics.jsonl) from "
           f"{FIT_FROM_FRACTION:g} × the last logged step on; power law A·t^b and log law a + b·ln t fitted by "
           f"least squares and both extrapolated (the one with the higher R² of ln ‖H_K‖ is named; the band spans "
           f"both laws' 95% intervals, so the choice of law is part of the uncertainty). Intervals: bootstrap over "
           f"runs (whole seeds drawn with replacement; one run: {BLOCKS} blocks of consecutive records), "
           f"{BOOTSTRAP} resamples. Targets: the paper's recipe on its token stream — WikiText-103's "
           f"{paper.WIKITEXT103_TRAIN_WORDS:,} training words × ≈{paper.PAPER_TOKENS_PER_WORD} regex tokens per "
           f"word (whitespace runs are tokens) = {paper.WIKITEXT103_TRAIN_TOKENS / 1e6:.1f}M tokens in 257-token "
           f"windows every 128 tokens, 4 epochs: {T:,} steps at batch 64 (44M), {T129:,} at batch 32 (129M). The "
           f"paper reports ‖H_K‖ ≈ {p44:,} (44M, {p44 / math.sqrt(512):,.0f}·√d) and {p129:,} "
           f"(129M, {p129 / math.sqrt(768):,.0f}·√d) for per-loop CE + RMSNorm readout; this law ignores width, "
           f"depth and learning rate (the cross-experiment law in results/drift_law/ has them as factors).\n")
    return Table("drift", f"Drift law: ‖H_K‖ vs training step, extrapolated to {T:,} and {T129:,} steps",
                 pd.DataFrame(rows), md)
