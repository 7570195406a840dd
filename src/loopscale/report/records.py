"""One record per run with the values the claims' rules read, from either source:

  * a run directory (`record_of_run`: its eval JSONs, summary and training log), or
  * an experiment's committed results (`records_from_results`: per_seed.csv, one row per
    run × exit k, and train_norms.csv, the training logs' ‖H_K‖), so that the claims of an
    experiment whose run directories are not at hand can be rebuilt from what is committed.

Both give the same numbers for the same runs: per_seed.csv is written from the run
directories by `loopscale report tables` (report/tables.py) with the extractors used here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..registry import Condition
from .groups import clamp_modes, exits, norm_final, norm_loops, radial_loops, training_norms
from .runs import Run, finite

CLAMP_COLUMNS = {"remove_radial": "clamp_remove_radial_delta_ce", "freeze_loop1": "clamp_freeze_loop1_delta_ce"}


class RecordsError(ValueError):
    """Committed results that cannot be read as runs (a one-line message naming the file and what is wrong)."""


@dataclass
class RunRecord:
    """What the claims read from one run (values NaN / empty where the run or a diagnostic lacks them)."""
    arm: str  # the experiment's size name (runs/<exp>/<arm>/<condition>/seed<N>), else the size label
    size: str  # the size label, e.g. "1.3M (d128, 4L, K=4)"
    d_model: int
    K: int
    cond: Condition
    seed: Optional[int]
    completed: bool
    note: str = ""  # "completed", "diverged at step 412", ...
    exit_ppl: list = field(default_factory=list)  # per exit k = 1..K
    exit_ce: list = field(default_factory=list)
    exit_norm: list = field(default_factory=list)  # mean per-token ‖H_k‖ of the evaluation's exits
    norm_eval: list = field(default_factory=list)  # mean per-token ‖H_k‖ of the norms diagnostic (eval/norms.json)
    radial: list = field(default_factory=list)  # radial fraction per exit
    clamp: dict = field(default_factory=dict)  # clamp mode -> ΔCE at exit K
    norm_median: float = math.nan  # median per-token ‖H_K‖ (eval/norms.json), where the diagnostic has it
    norm_train_last: float = math.nan  # the training log's last ‖H_K‖
    growth: float = math.nan  # exponent b of ‖H_K‖ ∝ t^b over the training log
    params: int = 0  # the size's parameter count (orders the arms)

    def last(self, values: list) -> float:
        return values[-1] if len(values) == self.K and self.K and finite(values[-1]) else math.nan


def growth_of(points, from_fraction: float = 0.2) -> float:
    """Exponent b of ‖H_K‖ ∝ t^b over (step, ‖H_K‖) points of a training log (least squares in
    log-log, on the records from `from_fraction` of the last logged step on); NaN with fewer than 3."""
    pts = [(s, v) for s, v in points if s > 0 and finite(v) and v > 0]
    if not pts:
        return math.nan
    last = max(s for s, _ in pts)
    pts = [(s, v) for s, v in pts if s >= from_fraction * last]
    if len(pts) < 3 or len({s for s, _ in pts}) < 2:
        return math.nan
    x = [math.log(s) for s, _ in pts]
    y = [math.log(v) for _, v in pts]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else math.nan


def arm_of(path, size_label: str) -> str:
    """The size name of a run path runs/<exp>/<arm>/<condition>/seed<N> (else the size label)."""
    parts = Path(str(path)).parts
    if len(parts) >= 3 and parts[-1].startswith("seed"):
        return parts[-3]
    return size_label


def _by_k(rows, key: str, K: int) -> list:
    got = {int(r["k"]): r.get(key) for r in rows or [] if r.get("k") is not None}
    return [float(got[k]) if finite(got.get(k)) else math.nan for k in range(1, K + 1)] if got else []


def record_of_run(run: Run) -> RunRecord:
    s = run.size
    K = s.n_loops or 0
    rec = RunRecord(arm=arm_of(run.path, s.label), size=s.label, d_model=s.d_model, K=K, cond=run.condition,
                    seed=run.seed, completed=run.completed, note=run.note, params=s.params)
    pts = training_norms(run)
    rec.growth = growth_of(pts)
    if pts:
        rec.norm_train_last = float(max(pts)[1]) if finite(max(pts)[1]) else math.nan
    if not run.completed:
        return rec
    ex, _ = exits(run)
    rec.exit_ppl, rec.exit_ce, rec.exit_norm = (_by_k(ex, key, K) for key in ("ppl", "ce", "norm"))
    rec.radial = _by_k(radial_loops(run), "radial_fraction", K)
    rec.norm_eval = _by_k(norm_loops(run) if run.diag("norms") else None, "norm", K)
    for mode, rows in (clamp_modes(run) or {}).items():
        if mode == "none" or not rows:
            continue
        v = max(rows, key=lambda x: x.get("k", 0)).get("delta_ce")
        rec.clamp[mode] = float(v) if finite(v) else math.nan
    final = norm_final(run) or {}
    if finite(final.get("median")):
        rec.norm_median = float(final["median"])
    return rec


def records_of_runs(runs) -> list[RunRecord]:
    return [record_of_run(r) for r in runs]


# ---------------------------------------------------------------------------
# from an experiment's committed results
# ---------------------------------------------------------------------------
_NEEDED = ("size", "d_model", "n_loops", "readout", "loss", "regularizer", "penalty_weight", "recurrence", "seed",
           "status", "k", "ppl", "ce", "norm", "path")


def records_from_results(results_dir) -> list[RunRecord]:
    """The runs of an experiment's committed results directory: per_seed.csv (required) and
    train_norms.csv (optional: the training log's last ‖H_K‖ and its growth)."""
    import pandas as pd
    d = Path(results_dir)
    f = d / "per_seed.csv"
    if not f.is_file():
        raise RecordsError(f"{f}: not found (write it with `loopscale report tables`)")
    try:
        df = pd.read_csv(f)
    except (OSError, ValueError) as e:
        raise RecordsError(f"{f}: unreadable ({e})") from None
    missing = [c for c in _NEEDED if c not in df.columns]
    if missing:
        raise RecordsError(f"{f}: missing column(s) {', '.join(missing)}")
    logs: dict = {}
    tn = d / "train_norms.csv"
    if tn.is_file():
        t = pd.read_csv(tn)
        if not {"run", "step", "norm_K"} <= set(t.columns):
            raise RecordsError(f"{tn}: needs the columns run, step, norm_K")
        for run, g in t.groupby("run", sort=False):
            # a run is named by its last path parts (<size>/<condition>/seed<N> within one experiment)
            logs["/".join(Path(str(run)).parts[-3:])] = [(int(a), float(b)) for a, b in zip(g["step"], g["norm_K"])]
    df = df.astype({c: float for c in df.columns if pd.api.types.is_numeric_dtype(df[c])})  # plain floats
    out = []
    for path, g in df.groupby("path", sort=False):
        g = g.sort_values("k")
        r0 = g.iloc[0]
        K = int(r0["n_loops"])
        if len(g) != K or list(g["k"].astype(int)) != list(range(1, K + 1)):
            raise RecordsError(f"{f}: run {path} has exits {list(g['k'])}, expected k = 1..{K}")
        cond = Condition.of(str(r0["readout"]), str(r0["loss"]), str(r0["regularizer"]), str(r0["recurrence"]),
                            float(r0["penalty_weight"]) if finite(r0["penalty_weight"]) else 0.0)
        seed = int(r0["seed"]) if finite(r0["seed"]) else None
        completed = str(r0["status"]) == "completed"
        rec = RunRecord(arm=arm_of(path, str(r0["size"])), size=str(r0["size"]), d_model=int(r0["d_model"]), K=K,
                        cond=cond, seed=seed, completed=completed, note=str(r0["status"]),
                        params=int(r0["params"]) if "params" in g and finite(r0["params"]) else 0)
        pts = logs.get("/".join(Path(str(path)).parts[-3:])) or []
        rec.growth = growth_of(pts)
        if pts:
            rec.norm_train_last = float(max(pts)[1])
        if completed:
            col = lambda c: [float(v) if finite(float(v)) else math.nan for v in g[c]] if c in g else []  # noqa: E731
            rec.exit_ppl, rec.exit_ce, rec.exit_norm = col("ppl"), col("ce"), col("norm")
            if "radial_fraction" in g and g["radial_fraction"].notna().any():
                rec.radial = col("radial_fraction")
            if "norm_eval" in g and g["norm_eval"].notna().any():
                rec.norm_eval = col("norm_eval")
            for mode, c in CLAMP_COLUMNS.items():
                if c in g and finite(g[c].iloc[-1]):
                    rec.clamp[mode] = float(g[c].iloc[-1])
        out.append(rec)
    if not out:
        raise RecordsError(f"{f}: no runs")
    return out
