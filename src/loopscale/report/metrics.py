"""results/<exp>/metrics.json: the headline numbers of every condition, for DVC.

One entry per size × condition (key `<size>/<condition id>`, e.g.
`267k/rmsnorm-per_loop-none-residual`) with the final-exit perplexity, ‖H_K‖ and the
radial gradient fraction at exit K (means over completed seeds, null where there is no
value), so that `dvc metrics show` / `dvc metrics diff` / `dvc exp show` compare runs.
Computed from the aggregate tables (main, radial) at the CSVs' precision (8 significant
digits), so it equals what main.csv and radial.csv say.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..io import atomic_write_json


def _value(x):
    if x is None or not math.isfinite(float(x)):
        return None
    return float(f"{float(x):.8g}")  # the precision of the CSV tables


def headline_metrics(dfs: dict) -> dict:
    """{"<size>/<condition id>": {"ppl_K", "norm_K", "radial_fraction_K", "seeds"}} from the
    tables' data frames by name ("main", "radial"; the DataFrames of main.csv, radial.csv)."""
    main, radial = dfs["main"], dfs.get("radial")
    out = {}
    for row in main.to_dict("records"):
        rf = None
        if radial is not None and len(radial):
            at_K = radial[(radial["size"] == row["size"]) & (radial["condition_id"] == row["condition_id"])
                          & (radial["k"] == row["n_loops"])]
            rf = at_K["radial_fraction_mean"].iloc[0] if len(at_K) else None
        key = f"{row['size'].split()[0]}/{row['condition_id']}"
        out[key] = {"ppl_K": _value(row["ppl_K_mean"]), "norm_K": _value(row["norm_K_mean"]),
                    "radial_fraction_K": _value(rf), "seeds": int(row["n"] or 0)}
    return out


def write_metrics(tables, path: Path) -> Path:
    """Write metrics.json from the aggregate tables (aggregate.Table list)."""
    return atomic_write_json(path, headline_metrics({t.name: t.df for t in tables}))
