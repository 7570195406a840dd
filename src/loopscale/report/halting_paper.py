"""Calibrated halting under the paper's protocol (Table 8): the `paper` part of eval/halting.json.

The paper calibrates the exit threshold in sample (official adaptive_halt_benchmark.py: the
same windows calibrate and benchmark) and times the dynamic-depth run against a fixed-depth
baseline that reads out every exit; loopscale's own protocol (the `halting` table) calibrates
on one half of the windows and reports the other. Sequence granularity, one row per policy.
"""
from __future__ import annotations

import math

import pandas as pd

from .aggregate import Group, Table, _excluded_note, _ids, _missing_note, _notes, stats
from .fmt import EMPTY, md_table, pm

_KEYS = ("threshold", "calib_dynamic_avg_loops", "calib_ppl_ratio", "bench_fixed_ppl", "bench_dynamic_ppl",
         "bench_dynamic_avg_loops", "bench_speedup")


def paper_halting(run) -> dict:
    """{policy: row} of the run's paper-protocol calibration ({} when absent)."""
    d = run.diag("halting")
    cal = ((d or {}).get("paper") or {}).get("calibrated")
    if not isinstance(cal, dict):
        return {}
    out = {}
    for p, c in cal.items():
        if isinstance(c, dict):
            f, dyn = c.get("calib_fixed_ppl"), c.get("calib_dynamic_ppl")
            ratio = dyn / f if isinstance(f, (int, float)) and isinstance(dyn, (int, float)) and f else math.nan
            out[p] = {**c, "calib_ppl_ratio": ratio}
    return out


def halting_paper_table(groups: list[Group]) -> Table:
    rows, md_rows = [], []
    for g in groups:
        per: dict = {}
        for r in g.used:
            for p, c in paper_halting(r).items():
                per.setdefault(p, []).append(c)
        for p in sorted(per):
            cs = per[p]
            row = {**_ids(g), "policy": p, "official_policy": cs[0].get("official_policy", p)}
            cells = {}
            for key in _KEYS:
                s = stats(c.get(key) for c in cs)
                row.update({f"{key}_mean": s[0], f"{key}_std": s[1], f"{key}_n": s[2]})
                cells[key] = pm(*s, kind="ratio" if key == "bench_speedup" else "auto", n_row=len(cs))
            rows.append(row)
            md_rows.append([g.size.label, g.cond.label, p, f"{len(cs)}/{len(g.runs)}"] + [cells[k] for k in _KEYS])
        if not per:
            md_rows.append([g.size.label, g.cond.label, EMPTY, f"0/{len(g.runs)}"] + [EMPTY] * len(_KEYS))
    md = md_table(["Size", "Condition", "Policy", "n", "threshold", "mean loops", "PPL ratio", "fixed PPL",
                   "dynamic PPL", "dynamic mean loops", "real speed-up"], md_rows)
    md += _notes("\nThe paper's halting protocol (Table 8; official adaptive_halt_benchmark.py): per window, the mean "
                 "token confidence after each loop k < K is compared with a threshold chosen among the quantiles of "
                 "those confidences so that PPL ≤ 1.01 · PPL at exit K with the fewest mean loops (ties: the lowest "
                 "threshold), calibrated in sample: the benchmark runs on the same windows. Fixed PPL: a full pass "
                 "that reads out every exit (the paper's baseline), scored at exit K; real speed-up: its wall clock "
                 "over the dynamic-depth run's. Compare the held-out protocol in the halting table.\n",
                 _missing_note(groups, "halting"), _excluded_note(groups))
    return Table("halting_paper", "Calibrated halting, paper protocol (in-sample)", pd.DataFrame(rows), md)
