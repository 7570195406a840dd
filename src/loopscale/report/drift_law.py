"""One drift law across experiments: ‖H_K‖ as a function of training step, width, depth,
learning rate and tokens per step, with configuration-level 95% intervals, held against the
paper's numbers (Table 1: final ‖H_K‖ 39,207 at 44M, 56,051 at 129M).

The data, the two laws, the two-stage fit, its intervals, coverage and pre-registration:
docs/studies.md, "The drift law across experiments".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from . import paper
from .extrapolation import FIT_FROM_FRACTION, PAPER_TARGETS
from .markdown import md_table, num
from ..registry import condition

LAWS = ("power", "log")
LEVEL = 0.95  # of every interval
# the factors in the order they enter; width enters as ln √d, the others as ln of the value
FACTORS = (("width", "d_model"), ("depth", "n_layers"), ("lr", "lr"), ("tokens", "tokens"))
ASSUMED = ("tokens",)  # not identified by the data: assumed to have no effect (said), not refused
CONFIG = ("d_model", "n_layers", "lr", "seq_len", "batch_size")  # one configuration
NEW_RUNS = 3  # a prediction is for the mean of this many new runs unless told (the paper's 3 seeds)
TIME_SPLIT = 0.5  # the time split fits on each run's steps up to this fraction of its last step
MATCH_STEP = 0.01  # a pre-registered step is measured by the logged step within this fraction of it
DRIFTING = condition("rmsnorm", "per_loop").slug
LOG_COLUMNS = ["experiment", "size", "condition_id", "seed", "run", "d_model", "n_layers", "n_loops", "lr",
               "batch_size", "seq_len", "step", "norm_K"]
# names a setting may use (loopscale report drift-law-predict --setting d=64,layers=2,...)
SETTING_KEYS = {"d": "d_model", "d_model": "d_model", "width": "d_model", "layers": "n_layers",
                "n_layers": "n_layers", "depth": "n_layers", "lr": "lr", "seq": "seq_len", "seq_len": "seq_len",
                "context": "seq_len", "batch": "batch_size", "batch_size": "batch_size"}
_NAMES = {"width": "ln √d", "depth": "ln L", "lr": "ln lr", "tokens": "ln(seq × batch)"}


class DriftLawError(ValueError):
    """Input the cross-experiment law cannot use; the message is one line."""


def _time_feature(law: str, t) -> np.ndarray:
    t = np.asarray(t, float)
    return np.log(t) if law == "power" else np.log(np.log(t))


def _with_tokens(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    frame["tokens"] = frame["seq_len"].astype(float) * frame["batch_size"].astype(float)
    return frame


def _factor_column(cfg: np.ndarray, col: str) -> np.ndarray:
    """One factor's values for rows of CONFIG columns."""
    return cfg[:, 3] * cfg[:, 4] if col == "tokens" else cfg[:, CONFIG.index(col)]


def _features(cfg: np.ndarray, factors: tuple) -> np.ndarray:
    """[1, factor features] per row of CONFIG columns (configurations or records)."""
    return np.column_stack([np.ones(len(cfg))] + [
        0.5 * np.log(_factor_column(cfg, col)) if name == "width" else np.log(_factor_column(cfg, col))
        for name, col in FACTORS if name in factors])


def _identifiable(keys: np.ndarray) -> tuple:
    got: list = []
    for name, col in FACTORS:
        X = _features(keys, tuple(got) + (name,))
        if len(np.unique(_factor_column(keys, col))) > 1 and np.linalg.matrix_rank(X) == X.shape[1]:
            got.append(name)
    return tuple(got)


def config_key(setting) -> tuple:
    return tuple(float(setting[c]) for c in CONFIG)


@dataclass
class LawFit:
    """One law fitted in two stages (module docstring): stage 2's OLS over configurations and the
    variance components of its intervals."""
    law: str
    factors: tuple
    t_ref: float  # the reference step the configurations' levels are taken at
    beta: np.ndarray  # stage 2: [intercept at t_ref, factor coefficients...]
    slope: float  # the shared time exponent: mean of the configurations' own
    xtx_inv: np.ndarray
    s2: float  # residual variance of the configurations' levels about stage 2
    df: int  # its degrees of freedom: configurations − coefficients
    slope_sd: float  # sd of the configurations' own exponents (n − 1 degrees of freedom)
    n_configs: int
    run_sd: float  # sd of run levels within a configuration
    df_run: int
    rec_sd: float  # sd of single records about their run's line
    df_rec: int
    levels: dict  # configuration key -> (level, runs)
    r2: float = math.nan  # of ln ‖H_K‖ over the records

    @property
    def coef(self) -> np.ndarray:
        """[c, b, factor coefficients...] of ln ‖H_K‖ = c + b·τ(t) + ..."""
        tau_ref = float(_time_feature(self.law, [self.t_ref])[0])
        return np.concatenate([[self.beta[0] - self.slope * tau_ref, self.slope], self.beta[1:]])

    def _x0(self, setting: dict) -> np.ndarray:
        v = {**setting, "tokens": float(setting["seq_len"]) * float(setting["batch_size"])}
        return np.array([1.0] + [0.5 * math.log(v[col]) if name == "width" else math.log(v[col])
                                 for name, col in FACTORS if name in self.factors])

    def _delta(self, step) -> float:
        return float(_time_feature(self.law, [float(step)])[0] - _time_feature(self.law, [self.t_ref])[0])

    def predict(self, step, **setting) -> float:
        """The law's ‖H_K‖ at `step` for `setting` (the regression, never a configuration's own level)."""
        return float(math.exp(float(self._x0(setting) @ self.beta) + self.slope * self._delta(step)))

    def interval(self, step, n_runs: int = NEW_RUNS, **setting) -> tuple[float, float, float]:
        """(point, low, high) of the mean of `n_runs` new runs' ‖H_K‖ at `step` (module docstring)."""
        x0, delta = self._x0(setting), self._delta(step)
        own = self.levels.get(config_key(setting))
        if own is not None and self.df_run > 0:  # a seen configuration: its own level
            level, parts = own[0], [(self.run_sd ** 2 * (1 / own[1] + 1 / n_runs), self.df_run)]
        else:
            level = float(x0 @ self.beta)
            parts = [(self.s2 * (1 + float(x0 @ self.xtx_inv @ x0)), self.df)]
        if delta != 0:
            parts.append((self.slope_sd ** 2 * (1 + 1 / self.n_configs) * delta ** 2, self.n_configs - 1))
        parts.append((self.rec_sd ** 2 / n_runs, self.df_rec))
        point = level + self.slope * delta
        var = sum(v for v, _ in parts)
        if not all(math.isfinite(v) and (v == 0 or d > 0) for v, d in parts) or var <= 0:
            return math.exp(point), math.nan, math.nan
        from scipy.stats import t
        dof = var ** 2 / sum(v ** 2 / d for v, d in parts if v > 0)  # Welch–Satterthwaite
        half = float(t.ppf(0.5 + LEVEL / 2, dof)) * math.sqrt(var)
        return math.exp(point), math.exp(point - half), math.exp(point + half)

    def formula(self) -> str:
        c = self.coef
        t = "ln t" if self.law == "power" else "ln(ln t)"
        parts = [f"{c[0]:.3f}", f"{c[1]:+.3f}·{t}"] + [f"{v:+.3f}·{_NAMES[f]}" for f, v in zip(self.factors, c[2:])]
        return "ln ‖H_K‖ = " + " ".join(parts)


@dataclass
class _Arrays:
    """The fit records as arrays: CONFIG columns, run index, step, ln ‖H_K‖."""
    cfg: np.ndarray
    run: np.ndarray
    step: np.ndarray
    y: np.ndarray

    @classmethod
    def of(cls, records: pd.DataFrame) -> "_Arrays":
        return cls(records[list(CONFIG)].to_numpy(float), pd.factorize(records["run"], sort=True)[0],
                   records["step"].to_numpy(float), np.log(records["norm_K"].to_numpy(float)))

    def subset(self, mask: np.ndarray) -> "_Arrays":
        return _Arrays(self.cfg[mask], pd.factorize(self.run[mask], sort=True)[0], self.step[mask], self.y[mask])


@dataclass
class _Lines:
    """Per run (rows): its number of records, level at t_ref and slope of its line in τ, and the
    residual sum of squares about it; `keys`/`inv`: the distinct configurations and each run's index into them."""
    n: np.ndarray
    level: np.ndarray
    slope: np.ndarray
    rss: np.ndarray
    keys: np.ndarray
    inv: np.ndarray

    def per_config(self, v: np.ndarray) -> np.ndarray:
        return np.bincount(self.inv, v, len(self.keys)) / np.bincount(self.inv, minlength=len(self.keys))


def _reference_step(a: _Arrays) -> float:
    """The median over configurations of their last logged step."""
    keys, inv = np.unique(a.cfg, axis=0, return_inverse=True)
    last = np.zeros(len(keys))
    np.maximum.at(last, np.asarray(inv).ravel(), a.step)
    return float(np.median(last))


def _run_lines(a: _Arrays, law: str, t_ref: float) -> _Lines:
    R = int(a.run.max()) + 1
    x = _time_feature(law, a.step) - float(_time_feature(law, [t_ref])[0])
    n = np.bincount(a.run, minlength=R).astype(float)
    sx, sy = np.bincount(a.run, x, R), np.bincount(a.run, a.y, R)
    sxx = np.bincount(a.run, x * x, R) - sx ** 2 / n
    sxy = np.bincount(a.run, x * a.y, R) - sx * sy / n
    syy = np.bincount(a.run, a.y * a.y, R) - sy ** 2 / n
    ok = sxx > 1e-12 * n  # a line needs two different steps
    slope = np.where(ok, sxy / np.where(ok, sxx, 1.0), 0.0)
    level = sy / n - slope * sx / n
    rss = np.clip(syy - slope * sxy, 0.0, None)
    cfg = a.cfg[np.unique(a.run, return_index=True)[1]][ok]
    keys, inv = np.unique(cfg, axis=0, return_inverse=True)
    return _Lines(n[ok], level[ok], slope[ok], rss[ok], keys, np.asarray(inv).ravel())


def _fit(a: _Arrays, law: str, factors: tuple, t_ref: Optional[float] = None) -> LawFit:
    if t_ref is None:
        t_ref = _reference_step(a)
    runs = _run_lines(a, law, t_ref)
    if not len(runs.level):
        raise DriftLawError("no run has logged ‖H_K‖ at two different steps in the fit window")
    level, slope = runs.per_config(runs.level), runs.per_config(runs.slope)
    n_runs = np.bincount(runs.inv, minlength=len(runs.keys))
    within = runs.level - level[runs.inv]
    n = len(runs.keys)
    df_run = int(len(runs.level) - n)
    df_rec = int(np.clip(runs.n - 2, 0, None).sum())
    X = _features(runs.keys, factors)
    beta, *_ = np.linalg.lstsq(X, level, rcond=None)
    df = int(n - X.shape[1])
    s2 = float(np.sum((level - X @ beta) ** 2) / df) if df > 0 else math.nan
    levels = {tuple(float(v) for v in k): (float(lv), int(c)) for k, lv, c in zip(runs.keys, level, n_runs)}
    out = LawFit(law, factors, float(t_ref), beta, float(slope.mean()), np.linalg.pinv(X.T @ X), s2, df,
                 float(slope.std(ddof=1)) if n > 1 else math.nan, n,
                 math.sqrt(float((within ** 2).sum()) / df_run) if df_run > 0 else math.nan, df_run,
                 math.sqrt(float(runs.rss.sum()) / df_rec) if df_rec > 0 else math.nan, df_rec, levels)
    pred = _features(a.cfg, factors) @ beta + out.slope * (_time_feature(law, a.step)
                                                           - float(_time_feature(law, [t_ref])[0]))
    ss = float(np.sum((a.y - a.y.mean()) ** 2))
    out.r2 = 1.0 - float(np.sum((a.y - pred) ** 2)) / ss if ss > 0 else math.nan
    return out


def fit_records(logs: pd.DataFrame, condition_id: str = DRIFTING, until: float = 1.0) -> pd.DataFrame:
    """The log records the law is fitted on: one condition, steps > 1, positive finite norms,
    each run's steps up to `until` × its last step, from FIT_FROM_FRACTION of the last step kept on."""
    missing = [c for c in LOG_COLUMNS if c not in logs.columns]
    if missing:
        raise DriftLawError(f"training logs lack the column(s) {', '.join(missing)}")
    df = logs[logs["condition_id"] == condition_id].copy()
    for c in ("step", "norm_K") + CONFIG:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    bad = df[list(CONFIG)].isna().any(axis=1) | (df[list(CONFIG)] <= 0).any(axis=1)
    if bad.any():
        r = df[bad].iloc[0]
        raise DriftLawError(f"run {r['run']} has no positive {', '.join(c for c in CONFIG if not r[c] > 0)} "
                            "in its training log")
    df = df[(df.step > 1) & np.isfinite(df.norm_K) & (df.norm_K > 0)]
    df = df[df.step <= until * df.groupby("run").step.transform("max")]
    last = df.groupby("run").step.transform("max")
    return _with_tokens(df[df.step >= FIT_FROM_FRACTION * last])


@dataclass
class Prediction:
    name: str
    setting: dict
    step: int
    by_law: dict = field(default_factory=dict)  # law -> (point, low, high)
    reason: str = ""  # why there is no prediction
    note: str = ""  # an assumption the prediction needs
    seen: bool = False  # the fit has runs of exactly this configuration

    @property
    def point(self) -> float:
        return self.by_law["power"][0] if self.by_law else math.nan

    @property
    def band(self) -> tuple[float, float]:
        v = [x for x in self.by_law.values() if math.isfinite(x[1]) and math.isfinite(x[2])]
        return (min(x[1] for x in v), max(x[2] for x in v)) if v else (math.nan, math.nan)


def _final(g: pd.DataFrame) -> tuple[int, float, int]:
    """(mean last step, mean ‖H_K‖ at each run's last logged step, runs) of a set of records."""
    last = g.loc[g.groupby("run").step.idxmax()]
    return int(round(last.step.mean())), float(last.norm_K.mean()), int(last.run.nunique())


@dataclass
class DriftLaw:
    records: Optional[pd.DataFrame]  # the fit records (None where only the arrays were kept)
    factors: tuple
    fits: dict  # law -> LawFit
    data: _Arrays = field(repr=False, default=None)

    @property
    def own_exponents(self) -> dict:
        """configuration key -> its own power-law time exponent (mean over its runs)."""
        runs = _run_lines(self.data, "power", self.fits["power"].t_ref)
        return {tuple(float(v) for v in k): float(b) for k, b in zip(runs.keys, runs.per_config(runs.slope))}

    def seen(self, **setting) -> bool:
        """Whether the fit has runs of exactly this configuration."""
        return config_key(setting) in self.fits["power"].levels

    def predict(self, name: str, step: int, n_runs: int = NEW_RUNS, **setting) -> Prediction:
        """Point and 95% interval of each law at (step, setting), for the mean of `n_runs` new runs."""
        missing = [c for c in CONFIG if c not in setting]
        if missing:
            raise DriftLawError(f"setting {name!r} lacks {', '.join(missing)}")
        p = Prediction(name, {c: float(setting[c]) for c in CONFIG}, int(step))
        x = np.array([config_key(p.setting)])
        keys = np.array(list(self.fits["power"].levels))
        notes = []
        for fname, col in FACTORS:
            if fname in self.factors:
                continue
            here, seen = float(_factor_column(x, col)[0]), sorted(set(_factor_column(keys, col).tolist()))
            if any(math.isclose(here, v, rel_tol=1e-9) for v in seen):
                continue
            what = f"{col} = {', '.join(f'{v:g}' for v in seen)}"
            if fname in ASSUMED:
                notes.append(f"assumes no effect of {fname} per step (the runs do not vary it: {what}; here {here:g})")
            else:
                p.reason = f"the runs do not vary {fname} ({what}); {col} = {here:g} is not predicted"
                return p
        p.note = "; ".join(notes)
        p.seen = self.seen(**p.setting)
        for law in LAWS:
            p.by_law[law] = self.fits[law].interval(step, n_runs, **p.setting)
        return p


def _law(a: _Arrays, records: Optional[pd.DataFrame] = None) -> DriftLaw:
    if len(a.y) == 0 or int(a.run.max()) < 1:
        raise DriftLawError("the drift law needs the training logs of at least two runs of the condition")
    factors = _identifiable(np.unique(a.cfg, axis=0))
    return DriftLaw(records, factors, {law: _fit(a, law, factors) for law in LAWS}, a)


def fit_drift_law(records: pd.DataFrame) -> DriftLaw:
    records = records if "tokens" in records else _with_tokens(records)
    return _law(_Arrays.of(records), records)


def _setting(df: pd.DataFrame) -> dict:
    row = df.iloc[0]
    return {c: float(row[c]) for c in CONFIG}


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


def held_out_check(records: pd.DataFrame, experiment: str) -> HeldOut:
    """Fit without `experiment`'s runs, predict their final ‖H_K‖, compare with the measurement."""
    test = records[records.experiment == experiment]
    if test.empty:
        raise DriftLawError(f"held-out experiment {experiment!r} has no training logs of the condition")
    if test[list(CONFIG)].drop_duplicates().shape[0] != 1:
        raise DriftLawError(f"held-out experiment {experiment!r} mixes configurations; hold out one at a time")
    law = fit_drift_law(records[records.experiment != experiment])
    step, observed, n = _final(test)
    return HeldOut(experiment, observed, law.predict(f"held-out {experiment}", step, n_runs=n, **_setting(test)), n)


def _coverage_row(check: str, g: pd.DataFrame, p: Prediction, measured: float, step: int, runs: int) -> dict:
    row = {"check": check, **{c: float(g[c].iloc[0]) for c in CONFIG},
           "experiments": ",".join(sorted(g.experiment.unique())), "runs": runs, "step": step, "measured": measured}
    for law in LAWS:
        v = p.by_law.get(law, (math.nan,) * 3)
        row[law], row[f"{law}_low"], row[f"{law}_high"] = v
        row[f"{law}_inside"] = bool(v[1] <= measured <= v[2]) if math.isfinite(v[1]) else None
    lo, hi = p.band
    row["band_low"], row["band_high"] = lo, hi
    row["inside"] = bool(lo <= measured <= hi) if math.isfinite(lo) else None
    row["measured_over_power"] = measured / row["power"]
    row["reason"] = p.reason
    return row


def _finals(records: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: its first record (for the setting), mean last step, mean ‖H_K‖ at each
    run's last logged step, runs."""
    last = records.loc[records.groupby("run")["step"].idxmax()]
    return last.groupby(list(CONFIG), sort=True).agg(step=("step", "mean"), measured=("norm_K", "mean"),
                                                     runs=("run", "nunique")).reset_index()


def leave_one_configuration_out(records: pd.DataFrame) -> pd.DataFrame:
    """For each configuration: the law fitted without its runs, its final ‖H_K‖ predicted as an
    unseen configuration's."""
    rows = []
    a = _Arrays.of(records)
    for f in _finals(records).to_dict("records"):
        setting = {c: f[c] for c in CONFIG}
        own = np.all(a.cfg == np.array(config_key(setting)), axis=1)
        step, n = int(round(f["step"])), int(f["runs"])
        try:
            p = _law(a.subset(~own)).predict("loco", step, n_runs=n, **setting)
        except DriftLawError as e:
            p = Prediction("loco", setting, step, reason=str(e))
        rows.append(_coverage_row("leave-one-configuration-out", records.loc[own], p, f["measured"], step, n))
    return pd.DataFrame(rows)


def time_split(logs: pd.DataFrame, condition_id: str = DRIFTING, fraction: float = TIME_SPLIT) -> pd.DataFrame:
    """The law fitted on each run's steps up to `fraction` of its last step; each configuration's
    final ‖H_K‖ (its runs' last logged step) predicted from it (a seen configuration)."""
    full, early = fit_records(logs, condition_id), fit_records(logs, condition_id, until=fraction)
    law = fit_drift_law(early)
    rows = []
    cfg = full[list(CONFIG)].to_numpy(float)
    for f in _finals(full).to_dict("records"):
        setting = {c: f[c] for c in CONFIG}
        step, n = int(round(f["step"])), int(f["runs"])
        g = full.loc[np.all(cfg == np.array(config_key(setting)), axis=1)]
        rows.append(_coverage_row("time-split", g, law.predict("time split", step, n_runs=n, **setting),
                                  f["measured"], step, n))
    return pd.DataFrame(rows)


def coverage(logs: pd.DataFrame, condition_id: str = DRIFTING) -> pd.DataFrame:
    """Both checks' rows (drift_law_coverage.csv)."""
    return pd.concat([leave_one_configuration_out(fit_records(logs, condition_id)), time_split(logs, condition_id)],
                     ignore_index=True)


def coverage_counts(cov: pd.DataFrame, check: str, column: str = "inside") -> tuple[int, int, int]:
    """(inside, predicted, not predicted) of one check."""
    c = cov[cov.check == check][column]
    done = c.dropna()
    return int(done.astype(bool).sum()), int(len(done)), int(len(c) - len(done))


def per_configuration(law: DriftLaw) -> pd.DataFrame:
    """How well the one law holds per configuration: its own time exponent (the mean of its runs'
    power-law exponents), the measured final ‖H_K‖ (mean over its runs at their last logged step)
    and what each law's regression says there. A shared time exponent is the law's strongest
    assumption; this is where to see it fail."""
    own = law.own_exponents
    rows = []
    for key, g in law.records.groupby(list(CONFIG), sort=True):
        step, measured, n = _final(g)
        s = _setting(g)
        row = {**s, "experiments": ",".join(sorted(g.experiment.unique())), "runs": n, "step": step,
               "own_time_exponent": own.get(config_key(s), math.nan), "measured": measured}
        for name, f in law.fits.items():
            pred = f.predict(step, **s)
            row[name] = pred
            row[f"{name}_ratio"] = measured / pred
        rows.append(row)
    return pd.DataFrame(rows)


def paper_predictions(law: DriftLaw) -> list[Prediction]:
    steps = PAPER_TARGETS()
    return [law.predict(name, steps[name], **{c: m[c] for c in CONFIG}) for name, m in paper.PAPER_MODELS.items()]


# ---------------------------------------------------------------------------
# pre-registration: predictions for settings before they run, and their check
# ---------------------------------------------------------------------------
PREREG_FIELDS = ("experiment", "size", "step", "point", "lo", "hi", "law_commit")


def _normalise_setting(raw: dict, where: str) -> dict:
    """A setting's names mapped onto CONFIG (SETTING_KEYS); `step`, `runs`, `experiment`, `size` kept."""
    out: dict = {}
    for k, v in raw.items():
        k = str(k).strip()
        if k in ("experiment", "size"):
            out[k] = str(v)
            continue
        name = SETTING_KEYS.get(k, k if k in ("step", "runs") else None)
        if name is None:
            raise DriftLawError(f"{where}: unknown setting {k!r} (use {', '.join(sorted(set(SETTING_KEYS)))}, "
                                "step, runs, experiment, size)")
        try:
            out[name] = float(v)
        except (TypeError, ValueError):
            raise DriftLawError(f"{where}: {k} = {v!r} is not a number") from None
        if not out[name] > 0:
            raise DriftLawError(f"{where}: {k} = {v!r} is not positive")
    missing = [c for c in CONFIG + ("step",) if c not in out]
    if missing:
        raise DriftLawError(f"{where}: the setting lacks {', '.join(missing)}")
    return out


def parse_setting(text: str, step: Optional[float] = None) -> dict:
    """'d=64,layers=2,lr=1e-3,seq=64,batch=16' (and `step`) -> a normalised setting."""
    raw: dict = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise DriftLawError(f"--setting {text!r}: {part!r} is not name=value")
        raw[k.strip()] = v.strip()
    if step is not None:
        raw["step"] = step
    return _normalise_setting(raw, f"--setting {text!r}")


def read_settings(path) -> list[dict]:
    """A YAML list of settings (each a mapping with d, layers, lr, seq, batch, step; optionally runs,
    experiment, size), or a mapping with the list under `settings`."""
    import yaml
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise DriftLawError(f"{p}: no such file") from None
    except yaml.YAMLError as e:
        raise DriftLawError(f"{p}: not readable YAML ({getattr(e, 'problem', None) or type(e).__name__})") from None
    items = doc.get("settings") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items or not all(isinstance(x, dict) for x in items):
        raise DriftLawError(f"{p}: expected a list of settings (mappings), or one under `settings`")
    return [_normalise_setting(x, f"{p} item {i}") for i, x in enumerate(items)]


def predict_settings(law: DriftLaw, settings: list[dict], law_commit: Optional[str] = None) -> pd.DataFrame:
    """Point (the power law) and 95% interval (spanning both laws) for each setting, one row each,
    with the fields a preregistration.yaml's `drift_predictions` takes."""
    if law_commit is None:
        from ..io import git_commit
        law_commit = git_commit() or "unknown"
    rows = []
    for s in settings:
        cfg = {c: s[c] for c in CONFIG}
        n = int(s.get("runs", NEW_RUNS))
        label = ", ".join(f"{k} {cfg[k]:g}" for k in CONFIG)
        p = law.predict(label, int(s["step"]), n_runs=n, **cfg)
        lo, hi = p.band
        row = {"experiment": s.get("experiment", ""), "size": s.get("size", ""), "step": int(s["step"]), **cfg,
               "runs": n, "point": p.point, "lo": lo, "hi": hi}
        for lw in LAWS:
            row[lw], row[f"{lw}_low"], row[f"{lw}_high"] = p.by_law.get(lw, (math.nan,) * 3)
        row.update(seen=p.seen, note=p.note, reason=p.reason, law_commit=law_commit)
        rows.append(row)
    return pd.DataFrame(rows)


def predictions_yaml(table: pd.DataFrame) -> str:
    """`drift_predictions:` entries of a preregistration.yaml for the rows of predict_settings."""
    import yaml
    items = []
    for r in table.itertuples():
        item = {"experiment": r.experiment, "size": r.size, "step": int(r.step)}
        item.update({k: float(f"{getattr(r, k):.6g}") for k in ("point", "lo", "hi")})
        item["law_commit"] = r.law_commit
        item["setting"] = ", ".join(f"{c} {getattr(r, c):g}" for c in CONFIG) + f", runs {r.runs}"
        if r.note:
            item["note"] = r.note
        items.append(item)
    return yaml.safe_dump({"drift_predictions": items}, sort_keys=False, allow_unicode=True)


def read_preregistrations(studies_dir) -> list[dict]:
    """Every studies/*/preregistration.yaml's `drift_predictions`, each with its `study` (the folder)."""
    import yaml
    out = []
    for f in sorted(Path(studies_dir).glob("*/preregistration.yaml")):
        try:
            doc = yaml.safe_load(f.read_text()) or {}
        except yaml.YAMLError as e:
            raise DriftLawError(f"{f}: not readable YAML ({getattr(e, 'problem', None) or type(e).__name__})") \
                from None
        items = doc.get("drift_predictions") if isinstance(doc, dict) else None
        if items is None:
            continue
        if not isinstance(items, list):
            raise DriftLawError(f"{f}: drift_predictions is not a list")
        for i, x in enumerate(items):
            missing = [k for k in PREREG_FIELDS if not isinstance(x, dict) or x.get(k) is None]
            if missing:
                raise DriftLawError(f"{f}: drift_predictions[{i}] lacks {', '.join(missing)}")
            try:
                vals = {k: float(x[k]) for k in ("step", "point", "lo", "hi")}
            except (TypeError, ValueError):
                raise DriftLawError(f"{f}: drift_predictions[{i}] has a step, point, lo or hi that is not a number") \
                    from None
            out.append({"study": f.parent.name, "experiment": str(x["experiment"]), "size": str(x["size"]),
                        **vals, "step": int(vals["step"]), "law_commit": str(x["law_commit"])})
    return out


def measure_preregistered(pred: dict, results_root, condition_id: str = DRIFTING) -> dict:
    """What results/<experiment>/train_norms.csv measured for one pre-registered prediction: the
    mean over the size's runs of ‖H_K‖ at the logged step within MATCH_STEP of the predicted one."""
    p = Path(results_root) / pred["experiment"] / "train_norms.csv"
    row = dict(pred, measured=math.nan, logged_step=math.nan, runs=0, verdict="")
    if not p.is_file():
        row["verdict"] = f"not measured yet (no {p})"
        return row
    df = pd.read_csv(p)
    df = df[(df.condition_id == condition_id) & (df["size"].astype(str) == pred["size"])]
    if df.empty:
        row["verdict"] = f"not measured yet (no {pred['size']} runs of {condition_id} in {p})"
        return row
    near = df.loc[(df.step - pred["step"]).abs().groupby(df.run).idxmin()]
    near = near[(near.step - pred["step"]).abs() <= MATCH_STEP * pred["step"]]
    if near.empty:
        row["verdict"] = f"not measured yet (logged up to step {int(df.step.max()):,})"
        return row
    m = float(near.norm_K.mean())
    row.update(measured=m, logged_step=int(round(near.step.mean())), runs=int(near.run.nunique()),
               verdict="inside" if pred["lo"] <= m <= pred["hi"] else "outside")
    return row


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
    row = {"target": p.name, "step": p.step, **p.setting, "seen": p.seen}
    for law in LAWS:
        row[law], row[f"{law}_low"], row[f"{law}_high"] = p.by_law.get(law, (math.nan,) * 3)
    row["band_low"], row["band_high"] = p.band
    row["note"], row["reason"] = p.note, p.reason
    return row


def _interval_text(lo: float, hi: float) -> str:
    return f"{num(lo)} – {num(hi)}" if math.isfinite(lo) else "—"


def _cfg_text(r) -> str:
    return f"d {r['d_model']:g}, {r['n_layers']:g}L, lr {r['lr']:g}, {r['seq_len']:g}×{r['batch_size']:g}"


def _count_text(cov: pd.DataFrame, check: str) -> str:
    k, n, m = coverage_counts(cov, check)
    per = ", ".join(f"{law} law alone {coverage_counts(cov, check, f'{law}_inside')[0]} of "
                    f"{coverage_counts(cov, check, f'{law}_inside')[1]}" for law in LAWS)
    return f"**{k} of {n} inside** the 95% band ({per})" + (f"; {m} not predicted" if m else "")


def _tokens_text(law: DriftLaw) -> str:
    r = law.records
    combos = r[["seq_len", "batch_size", "tokens"]].drop_duplicates().sort_values("tokens")
    used = ", ".join(f"{c.seq_len:g} × {c.batch_size:g} = {c.tokens:,.0f}" for c in combos.itertuples())
    paper_tok = ", ".join(f"{n} {m['seq_len'] * m['batch_size']:,}" for n, m in paper.PAPER_MODELS.items())
    if "tokens" in law.factors:
        return (f"Tokens per step (context × batch, each run's own config): the runs use {used}; it enters the law "
                f"as a factor (the paper: {paper_tok}).")
    why = ("every run has the same tokens per step" if combos.tokens.nunique() == 1 else
           "the configurations that vary it do not vary it independently of width, depth and lr")
    return (f"Tokens per step (context × batch, each run's own config): the runs use {used} — {why}, so the data "
            f"cannot identify its effect and the law omits it; a prediction at other tokens per step (the paper: "
            f"{paper_tok}) assumes it has none and says so. Runs at another context (e.g. params.yaml's "
            f"cpu_factorial ctx128) enter it once their train_norms.csv is among --results.")


def report(results_dirs, out_dir, holdout: Optional[str] = None, condition_id: str = DRIFTING,
           studies_dir="studies", results_root="results") -> str:
    """Fit the law on the experiments' logs; write drift_law.{csv,md,png}, drift_law_configs.csv and
    drift_law_coverage.csv; returns the Markdown. Every input is read and checked before anything is written."""
    out = Path(out_dir)
    logs = read_logs(results_dirs)
    records = fit_records(logs, condition_id)
    prereg = [measure_preregistered(x, results_root, condition_id) for x in read_preregistrations(studies_dir)]
    rows = []
    ho = None
    if holdout:
        ho = held_out_check(records, holdout)
        rows.append({**_pred_row(ho.prediction), "kind": "held-out", "observed": ho.observed})
    law = fit_drift_law(records)
    preds = paper_predictions(law)
    rows += [{**_pred_row(p), "kind": "paper", "observed": v}
             for p, v in zip(preds, paper.NORM_K_PER_LOOP_RMSNORM.values())]
    for r in rows:
        r["observed_over_power"] = r["observed"] / r["power"]
        r["observed_over_log"] = r["observed"] / r["log"]
    cov = coverage(logs, condition_id)
    cfg = per_configuration(law)
    pw, lg = law.fits["power"], law.fits["log"]
    exps = sorted(records.experiment.unique())
    lines = ["# The drift law across experiments\n"]
    lines.append(f"Condition `{condition_id}`; {records.run.nunique()} runs of {len(exps)} experiment(s) "
                 f"({', '.join(exps)}), {pw.n_configs} configuration(s) (width, depth, lr, context, batch); "
                 f"{len(records)} log records from {FIT_FROM_FRACTION:g} × each run's last step on. Factors the "
                 f"configurations identify: {', '.join(law.factors) or 'none (time only)'}.\n")
    lines.append(_tokens_text(law) + "\n")
    lines.append(md_table(["law", "fit", "R² (ln ‖H_K‖, records)", "sd between configurations (df)",
                           "configurations' own exponents: sd (df)"],
                          [[f.law, f"`{f.formula()}`", f"{f.r2:.3f}", f"{math.sqrt(f.s2):.3f} ({f.df})"
                            if f.df > 0 else f"— ({f.df})", f"{f.slope_sd:.3f} ({f.n_configs - 1})"]
                           for f in law.fits.values()]))
    lines.append(
        f"\n**Intervals** (95%, for the mean of {NEW_RUNS} new runs unless said, in ln ‖H_K‖): the law is fitted "
        f"in two stages — per run a line in the time feature through its records, its level at step "
        f"{pw.t_ref:,.0f} (the median of the configurations' last logged steps) and its slope; then the "
        f"{pw.n_configs} configurations' mean levels regressed on the factors by ordinary least squares, the "
        f"shared time exponent being the mean of the configurations' own. An unseen configuration's interval is "
        f"the OLS prediction interval of that regression (residual sd {math.sqrt(pw.s2) if pw.df > 0 else math.nan:.3f}"
        f" with {pw.df} degrees of freedom, leverage x0ᵀ(XᵀX)⁻¹x0); a seen configuration's is for its own mean "
        f"level (sd between runs of a configuration {pw.run_sd:.3f}, {pw.df_run} df, × √(1/n_j + 1/n)). "
        f"Extrapolation in time adds a random slope: the variance of the configurations' own exponents "
        f"(power: sd {pw.slope_sd:.3f}; log: {lg.slope_sd:.3f} per ln ln t) × (1 + 1/{pw.n_configs}) × "
        f"(τ(t) − τ({pw.t_ref:,.0f}))², τ = ln t or ln ln t; a single logged record's scatter about its run's "
        f"line (sd {pw.rec_sd:.3f}) / n adds last. The parts are summed and the t quantile taken at their "
        f"Welch–Satterthwaite degrees of freedom; the band spans both laws' intervals.\n")
    # coverage
    lines.append("\n## Coverage of the 95% band\n")
    lines.append(f"- Leave one configuration out (fit without it, predict its runs' mean ‖H_K‖ at their last "
                 f"logged step as an unseen configuration): {_count_text(cov, 'leave-one-configuration-out')}.")
    lines.append(f"- Time split (fit on each run's steps up to {TIME_SPLIT:g} × its last step, from "
                 f"{FIT_FROM_FRACTION:g} × that on; predict the last step, a seen configuration): "
                 f"{_count_text(cov, 'time-split')}.\n")
    crow = []
    for r in cov.to_dict("records"):
        verdict = "—" if r["inside"] is None else ("inside" if r["inside"] else "outside")
        crow.append([r["check"], _cfg_text(r), r["runs"], f"{r['step']:,}", num(r["measured"]), num(r["power"]),
                     num(r["log"]), _interval_text(r["band_low"], r["band_high"]),
                     f"{r['measured_over_power']:.2f}×" if math.isfinite(r["measured_over_power"]) else "—",
                     verdict if not r["reason"] else f"not predicted: {r['reason']}"])
    lines.append(md_table(["check", "configuration", "runs", "step", "measured ‖H_K‖", "power", "log",
                           "95% band", "measured / power", "verdict"], crow))
    if ho is not None:
        lo, hi = ho.prediction.band
        verdict = ("inside" if ho.inside else "outside") if ho.inside is not None else "not predicted"
        lines.append(f"\n**Held-out check** (fitted without `{holdout}`, then predicted): its {ho.n_runs} run(s) "
                     f"measured ‖H_K‖ = {num(ho.observed)} at step {ho.prediction.step:,}; predicted power "
                     f"{num(ho.prediction.by_law.get('power', (math.nan,))[0])}, log "
                     f"{num(ho.prediction.by_law.get('log', (math.nan,))[0])}, 95% band {_interval_text(lo, hi)} — "
                     f"**{verdict}** the band"
                     + (f" (measured / power point {ho.observed / ho.prediction.point:.2f}×)"
                        if math.isfinite(ho.prediction.point) else "") + ".\n")
    lines.append(f"\n## Per configuration\n\nThe law's shared time exponent: power {pw.slope:.3f} (the mean of the "
                 "configurations' own, each the mean of its runs' exponents); measured = mean over its runs at "
                 "their last logged step; the laws' values are the regression's, not the configuration's own level.\n")
    lines.append(md_table(
        ["d", "layers", "lr", "seq × batch", "runs", "step", "own time exponent", "measured ‖H_K‖", "power law",
         "log law", "measured / power"],
        [[f"{c.d_model:g}", f"{c.n_layers:g}", f"{c.lr:g}", f"{c.seq_len:g} × {c.batch_size:g}", c.runs,
          f"{c.step:,}", f"{c.own_time_exponent:+.3f}", num(c.measured), num(c.power), num(c["log"]),
          f"{c.power_ratio:.2f}×"] for _, c in cfg.iterrows()]))
    prow = []
    for p, (name, v) in zip(preds, paper.NORM_K_PER_LOOP_RMSNORM.items()):
        lo, hi = p.band
        if p.reason:
            prow.append([name, f"{p.step:,}", _cfg_text(p.setting), f"not predicted: {p.reason}", "—", "—",
                         f"{v:,}", "—", "—", "—"])
            continue
        prow.append([name, f"{p.step:,}", _cfg_text(p.setting), num(p.by_law["power"][0]), num(p.by_law["log"][0]),
                     _interval_text(lo, hi), f"{v:,}", f"{v / p.by_law['power'][0]:.2f}×",
                     f"{v / p.by_law['log'][0]:.2f}×",
                     "—" if not math.isfinite(lo) else ("inside" if lo <= v <= hi else "outside")])
    lines.append("\n## The paper's models\n")
    lines.append(md_table(["model", "steps", "setting", "power point", "log point", "95% band", "paper ‖H_K‖",
                           "paper / power", "paper / log", "paper vs band"], prow))
    lines.append(f"\nUnseen configurations, {NEW_RUNS} runs. Steps: the paper's token stream "
                 f"({paper.WIKITEXT103_TRAIN_WORDS:,} WikiText-103 words × ≈{paper.PAPER_TOKENS_PER_WORD} tokens per "
                 f"word), 4 epochs of 257-token windows every 128 tokens. An extrapolation over one to two orders of "
                 f"magnitude in steps and width, not a measurement.\n")
    for p in preds:
        if p.note:
            lines.append(f"- {p.name} {p.note}.")
    lines.append("\n## Pre-registered predictions vs measured\n")
    if not prereg:
        lines.append(f"None: no {Path(studies_dir) / '*' / 'preregistration.yaml'} with `drift_predictions`.\n")
    else:
        lines.append(f"Every `drift_predictions` entry of {Path(studies_dir) / '*' / 'preregistration.yaml'}; measured "
                     f"= mean over the size's runs of `{condition_id}` of ‖H_K‖ at the logged step within "
                     f"{MATCH_STEP:.0%} of the predicted one, from {Path(results_root)}/<experiment>/train_norms.csv.\n")
        lines.append(md_table(
            ["study", "experiment", "size", "step", "predicted", "95% interval", "law commit", "measured", "verdict"],
            [[x["study"], x["experiment"], x["size"], f"{x['step']:,}", num(x["point"]),
              _interval_text(x["lo"], x["hi"]), x["law_commit"][:10], num(x["measured"]), x["verdict"]]
             for x in prereg]))
        k = sum(x["verdict"] == "inside" for x in prereg)
        n = sum(x["verdict"] in ("inside", "outside") for x in prereg)
        lines.append(f"\n{k} of {n} measured inside their pre-registered interval; {len(prereg) - n} not measured yet.\n")
    from .. import __version__
    from ..io import atomic_write_text, git_commit
    cmd = ("loopscale report drift-law --results " + " ".join(str(d) for d in results_dirs)
           + (f" --holdout {holdout}" if holdout else "") + f" --out {out_dir}")
    lines.append(f"\nMade by `{cmd}` (loopscale {__version__}, git commit {git_commit() or 'unknown'}).\n")
    md = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "drift_law.md", md)
    atomic_write_text(out / "drift_law.csv", pd.DataFrame(rows).to_csv(index=False))
    atomic_write_text(out / "drift_law_configs.csv", cfg.to_csv(index=False))
    atomic_write_text(out / "drift_law_coverage.csv", cov.to_csv(index=False))
    _figure(law, preds, ho, out / "drift_law.png")
    return md


def _figure(law: DriftLaw, preds: list, ho: Optional[HeldOut], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8), layout="constrained")
    r = law.records
    cmap = plt.get_cmap("viridis")
    groups = list(r.groupby(list(CONFIG), sort=True))
    for i, (key, g) in enumerate(groups):
        col = cmap(i / max(1, len(groups) - 1))
        s = dict(zip(CONFIG, map(float, key)))
        ax.scatter(g.step, g.norm_K, s=5, color=col, alpha=0.4, lw=0)
        t = np.geomspace(g.step.min(), max(PAPER_TARGETS().values()), 60)
        ax.plot(t, [law.fits["power"].predict(x, **s) for x in t], color=col, lw=1.3,
                label=f"d {s['d_model']:g}, {s['n_layers']:g}L, lr {s['lr']:g}, {s['seq_len']:g}×{s['batch_size']:g}")
        ax.plot(t, [law.fits["log"].predict(x, **s) for x in t], color=col, lw=1.0, ls="--")
    for p, (name, v) in zip(preds, paper.NORM_K_PER_LOOP_RMSNORM.items()):
        ax.plot([p.step], [v], marker="*", ms=13, color="k", mfc="w", ls="")
        ax.annotate(f"paper {name}: {v:,}", (p.step, v), xytext=(-8, 6), textcoords="offset points", ha="right",
                    fontsize=8)
        lo, hi = p.band
        if math.isfinite(lo):
            ax.errorbar([p.step], [p.point], yerr=[[p.point - lo], [hi - p.point]], color="C3", capsize=4, lw=1.4,
                        marker="o", ms=4)
    if ho is not None and math.isfinite(ho.prediction.band[0]):
        lo, hi = ho.prediction.band
        pt = ho.prediction.point
        ax.errorbar([ho.prediction.step], [pt], yerr=[[pt - lo], [hi - pt]], color="C1", capsize=4, lw=1.4, ls="")
        ax.plot([ho.prediction.step], [ho.observed], marker="D", color="C1", ls="", label=f"held out: {ho.experiment}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training step (log)")
    ax.set_ylabel("‖H_K‖ on the training batch (log)")
    ax.set_title("Drift law across experiments (solid: power, dashed: log law; red: power point and 95% band\n"
                 "at the paper's targets, spanning both laws, with the spread of time exponents)", fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def train_norms_frame(runs) -> pd.DataFrame:
    """The per-run training logs every experiment's report writes (`train_norms.csv`); width,
    depth, lr, context (model.seq_len) and batch (train.batch_size) from each run's own config."""
    from .groups import training_norms
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
