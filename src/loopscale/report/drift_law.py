"""One drift law across experiments: ‖H_K‖ as a function of training step, width, depth and
learning rate, held against the paper's numbers.

Data: the per-run training logs every experiment's report writes (`results/<exp>/
train_norms.csv`: one row per run × logged step, ‖H_K‖ on the training batch), for one
condition (default: per-loop CE + RMSNorm readout, the drifting model), from
FIT_FROM_FRACTION of each run's last step on. Two laws, each linear in logs and fitted by
least squares:

  power   ln ‖H_K‖ = c + b·ln t      + w·ln √d + l·ln L + r·ln lr
  log     ln ‖H_K‖ = c + b·ln(ln t)  + w·ln √d + l·ln L + r·ln lr

(the log law is ‖H_K‖ ∝ (ln t)^b, logarithmic growth with the same multiplicative factors).
A factor enters only when the data vary it independently of the others (a factor collinear
with those already in is dropped, in the order width, depth, learning rate); a prediction
for a setting of a dropped factor other than the data's is not made (NaN, with the reason).

Uncertainty: a bootstrap over runs (whole runs drawn with replacement within each
configuration, so every configuration stays in), BOOTSTRAP resamples, plus the residual
scatter of the fitted runs, split in two: the run-to-run scatter within a configuration (over
√n for a mean of n new runs: 3 seeds for the paper's models) and, for a configuration the
fit has not seen, the scatter of the configurations' mean log residuals about the law (its
lack of fit between configurations, which more seeds do not average away); the band at a
target spans both laws' 95% intervals (the choice of law is part of the uncertainty).

The law's strongest assumption is one time exponent for every configuration. Each
configuration's own exponent (a power law in t on its records alone) is reported, and the
*exponent spread* at a target re-extrapolates the law from the last fitted step with every
configuration's own exponent in turn: the range a reader should allow if the target's
exponent is any of those the runs showed.

Held-out check: with `holdout`, the law is first fitted without that experiment's runs and
its prediction of their final ‖H_K‖ (mean over runs at their last logged step) is compared
with what they measured — before the held-out runs enter the final fit.

Targets: the paper's 44M and 129M models (paper.PAPER_MODELS, step counts from the paper's
token stream, drift.paper_steps) beside their reported ‖H_K‖ (39,207 and 56,051).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from . import paper
from .drift import FIT_FROM_FRACTION, PAPER_TARGETS
from .fmt import md_table, num
from ..registry import condition

BOOTSTRAP = 400
BOOTSTRAP_SEED = 0
LAWS = ("power", "log")
FACTORS = (("width", "d_model"), ("depth", "n_layers"), ("lr", "lr"))  # in the order they enter
DRIFTING = condition("rmsnorm", "per_loop").slug
LOG_COLUMNS = ["experiment", "size", "condition_id", "seed", "run", "d_model", "n_layers", "n_loops", "lr",
               "batch_size", "seq_len", "step", "norm_K"]


class DriftLawError(ValueError):
    """Input the cross-experiment law cannot use; the message is one line."""


def _time_feature(law: str, t: np.ndarray) -> np.ndarray:
    return np.log(t) if law == "power" else np.log(np.log(t))


def _factor_value(name: str, col: str, v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, float)
    return 0.5 * np.log(v) if name == "width" else np.log(v)  # width enters as ln √d


@dataclass
class LawFit:
    law: str
    factors: tuple  # factor names that entered
    coef: np.ndarray  # [c, b, factor coefficients...]
    r2: float

    def predict(self, step, **setting) -> float:
        x = [1.0, float(_time_feature(self.law, np.asarray([float(step)]))[0])]
        for name, col in FACTORS:
            if name in self.factors:
                x.append(float(_factor_value(name, col, np.asarray([setting[col]]))[0]))
        return float(math.exp(float(np.dot(self.coef, x))))

    def formula(self) -> str:
        t = "ln t" if self.law == "power" else "ln(ln t)"
        parts = [f"{self.coef[0]:.3f}", f"{self.coef[1]:+.3f}·{t}"]
        names = {"width": "ln √d", "depth": "ln L", "lr": "ln lr"}
        parts += [f"{c:+.3f}·{names[f]}" for f, c in zip(self.factors, self.coef[2:])]
        return "ln ‖H_K‖ = " + " ".join(parts)


def _design(df: pd.DataFrame, law: str, factors: tuple) -> np.ndarray:
    cols = [np.ones(len(df)), _time_feature(law, df["step"].to_numpy(float))]
    for name, col in FACTORS:
        if name in factors:
            cols.append(_factor_value(name, col, df[col].to_numpy(float)))
    return np.column_stack(cols)


def identifiable_factors(df: pd.DataFrame) -> tuple:
    """The factors the data vary independently of time and of the factors already in."""
    got: list = []
    for name, col in FACTORS:
        X = _design(df, "power", tuple(got) + (name,))
        if df[col].nunique() > 1 and np.linalg.matrix_rank(X) == X.shape[1]:
            got.append(name)
    return tuple(got)


def fit(df: pd.DataFrame, law: str, factors: tuple) -> LawFit:
    X, y = _design(df, law, factors), np.log(df["norm_K"].to_numpy(float))
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    res = y - X @ coef
    ss = float(np.sum((y - y.mean()) ** 2))
    return LawFit(law, factors, coef, 1.0 - float(np.sum(res ** 2)) / ss if ss > 0 else math.nan)


def fit_records(logs: pd.DataFrame, condition_id: str = DRIFTING) -> pd.DataFrame:
    """The log records the law is fitted on: one condition, steps > 0, positive finite norms,
    from FIT_FROM_FRACTION of each run's last step on."""
    missing = [c for c in LOG_COLUMNS if c not in logs.columns]
    if missing:
        raise DriftLawError(f"training logs lack the column(s) {', '.join(missing)}")
    df = logs[logs["condition_id"] == condition_id].copy()
    for c in ("step", "norm_K", "d_model", "n_layers", "lr"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df = df[(df.step > 1) & np.isfinite(df.norm_K) & (df.norm_K > 0) & (df.d_model > 0) & (df.n_layers > 0)
            & (df.lr > 0)]
    last = df.groupby("run").step.transform("max")
    return df[df.step >= FIT_FROM_FRACTION * last]


def _config_key(df: pd.DataFrame) -> pd.Series:
    return df.d_model.astype(str) + "/" + df.n_layers.astype(str) + "/" + df.lr.astype(str)


@dataclass
class Prediction:
    name: str
    setting: dict
    step: int
    by_law: dict = field(default_factory=dict)  # law -> (prediction, low, high)
    reason: str = ""  # why there is no prediction
    exponent_spread: tuple = (math.nan, math.nan)  # the power law with each configuration's own time exponent

    @property
    def band(self) -> tuple[float, float]:
        v = [x for x in self.by_law.values() if math.isfinite(x[1]) and math.isfinite(x[2])]
        return (min(x[1] for x in v), max(x[2] for x in v)) if v else (math.nan, math.nan)


@dataclass
class DriftLaw:
    records: pd.DataFrame
    factors: tuple
    fits: dict  # law -> LawFit
    boot: dict  # law -> list of LawFit
    run_scatter: dict = field(default_factory=dict)  # law -> std of the runs' mean log residual about their configuration's
    config_scatter: dict = field(default_factory=dict)  # law -> std of the configurations' mean log residual
    own_exponents: dict = field(default_factory=dict)  # (d_model, n_layers, lr) -> its own power-law time exponent

    def seen(self, **setting) -> bool:
        """Whether the fit has runs of exactly this configuration."""
        return any(all(math.isclose(setting[c], float(v), rel_tol=1e-9) for c, v in zip(("d_model", "n_layers", "lr"), k))
                   for k in self.own_exponents)

    def exponent_spread(self, step: int, **setting) -> tuple[float, float]:
        """The power law's value at `step` re-extrapolated from the last fitted step with each
        configuration's own time exponent: (lowest, highest)."""
        t0 = float(self.records.step.max())
        base = self.fits["power"].predict(t0, **setting)
        v = [base * (step / t0) ** e for e in self.own_exponents.values() if math.isfinite(e)]
        return (min(v), max(v)) if v and step > t0 else (math.nan, math.nan)

    def predict(self, name: str, step: int, n_runs: int = 3, **setting) -> Prediction:
        """The law at (step, setting), with a 95% band for the mean of `n_runs` new runs: the
        bootstrap spread of the law plus the run-to-run scatter of the fitted runs, and the
        configurations' lack of fit where the setting is not one the law was fitted on."""
        p = Prediction(name, setting, int(step))
        rng = np.random.default_rng(BOOTSTRAP_SEED + 1)
        data = self.records
        for fname, col in FACTORS:
            if fname not in self.factors:
                seen = sorted(set(data[col].astype(float)))
                if not any(math.isclose(setting[col], v, rel_tol=1e-9) for v in seen):
                    p.reason = (f"the runs do not vary {fname} ({col} = {', '.join(f'{v:g}' for v in seen)}); "
                                f"{col} = {setting[col]:g} is not predicted")
                    return p
        new_config = not self.seen(**setting)
        for law in LAWS:
            sd = math.hypot(self.run_scatter.get(law, 0.0) / math.sqrt(max(1, n_runs)),
                            self.config_scatter.get(law, 0.0) if new_config else 0.0)
            draws = [b.predict(step, **setting) * math.exp(rng.normal(0.0, sd)) for b in self.boot[law]]
            lo, hi = (float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))) if draws else \
                (math.nan, math.nan)
            p.by_law[law] = (self.fits[law].predict(step, **setting), lo, hi)
        p.exponent_spread = self.exponent_spread(step, **setting)
        return p


def fit_drift_law(records: pd.DataFrame, n_boot: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED) -> DriftLaw:
    if records.empty or records.run.nunique() < 2:
        raise DriftLawError("the drift law needs the training logs of at least two runs of the condition")
    factors = identifiable_factors(records)
    fits = {law: fit(records, law, factors) for law in LAWS}
    rng = np.random.default_rng(seed)
    boot: dict = {law: [] for law in LAWS}
    # per run: its rows of each law's design matrix and its log norms; a resample stacks whole
    # runs drawn with replacement within each configuration (width, depth, lr)
    y_all = np.log(records["norm_K"].to_numpy(float))
    X_all = {law: _design(records, law, factors) for law in LAWS}
    cfg_key = _config_key(records).to_numpy()
    run_ids = records["run"].to_numpy()
    groups = []
    for cfg in sorted(set(cfg_key)):
        runs = list(dict.fromkeys(run_ids[cfg_key == cfg]))  # in order of appearance
        groups.append([np.flatnonzero(run_ids == r) for r in runs])
    for _ in range(n_boot):
        rows = np.concatenate([g[i] for g in groups for i in rng.integers(0, len(g), len(g))])
        for law in LAWS:
            coef, *_ = np.linalg.lstsq(X_all[law][rows], y_all[rows], rcond=None)
            boot[law].append(LawFit(law, factors, coef, math.nan))
    run_scatter, config_scatter = {}, {}
    for law_, f in fits.items():
        resid = pd.Series(y_all - X_all[law_] @ f.coef, index=records.index)
        per_run = resid.groupby(records["run"]).mean()
        run_cfg = pd.Series(cfg_key, index=records.index).groupby(records["run"]).first()
        per_cfg = per_run.groupby(run_cfg).mean()
        within = per_run - run_cfg.map(per_cfg)
        dof = len(per_run) - len(per_cfg)
        run_scatter[law_] = float(math.sqrt((within ** 2).sum() / dof)) if dof > 0 else 0.0
        config_scatter[law_] = float(per_cfg.std(ddof=1)) if len(per_cfg) > 1 else 0.0
    own = {}
    for (d, L, lr), g in records.groupby(["d_model", "n_layers", "lr"], sort=True):
        x = np.log(g.step.to_numpy(float))
        own[(float(d), float(L), float(lr))] = \
            float(np.polyfit(x, np.log(g.norm_K.to_numpy(float)), 1)[0]) if np.ptp(x) > 0 else math.nan
    return DriftLaw(records, factors, fits, boot, run_scatter, config_scatter, own)


def _setting(df: pd.DataFrame) -> dict:
    row = df.iloc[0]
    return {"d_model": float(row.d_model), "n_layers": float(row.n_layers), "lr": float(row.lr)}


@dataclass
class HeldOut:
    experiment: str
    observed: float  # mean over its runs of ‖H_K‖ at their last logged step
    prediction: Prediction
    n_runs: int

    @property
    def inside(self) -> Optional[bool]:
        lo, hi = self.prediction.band
        return None if not math.isfinite(lo) else bool(lo <= self.observed <= hi)


def held_out_check(records: pd.DataFrame, experiment: str, **kw) -> HeldOut:
    """Fit without `experiment`'s runs, predict their final ‖H_K‖, compare with the measurement."""
    test = records[records.experiment == experiment]
    if test.empty:
        raise DriftLawError(f"held-out experiment {experiment!r} has no training logs of the condition")
    if test[["d_model", "n_layers", "lr"]].drop_duplicates().shape[0] != 1:
        raise DriftLawError(f"held-out experiment {experiment!r} mixes configurations; hold out one at a time")
    law = fit_drift_law(records[records.experiment != experiment], **kw)
    last = test.loc[test.groupby("run").step.idxmax()]
    step = int(round(last.step.mean()))
    pred = law.predict(f"held-out {experiment}", step, n_runs=int(last.run.nunique()), **_setting(test))
    return HeldOut(experiment, float(last.norm_K.mean()), pred, int(last.run.nunique()))


def per_configuration(law: DriftLaw) -> pd.DataFrame:
    """How well the one law holds per configuration (width, depth, lr): its own time exponent
    (a power law in t fitted on that configuration's records alone), the measured final ‖H_K‖
    (mean over its runs at their last logged step) and what each law says there. A shared
    time exponent is the law's strongest assumption; this is where to see it fail."""
    r = law.records
    rows = []
    for (d, L, lr), g in r.groupby(["d_model", "n_layers", "lr"], sort=True):
        last = g.loc[g.groupby("run").step.idxmax()]
        step = int(round(last.step.mean()))
        own = law.own_exponents[(float(d), float(L), float(lr))]
        measured = float(last.norm_K.mean())
        row = {"d_model": d, "n_layers": L, "lr": lr, "experiments": ",".join(sorted(g.experiment.unique())),
               "runs": int(g.run.nunique()), "step": step, "own_time_exponent": own, "measured": measured}
        for name, f in law.fits.items():
            pred = f.predict(step, d_model=d, n_layers=L, lr=lr)
            row[name] = pred
            row[f"{name}_ratio"] = measured / pred
        rows.append(row)
    return pd.DataFrame(rows)


def paper_predictions(law: DriftLaw) -> list[Prediction]:
    steps = PAPER_TARGETS()
    return [law.predict(name, steps[name], d_model=m["d_model"], n_layers=m["n_layers"], lr=m["lr"])
            for name, m in paper.PAPER_MODELS.items()]


# ---------------------------------------------------------------------------
# tables and figure
# ---------------------------------------------------------------------------
def read_logs(results_dirs) -> pd.DataFrame:
    frames = []
    for d in results_dirs:
        p = Path(d) / "train_norms.csv"
        if not p.is_file():
            raise DriftLawError(f"{p}: no such file (written by `loopscale report tables`)")
        try:
            frames.append(pd.read_csv(p))
        except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as e:
            raise DriftLawError(f"{p}: not a readable CSV ({type(e).__name__})") from None
    return pd.concat(frames, ignore_index=True)


def _pred_row(p: Prediction) -> dict:
    row = {"target": p.name, "step": p.step, **p.setting, "reason": p.reason}
    for law in LAWS:
        v = p.by_law.get(law, (math.nan,) * 3)
        row[f"{law}"], row[f"{law}_low"], row[f"{law}_high"] = v
    row["band_low"], row["band_high"] = p.band
    row["exponent_spread_low"], row["exponent_spread_high"] = p.exponent_spread
    return row


def _pred_text(p: Prediction) -> str:
    if p.reason:
        return f"not predicted: {p.reason}"
    lo, hi = p.band
    return (f"power {num(p.by_law['power'][0])}, log {num(p.by_law['log'][0])}; band {num(lo)} – {num(hi)}")


def report(results_dirs, out_dir, holdout: Optional[str] = None, condition_id: str = DRIFTING) -> str:
    """Fit the law on the experiments' logs, write drift_law.{csv,md} and the figure; returns the Markdown."""
    out = Path(out_dir)
    logs = read_logs(results_dirs)
    records = fit_records(logs, condition_id)
    lines = ["# The drift law across experiments\n"]
    rows = []
    ho = None
    if holdout:
        ho = held_out_check(records, holdout)
        r = _pred_row(ho.prediction)
        r.update(kind="held-out", observed=ho.observed)
        rows.append(r)
    law = fit_drift_law(records)
    preds = paper_predictions(law)
    for p, (name, v) in zip(preds, paper.NORM_K_PER_LOOP_RMSNORM.items()):
        r = _pred_row(p)
        r.update(kind="paper", observed=v)
        rows.append(r)
    exps = sorted(records.experiment.unique())
    cfgs = records[["experiment", "d_model", "n_layers", "lr"]].drop_duplicates()
    lines.append(f"Condition `{condition_id}`; {records.run.nunique()} runs of {len(exps)} experiment(s) "
                 f"({', '.join(exps)}), {len(cfgs)} configuration(s); {len(records)} log records from "
                 f"{FIT_FROM_FRACTION:g} × each run's last step on. Factors the data identify: "
                 f"{', '.join(law.factors) or 'none (time only)'}.\n")
    lines.append(md_table(["law", "fit", "R² (ln ‖H_K‖)"],
                          [[f.law, f"`{f.formula()}`", f"{f.r2:.3f}"] for f in law.fits.values()]))
    if ho is not None:
        lo, hi = ho.prediction.band
        verdict = ("inside" if ho.inside else "outside") if ho.inside is not None else "not predicted"
        lines.append(f"\n**Held-out check** (fitted without `{holdout}`, then predicted): its {ho.n_runs} run(s) "
                     f"measured ‖H_K‖ = {num(ho.observed)} at step {ho.prediction.step:,}; predicted "
                     f"{_pred_text(ho.prediction)} — **{verdict}** the band"
                     + (f" (measured / band centre {ho.observed / math.sqrt(lo * hi):.2f}×)" if verdict != "not predicted"
                        else "") + ".\n")
    cfg = per_configuration(law)
    lines.append(f"\n**Per configuration** (the law's shared time exponent: power {law.fits['power'].coef[1]:.3f}; "
                 "each configuration's own exponent from its records alone; measured = mean over its runs at "
                 "their last logged step):\n")
    lines.append(md_table(
        ["d", "layers", "lr", "runs", "step", "own time exponent", "measured ‖H_K‖", "power law", "log law",
         "measured / power"],
        [[f"{c.d_model:g}", f"{c.n_layers:g}", f"{c.lr:g}", c.runs, f"{c.step:,}", f"{c.own_time_exponent:+.3f}",
          num(c.measured), num(c.power), num(c["log"]), f"{c.power_ratio:.2f}×"] for _, c in cfg.iterrows()]))
    prow = []
    for p, (name, v) in zip(preds, paper.NORM_K_PER_LOOP_RMSNORM.items()):
        lo, hi = p.band
        far = ("inside the band" if lo <= v <= hi else
               f"{v / hi:.1f}× above the band" if v > hi else f"{lo / v:.1f}× below the band") \
            if math.isfinite(lo) else "—"
        elo, ehi = p.exponent_spread
        spread = f"{num(elo)} – {num(ehi)}" if math.isfinite(elo) else "—"
        efar = ("inside" if elo <= v <= ehi else f"{v / ehi:.1f}× above" if v > ehi else f"{elo / v:.1f}× below") \
            if math.isfinite(elo) else "—"
        prow.append([name, f"{p.step:,}", f"d {p.setting['d_model']:g}, {p.setting['n_layers']:g} layers, "
                     f"lr {p.setting['lr']:g}", _pred_text(p), f"{v:,}", far, spread, efar])
    lines.append("\n**The paper's models**\n")
    exps_ = [e for e in law.own_exponents.values() if math.isfinite(e)]
    lines.append(md_table(["model", "steps", "setting", "predicted ‖H_K‖", "paper ‖H_K‖", "paper vs band",
                           "exponent spread", "paper vs spread"], prow))
    sc = ", ".join(f"{k} {law.run_scatter[k]:.3f} / {law.config_scatter[k]:.3f}" for k in LAWS)
    lines.append(f"\nBands: 95% bootstrap over runs ({BOOTSTRAP} resamples, whole runs within each configuration) "
                 f"with the residual scatter added (std of ln ‖H_K‖ between runs of a configuration / between "
                 f"configurations: {sc}; the second only for a configuration the fit has not seen), spanning both "
                 f"laws. Exponent spread: the power law from step {int(law.records.step.max()):,} on with each "
                 f"configuration's own time exponent ({min(exps_, default=math.nan):+.3f} to "
                 f"{max(exps_, default=math.nan):+.3f}) instead of the shared one. Steps: the paper's token stream ({paper.WIKITEXT103_TRAIN_WORDS:,} WikiText-103 "
                 f"words × ≈{paper.PAPER_TOKENS_PER_WORD} tokens per word), 4 epochs of 257-token windows every 128 "
                 f"tokens. An extrapolation over one to two orders of magnitude in steps and width, not a "
                 f"measurement.\n")
    from .. import __version__
    from ..io import atomic_write_text, git_commit
    cmd = ("loopscale report drift-law --results " + " ".join(str(d) for d in results_dirs)
           + (f" --holdout {holdout}" if holdout else "") + f" --out {out_dir}")
    lines.append(f"Made by `{cmd}` (loopscale {__version__}, git commit {git_commit() or 'unknown'}).\n")
    md = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "drift_law.md", md)
    atomic_write_text(out / "drift_law.csv", pd.DataFrame(rows).to_csv(index=False))
    atomic_write_text(out / "drift_law_configs.csv", cfg.to_csv(index=False))
    _figure(law, preds, ho, out / "drift_law.png")
    return md


def _figure(law: DriftLaw, preds: list, ho: Optional[HeldOut], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    r = law.records
    cmap = plt.get_cmap("viridis")
    cfgs = r[["d_model", "n_layers", "lr"]].drop_duplicates().sort_values(["d_model", "n_layers", "lr"])
    for i, (_, c) in enumerate(cfgs.iterrows()):
        col = cmap(i / max(1, len(cfgs) - 1))
        g = r[(r.d_model == c.d_model) & (r.n_layers == c.n_layers) & (r.lr == c.lr)]
        ax.scatter(g.step, g.norm_K, s=5, color=col, alpha=0.4, lw=0)
        t = np.geomspace(g.step.min(), max(PAPER_TARGETS().values()), 60)
        s = dict(d_model=c.d_model, n_layers=c.n_layers, lr=c.lr)
        ax.plot(t, [law.fits["power"].predict(x, **s) for x in t], color=col, lw=1.3,
                label=f"d {c.d_model:g}, {c.n_layers:g}L, lr {c.lr:g} (power)")
        ax.plot(t, [law.fits["log"].predict(x, **s) for x in t], color=col, lw=1.0, ls="--")
    for p, (name, v) in zip(preds, paper.NORM_K_PER_LOOP_RMSNORM.items()):
        ax.plot([p.step], [v], marker="*", ms=13, color="k", mfc="w", ls="")
        ax.annotate(f"paper {name}: {v:,}", (p.step, v), xytext=(-8, 6), textcoords="offset points", ha="right",
                    fontsize=8)
        elo, ehi = p.exponent_spread
        if math.isfinite(elo):  # each configuration's own time exponent, drawn just left of the band
            ax.plot([p.step * 0.9] * 2, [elo, ehi], color="0.55", lw=3, alpha=0.6, solid_capstyle="butt")
        lo, hi = p.band
        if math.isfinite(lo):
            ax.errorbar([p.step], [math.sqrt(lo * hi)], yerr=[[math.sqrt(lo * hi) - lo], [hi - math.sqrt(lo * hi)]],
                        color="C3", capsize=4, lw=1.4, marker="o", ms=4)
    if ho is not None and math.isfinite(ho.prediction.band[0]):
        lo, hi = ho.prediction.band
        ax.errorbar([ho.prediction.step], [math.sqrt(lo * hi)], yerr=[[math.sqrt(lo * hi) - lo],
                                                                        [hi - math.sqrt(lo * hi)]],
                    color="C1", capsize=4, lw=1.4, ls="")
        ax.plot([ho.prediction.step], [ho.observed], marker="D", color="C1", ls="", label=f"held out: {ho.experiment}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training step (log)")
    ax.set_ylabel("‖H_K‖ on the training batch (log)")
    ax.set_title("Drift law across experiments (solid: power, dashed: log law; red: 95% band at the paper's "
                 "targets,\ngrey: the exponent spread, each configuration's own time exponent)", fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def train_norms_frame(runs) -> pd.DataFrame:
    """The per-run training logs every experiment's report writes (`train_norms.csv`)."""
    from .aggregate import training_norms
    rows = []
    for r in runs:
        if not r.completed:
            continue
        parts = Path(r.path).parts
        exp, size = (parts[-4], parts[-3]) if len(parts) >= 4 else ("", "")
        m, t = r.config.get("model") or {}, r.config.get("train") or {}
        for step, norm in training_norms(r):
            rows.append({"experiment": exp, "size": size, "condition_id": r.condition.slug, "seed": r.seed,
                         "run": "/".join(parts[-4:]), "d_model": m.get("d_model"), "n_layers": m.get("n_layers"),
                         "n_loops": m.get("n_loops"), "lr": t.get("lr"), "batch_size": t.get("batch_size"),
                         "seq_len": m.get("seq_len"), "step": step, "norm_K": norm})
    return pd.DataFrame(rows, columns=LOG_COLUMNS)
