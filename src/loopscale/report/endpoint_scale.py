"""The endpoint-scale story (official endpoint_scale_story_metrics.py): each run placed by loss placement × scale
visibility, the correlations and 2×2 means over the runs, and table `story`. Method: docs/diagnostics.md, "story".
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import pandas as pd

from ..registry import Condition
from .groups import Group, Table, excluded_note, group_ids, join_notes, exits, radial_loops, stat_columns, stats
from .markdown import md_table, num, pm
from .runs import Run, finite

RADIAL_FLOOR = 1e-12  # the official floor before log10
GAP_USABLE = 1.0  # official quadrant thresholds: usable exits, CE gap <= 1 nat
LOG10_NORM_CONTROLLED = 2.0  # controlled scale: ||H_K|| <= 10^2

CORE = tuple((r, l, "none", "residual") for l in ("terminal", "per_loop") for r in ("rmsnorm", "raw"))
CONTROLS = (("final_norm", "per_loop", "none", "residual"), ("rmsnorm", "terminal", "norm_penalty", "residual"))
SETS = {"core_2x2": CORE, "core_plus_controls": CORE + CONTROLS, "all": None}


def per_loop(cond: Condition) -> bool:
    """Dense supervision: the loss reads every exit (the official `endpoint_trained`)."""
    return cond.loss == "per_loop"


def scale_visible(cond: Condition) -> bool:
    """The loss can see ‖H‖: some exit is read without a norm, or a norm penalty acts."""
    return not cond.scale_invariant_readout or cond.regularizer == "norm_penalty"


def story_point(run: Run) -> Optional[dict]:
    """The story's numbers of one completed run; None without exits or a positive ‖H_K‖."""
    if not run.completed:
        return None
    ex, _ = exits(run)
    if not ex:
        return None
    p1, pk, nk = ex[0].get("ppl"), ex[-1].get("ppl"), ex[-1].get("norm")
    if not (finite(p1) and finite(pk) and p1 > 0 and pk > 0 and finite(nk) and nk > 0):
        return None
    rad = radial_loops(run) or []
    rk = max(rad, key=lambda r: r.get("k", 0)).get("radial_fraction") if rad else None
    rk = rk if finite(rk) else math.nan
    return {"ppl_1": p1, "ppl_K": pk, "ce_gap": math.log(p1) - math.log(pk), "norm_K": nk, "r_K": rk,
            "log10_norm_K": math.log10(nk),
            "log10_r_K": math.log10(max(rk, RADIAL_FLOOR)) if finite(rk) else math.nan,
            "per_loop": per_loop(run.condition), "scale_visible": scale_visible(run.condition)}


def _defined(xs: list[float], ys: list[float]) -> bool:
    """A correlation needs 2 points or more and neither variable constant (else NaN)."""
    return len(xs) >= 2 and len(set(xs)) > 1 and len(set(ys)) > 1


def pearson(xs: list[float], ys: list[float]) -> float:
    """scipy's Pearson r; NaN for fewer than 2 points or a constant variable. scipy is the
    pipeline extra's, imported here."""
    from scipy.stats import pearsonr
    return float(pearsonr(xs, ys).statistic) if _defined(xs, ys) else math.nan


def spearman(xs: list[float], ys: list[float]) -> float:
    """scipy's Spearman ρ (ties at their average rank); NaN as `pearson`."""
    from scipy.stats import spearmanr
    return float(spearmanr(xs, ys).statistic) if _defined(xs, ys) else math.nan


def _mean(v: Iterable[float]) -> float:
    v = [x for x in v if finite(x)]
    return math.fsum(v) / len(v) if v else math.nan


def story_summary(points: list[tuple[Condition, dict]]) -> dict:
    """Correlations and the 2×2 means over each set of SETS (points: (condition, story_point))."""
    out = {}
    for name, bases in SETS.items():
        sel = [p for c, p in points if bases is None or c.base in bases]
        xy = [(p["log10_r_K"], p["log10_norm_K"]) for p in sel if finite(p["log10_r_K"])]
        xs, ys = [x for x, _ in xy], [y for _, y in xy]
        out[name] = {
            "n": len(sel), "n_with_radial": len(xy),
            "pearson_log_radial_vs_log_norm": pearson(xs, ys), "spearman_log_radial_vs_log_norm": spearman(xs, ys),
            "mean_ce_gap_by_per_loop": {str(f): _mean(p["ce_gap"] for p in sel if p["per_loop"] == f)
                                        for f in (False, True)},
            "mean_log10_norm_by_scale_visible": {str(f): _mean(p["log10_norm_K"] for p in sel
                                                               if p["scale_visible"] == f) for f in (False, True)}}
    return out


def story_points(groups: list[Group]) -> list[tuple[Condition, dict]]:
    return [(g.cond, p) for g in groups for r in g.used if (p := story_point(r)) is not None]


_KEYS = ("ppl_1", "ppl_K", "ce_gap", "norm_K", "r_K")


def story_table(groups: list[Group]) -> Table:
    rows, md_rows = [], []
    for g in groups:
        pts = [p for r in g.used if (p := story_point(r)) is not None]
        row = {**group_ids(g), "per_loop": per_loop(g.cond), "scale_visible": scale_visible(g.cond), "n": len(pts)}
        cells = []
        for key in _KEYS:
            s = stats(p[key] for p in pts)
            row.update(stat_columns(key, s))
            cells.append(pm(*s, kind="sci" if key == "r_K" else "auto", n_row=len(pts)))
        rows.append(row)
        md_rows.append([g.size.label, g.cond.label, "✓" if per_loop(g.cond) else "—",
                        "✓" if scale_visible(g.cond) else "—", f"{len(pts)}/{len(g.runs)}", *cells])
    md = md_table(["Size", "Condition", "Per-loop CE", "Scale-visible", "n", "K=1 PPL", "K PPL", "CE gap (nats)",
                   "‖H_K‖", "r_K"], md_rows)
    summ = story_summary(story_points(groups))
    s_rows = [[name, str(v["n"]), num(v["pearson_log_radial_vs_log_norm"]), num(v["spearman_log_radial_vs_log_norm"]),
               " / ".join(num(v["mean_ce_gap_by_per_loop"][f]) for f in ("False", "True")),
               " / ".join(num(v["mean_log10_norm_by_scale_visible"][f]) for f in ("False", "True"))]
              for name, v in summ.items()]
    md += "\n" + md_table(["Runs", "n", "Pearson log r_K vs log ‖H_K‖", "Spearman", "mean CE gap: terminal / per-loop",
                           "mean log10 ‖H_K‖: scale-invariant / scale-visible"], s_rows)
    md += join_notes("\nThe paper's loss-placement × scale-visibility decomposition (official "
                 "endpoint_scale_story_metrics.py). CE gap = CE(exit 1) − CE(exit K). r_K: radial gradient fraction "
                 "at exit K (the official table's r_K), not ‖H_K‖. Scale-visible: raw or final-only readout, or a "
                 "norm penalty. Correlations: one point per run, log10 r_K floored at 1e-12; core_2x2 = terminal/"
                 "per-loop × RMSNorm/raw, controls = per-loop final-only norm and terminal norm penalty.\n",
                 excluded_note(groups))
    return Table("story", "Endpoint-scale story (loss placement × scale visibility)", pd.DataFrame(rows), md)


def json_safe(x):
    """NaN (an undefined correlation or mean) as null, so story_summary.json stays strict JSON."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return None if isinstance(x, float) and not math.isfinite(x) else x
