"""One tidy table of every run: one row per run × exit k, every value a number or a name.

    import pandas as pd
    df = pd.read_csv("results/cpu/per_seed.csv")
    df[df.status == "completed"].groupby(["readout", "loss", "k"]).ppl.agg(["mean", "std", "count"])

Every run given appears (K rows, values empty where the run did not finish or a diagnostic
is missing), so `status` tells which rows enter a mean.
"""
from __future__ import annotations

import math

import pandas as pd

from pathlib import Path
from typing import Optional

from .aggregate import Table, _rel, clamp_modes, depth_curve, exits, norm_loops, radial_loops
from .runs import Run, finite

# the columns, in order (tests/test_report.py checks this schema)
SIZE_COLUMNS = ["size", "params", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "vocab_size", "n_loops"]
CONDITION_COLUMNS = ["condition", "condition_id", "readout", "loss", "regularizer", "penalty_weight", "recurrence"]
RUN_COLUMNS = ["seed", "status", "steps", "tokens", "train_wall_time_s"]
VALUE_COLUMNS = ["k", "exit_readout", "ppl", "ce", "norm", "ppl_final_readout", "norm_eval", "radial_fraction",
                 "radial_mean_cos", "clamp_remove_radial_delta_ce", "clamp_freeze_loop1_delta_ce", "ppl_source",
                 "path"]
COLUMNS = SIZE_COLUMNS + CONDITION_COLUMNS + RUN_COLUMNS + VALUE_COLUMNS


def _by_k(rows, key) -> dict:
    return {int(r["k"]): r.get(key) for r in rows or [] if r.get("k") is not None}


def _num(v) -> float:
    return float(v) if finite(v) else math.nan


def run_rows(r: Run, root: Optional[Path] = None) -> list[dict]:
    s, c = r.size, r.condition
    K = s.n_loops or 0
    ex, src = exits(r) if r.completed else (None, "none")
    ppl, ce, nrm = _by_k(ex, "ppl"), _by_k(ex, "ce"), _by_k(ex, "norm")
    deep = _by_k(depth_curve(r) if r.completed else None, "ppl")
    ne = _by_k(norm_loops(r) if r.diag("norms") else None, "norm")
    rad = radial_loops(r) if r.completed else None
    rf, rc, rr = _by_k(rad, "radial_fraction"), _by_k(rad, "mean_cos"), _by_k(rad, "readout")
    cl = clamp_modes(r) if r.completed else None
    cl = cl or {}
    rm, fz = _by_k(cl.get("remove_radial"), "delta_ce"), _by_k(cl.get("freeze_loop1"), "delta_ce")
    base = {"size": s.label, "params": s.params, "d_model": s.d_model, "n_layers": s.n_layers, "n_heads": s.n_heads,
            "d_ff": s.d_ff, "seq_len": s.seq_len, "vocab_size": s.vocab_size, "n_loops": K,
            "condition": c.label, "condition_id": c.slug, "readout": c.readout, "loss": c.loss,
            "regularizer": c.regularizer, "penalty_weight": c.penalty_weight, "recurrence": c.recurrence,
            "seed": r.seed, "status": r.status, "steps": r.summary.get("steps"), "tokens": r.summary.get("tokens"),
            "train_wall_time_s": r.summary.get("wall_time_s")}
    out = []
    for k in range(1, K + 1):
        exit_readout = rr.get(k) or (("raw" if k < K else "rmsnorm") if c.readout == "final_norm" else c.readout)
        out.append({**base, "k": k, "exit_readout": exit_readout, "ppl": _num(ppl.get(k)), "ce": _num(ce.get(k)),
                    "norm": _num(nrm.get(k)), "ppl_final_readout": _num(deep.get(k)), "norm_eval": _num(ne.get(k)),
                    "radial_fraction": _num(rf.get(k)), "radial_mean_cos": _num(rc.get(k)),
                    "clamp_remove_radial_delta_ce": _num(rm.get(k)), "clamp_freeze_loop1_delta_ce": _num(fz.get(k)),
                    "ppl_source": src, "path": _rel(r.path, root)})
    return out


def per_seed_table(runs: list[Run], root: Optional[Path] = None) -> Table:
    rows = [row for r in runs for row in run_rows(r, root)]
    return Table("per_seed", "Every run × exit k (tidy)", pd.DataFrame(rows, columns=COLUMNS), "")
