"""The dose-response claims (studies/cpu_dose): does scale control cause depth use?

The arms, the per-run quantities and the rules D1–D4: docs/studies.md, "The dose rules".
"""
from __future__ import annotations

import math

import pandas as pd

from .groups import stats
from .endpoint_scale import spearman
from .claims import EVIDENCE, NOT_REPRODUCED, NOT_RUN, REPRODUCED, ClaimResult, combine
from .markdown import md_table, num
from .records import RunRecord
from .runs import finite

DOSE_NORM_RHO_MAX = -0.9  # (D1)
DOSE_TOP_LAMBDA = 0.1  # (D1): the largest λ of the study
DOSE_NORM_FRACTION_MAX = 0.1  # (D1): ‖H_K‖ at the largest λ at most a tenth of λ = 0's
DOSE_GAIN_RHO_MIN = 0.7  # (D2)
DOSE_MID_LAMBDA = 1e-2  # (D2), (D4): the paper's λ
DOSE_GAIN_RATIO_MIN = 2.0  # (D2)
DOSE_GAIN_MIN = 0.01  # (D2): at least 1% depth gain
DOSE_NORM_GAIN_RHO_MAX = -0.5  # (D3)
DOSE_PPL_RATIO_MAX = 0.99  # (D4): at least 1% lower PPL_K
DOSE_MIN_LEVELS = 3  # a rank correlation over fewer λ is not evaluated

PAPER = ("the paper's account: removing the scale from the readout's blind spot lets the model use depth "
         "(Table 1: norm penalty λ = 0.01 gains from depth, the drifting model does not)")
DOSE_COLUMNS = ["arm", "lambda", "seed", "status", "norm_K", "depth_gain", "ppl_1", "ppl_K"]


def _lam(r: RunRecord) -> float:
    return float(r.cond.penalty_weight) if r.cond.regularizer == "norm_penalty" else 0.0


def _norm_K(r: RunRecord) -> float:
    """‖H_K‖ of the norms diagnostic (the pre-registered quantity), else of the depth evaluation's exits."""
    if not r.completed:
        return math.nan
    v = r.last(r.norm_eval)
    return v if finite(v) else r.last(r.exit_norm)


def run_rows(records: list[RunRecord]) -> pd.DataFrame:
    """dose.csv: one row per run (λ, seed, ‖H_K‖, G, PPL_1, PPL_K)."""
    rows = []
    for r in records:
        ppl = r.exit_ppl if r.completed else []
        g = (ppl[0] - ppl[-1]) / ppl[0] if len(ppl) >= 2 and all(finite(p) for p in ppl) else math.nan
        rows.append({"arm": r.arm, "lambda": _lam(r), "seed": r.seed, "status": "completed" if r.completed else r.note,
                     "norm_K": _norm_K(r), "depth_gain": g,
                     "ppl_1": ppl[0] if ppl else math.nan, "ppl_K": r.last(ppl)})
    df = pd.DataFrame(rows, columns=DOSE_COLUMNS)
    return df.sort_values(["lambda", "seed"], kind="stable").reset_index(drop=True)


def _means(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df.status == "completed"]
    return ok.groupby("lambda")[["norm_K", "depth_gain", "ppl_K"]].agg(lambda v: stats(v)[0]).sort_index()


def _at(m: pd.DataFrame, lam: float, col: str) -> float:
    hit = [x for x in m.index if math.isclose(x, lam, rel_tol=1e-9, abs_tol=0.0)]
    return float(m.loc[hit[0], col]) if hit else math.nan


def _trend(rid: str, claim: str, rule: str, df: pd.DataFrame, col: str, lam: float, what: str):
    """(r, trend): r the rule's ClaimResult, still "not run"; trend the seed means of `col` by λ,
    ρ(λ, those means), the mean at `lam` and the mean at λ=0 — or None, with `r.ours` naming what is
    missing (too few λ, or no λ=0 or `lam`)."""
    r = ClaimResult(rid, claim, PAPER, "", NOT_RUN, rule)
    m = _means(df).dropna(subset=[col])
    at, zero = _at(m, lam, col), _at(m, 0.0, col)
    if len(m) < DOSE_MIN_LEVELS or not (finite(at) and finite(zero)):
        r.ours = f"missing: {len(m)} λ with {what} (need ≥ {DOSE_MIN_LEVELS}, with λ=0 and λ={lam:g})"
        return r, None
    return r, (m[col], spearman(list(m.index), list(m[col])), at, zero)  # ρ NaN (a constant input) fails the rule


def _pooled(df: pd.DataFrame) -> pd.DataFrame:  # the runs D3 pools: completed, with a positive ‖H_K‖ and a G
    return df[(df.status == "completed") & df.norm_K.gt(0) & df.depth_gain.notna()]


def rule_d1(df: pd.DataFrame) -> ClaimResult:
    rule = (f"ρ(λ, seed-mean ‖H_K‖) ≤ {DOSE_NORM_RHO_MAX:g} over the λ, and ‖H_K‖(λ={DOSE_TOP_LAMBDA:g}) ≤ "
            f"{DOSE_NORM_FRACTION_MAX:g} × ‖H_K‖(λ=0)")
    r, got = _trend("D1", "‖H_K‖ falls with the norm penalty's λ", rule, df, "norm_K", DOSE_TOP_LAMBDA, "‖H_K‖")
    if got is None:
        return r
    means, rho, top, zero = got
    r.ours = (f"ρ = {num(rho, decimals=2)} over {len(means)} λ; ‖H_K‖ " +
              ", ".join(f"λ={lam:g}: {num(v)}" for lam, v in means.items()) +
              f"; λ={DOSE_TOP_LAMBDA:g} / λ=0 = {num(top / zero, decimals=4)}")
    r.verdict = REPRODUCED if rho <= DOSE_NORM_RHO_MAX and top <= DOSE_NORM_FRACTION_MAX * zero else NOT_REPRODUCED
    return r


def rule_d2(df: pd.DataFrame) -> ClaimResult:
    rule = (f"G = (PPL_1 − PPL_K)/PPL_1; ρ(λ, seed-mean G) ≥ {DOSE_GAIN_RHO_MIN:g} over the λ, and "
            f"G(λ={DOSE_MID_LAMBDA:g}) ≥ max({DOSE_GAIN_RATIO_MIN:g} × G(λ=0), {DOSE_GAIN_MIN:g})")
    r, got = _trend("D2", "The depth gain rises with the norm penalty's λ", rule, df, "depth_gain", DOSE_MID_LAMBDA,
                    "a depth gain")
    if got is None:
        return r
    means, rho, mid, zero = got
    thr = max(DOSE_GAIN_RATIO_MIN * zero, DOSE_GAIN_MIN)
    r.ours = (f"ρ = {num(rho, decimals=2)} over {len(means)} λ; G " +
              ", ".join(f"λ={lam:g}: {num(v, 'spct')}" for lam, v in means.items()) +
              f"; threshold at λ={DOSE_MID_LAMBDA:g}: {num(thr, 'pct')}")
    r.verdict = REPRODUCED if rho >= DOSE_GAIN_RHO_MIN and mid >= thr else NOT_REPRODUCED
    return r


def rule_d3(df: pd.DataFrame) -> ClaimResult:
    rule = f"over every completed run (all λ, all seeds): ρ(ln ‖H_K‖, G) ≤ {DOSE_NORM_GAIN_RHO_MAX:g}"
    r = ClaimResult("D3", "Runs with a smaller ‖H_K‖ gain more from depth", PAPER, "", NOT_RUN, rule)
    ok = _pooled(df)
    if len(ok) < DOSE_MIN_LEVELS:
        r.ours = f"missing: {len(ok)} runs with ‖H_K‖ and G (need ≥ {DOSE_MIN_LEVELS})"
        return r
    rho = spearman([math.log(v) for v in ok.norm_K], list(ok.depth_gain))
    r.ours = f"ρ = {num(rho, decimals=2)} over {len(ok)} runs"
    r.verdict = REPRODUCED if rho <= DOSE_NORM_GAIN_RHO_MAX else NOT_REPRODUCED
    return r


def rule_d4(df: pd.DataFrame) -> ClaimResult:
    rule = f"PPL_K(λ={DOSE_MID_LAMBDA:g}) ≤ {DOSE_PPL_RATIO_MAX:g} × PPL_K(λ=0)"
    r = ClaimResult("D4", f"The paper's λ = {DOSE_MID_LAMBDA:g} lowers PPL_K", PAPER, "", NOT_RUN, rule)
    m = _means(df)
    mid, zero = _at(m, DOSE_MID_LAMBDA, "ppl_K"), _at(m, 0.0, "ppl_K")
    if not (finite(mid) and finite(zero)):
        r.ours = f"missing: PPL_K at λ=0 or λ={DOSE_MID_LAMBDA:g}"
        return r
    r.ours = f"PPL_K λ={DOSE_MID_LAMBDA:g}: {num(mid)} vs λ=0: {num(zero)} (ratio {mid / zero:.4f}, bound {DOSE_PPL_RATIO_MAX:g})"
    r.verdict = REPRODUCED if mid <= DOSE_PPL_RATIO_MAX * zero else NOT_REPRODUCED
    return r


RULES = (rule_d1, rule_d2, rule_d3, rule_d4)
PER_SEED = {"D1", "D2", "D4"}  # D3 pools every run


def evaluate(records: list[RunRecord], preregistered: str = "") -> tuple[list[ClaimResult], pd.DataFrame]:
    """The dose rules on the seed means and per seed, and dose.csv's frame; `preregistered` names
    the file the rules were fixed in (studies/<name>/preregistration.md)."""
    df = run_rows(records)
    sizes = sorted({r.size for r in records})
    arm = "λ ∈ {" + ", ".join(f"{x:g}" for x in sorted(set(df["lambda"]))) + "}"
    seeds = sorted({int(s) for s in df.loc[df.status == "completed", "seed"].dropna()})
    out = []
    for fn in RULES:
        r = fn(df)
        r.arm, r.size, r.kind = arm, "; ".join(sizes), EVIDENCE
        r.mean_verdict = r.verdict
        if r.id in PER_SEED:
            r.seed_verdicts = {s: fn(df[df.seed == s]).verdict for s in seeds}
            r.verdict = combine(r.mean_verdict, r.seed_verdicts)
        elif r.verdict != NOT_RUN:
            r.verdict = f"{r.verdict} (pooled over {len(_pooled(df))} runs)"
        r.amendment = f"pre-registered ({preregistered})" if preregistered else "not pre-registered"
        out.append(r)
    return out, df


def dose_markdown(results: list[ClaimResult], df: pd.DataFrame) -> str:
    m = df[df.status == "completed"].groupby("lambda").agg(
        n=("seed", "count"), norm_K=("norm_K", "mean"), depth_gain=("depth_gain", "mean"), ppl_K=("ppl_K", "mean"))
    rows = [[f"{lam:g}", str(int(v.n)), num(v.norm_K), num(v.depth_gain, "spct"), num(v.ppl_K)] for lam, v in m.iterrows()]
    table = md_table(["λ", "Seeds", "‖H_K‖", "G = (PPL_1 − PPL_K)/PPL_1", "PPL_K"], rows, align="lrrrr")
    rules = md_table(["Rule", "Ours", "Verdict", "Per seed", "Rule text"],
                     [[f"({r.id}) {r.claim}", r.ours, f"**{r.verdict}**", r.per_seed_text() or "pooled", r.rule]
                      for r in results])
    return f"Seed means per λ (dose.csv: every run):\n\n{table}\n{rules}\n{thresholds_text()}\n"


THRESHOLD_NAMES = ("DOSE_NORM_RHO_MAX", "DOSE_TOP_LAMBDA", "DOSE_NORM_FRACTION_MAX", "DOSE_GAIN_RHO_MIN",
                   "DOSE_MID_LAMBDA", "DOSE_GAIN_RATIO_MIN", "DOSE_GAIN_MIN", "DOSE_NORM_GAIN_RHO_MAX",
                   "DOSE_PPL_RATIO_MAX")


def thresholds_text() -> str:
    return "Thresholds: " + ", ".join(f"`{k}` = {globals()[k]:g}" for k in THRESHOLD_NAMES) + "."


def fig_dose(df: pd.DataFrame, path):
    """‖H_K‖ (log scale), G and PPL_K against λ (symlog x): every run, and the seed means joined."""
    from pathlib import Path
    from .figures import save_figure  # sets the Agg backend first
    import matplotlib.pyplot as plt
    ok = df[df.status == "completed"]
    m = ok.groupby("lambda")[["norm_K", "depth_gain", "ppl_K"]].mean().sort_index()
    lams = sorted(x for x in set(ok["lambda"]) if x > 0)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, col, label in zip(axes, ("norm_K", "depth_gain", "ppl_K"),
                              ("‖H_K‖", "depth gain G = (PPL_1 − PPL_K)/PPL_1", "PPL_K")):
        ax.scatter(ok["lambda"], ok[col], s=14, alpha=0.5, color="tab:gray", label="runs")
        ax.plot(m.index, m[col], "o-", color="tab:blue", label="seed mean")
        ax.set_xscale("symlog", linthresh=min(lams) if lams else 1e-4)
        ax.set_xlabel("norm-penalty λ")
        ax.set_ylabel(label)
        if col == "norm_K" and (ok[col] > 0).all() and len(ok):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Dose-response: per-loop CE + RMSNorm readout + norm penalty λ")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, Path(path))
