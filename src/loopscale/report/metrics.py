"""results/<exp>/metrics.json: the headline numbers of every condition, for DVC.

One entry per condition, keyed by the condition id alone, so DVC's flattened metric names are
`<condition>.<metric>` (e.g. `rmsnorm-per_loop-none-residual.ppl_K`) and stay the same column
in `dvc exp show` / `dvc metrics diff` when an experiment changes the model's size. An
experiment with several sizes nests the conditions under `size1`, `size2`, ... (smallest
first): `size2.<condition>.<metric>`. Each entry holds the final-exit perplexity `ppl_K`,
`norm_K` = ‖H_K‖, the radial gradient fraction at exit K as `log10_radial_fraction_K` (DVC
prints metrics with 5 decimals, which shows every scale-invariant readout's ~1e-16 as 0.0;
its log10, -15.9, reads), `params` (the size's parameter count) and `seeds` (completed runs
averaged); null where there is no value. Means over completed seeds, at the CSV tables'
precision (8 significant digits), so it equals what main.csv and radial.csv say.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..io import atomic_write_json


def _value(x):
    if x is None or not math.isfinite(float(x)):
        return None
    return float(f"{float(x):.8g}")  # the precision of the CSV tables


def _log10(x):
    x = _value(x)
    return None if x is None or x <= 0 else float(f"{math.log10(x):.8g}")


def headline_metrics(dfs: dict) -> dict:
    """{"<condition id>": {"ppl_K", "norm_K", "log10_radial_fraction_K", "params", "seeds"}}
    (several sizes: {"size<i>": {...}}) from the tables' data frames by name ("main",
    "radial"; the DataFrames of main.csv, radial.csv)."""
    main, radial = dfs["main"], dfs.get("radial")
    sizes = sorted({(int(p), str(s)) for p, s in zip(main["params"], main["size"])})
    out = {}
    for row in main.to_dict("records"):
        rf = None
        if radial is not None and len(radial):
            at_K = radial[(radial["size"] == row["size"]) & (radial["condition_id"] == row["condition_id"])
                          & (radial["k"] == row["n_loops"])]
            rf = at_K["radial_fraction_mean"].iloc[0] if len(at_K) else None
        entry = {"ppl_K": _value(row["ppl_K_mean"]), "norm_K": _value(row["norm_K_mean"]),
                 "log10_radial_fraction_K": _log10(rf), "params": int(row["params"]), "seeds": int(row["n"] or 0)}
        if len(sizes) == 1:
            out[row["condition_id"]] = entry
        else:
            i = sizes.index((int(row["params"]), str(row["size"]))) + 1
            out.setdefault(f"size{i}", {})[row["condition_id"]] = entry
    return out


def write_metrics(tables, path: Path) -> Path:
    """Write metrics.json from the aggregate tables (groups.Table list)."""
    return atomic_write_json(path, headline_metrics({t.name: t.df for t in tables}))
