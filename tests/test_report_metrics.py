"""results/<exp>/metrics.json (DVC metrics): final-exit PPL, ||H_K|| and radial fraction at
exit K per size x condition, written by `loopscale report tables` and equal to the tables."""
import json
import math

import pandas as pd
import pytest

from loopscale.cli import main
from test_report import grid, make_run  # noqa: F401  (fixture)


def test_metrics_json_per_condition(grid, tmp_path):  # noqa: F811
    out = tmp_path / "results"
    assert main(["report", "tables", "--runs", str(grid), "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    main_csv = pd.read_csv(out / "main.csv")
    assert len(metrics) == len(main_csv) == 3
    drift = next(v for k, v in metrics.items() if k.endswith("/rmsnorm-per_loop-none-residual"))
    # two completed seeds (a diverged and a failed one excluded): means over them
    assert drift["seeds"] == 2
    assert drift["ppl_K"] == pytest.approx(11.0) and drift["norm_K"] == pytest.approx(1200.0)
    assert drift["radial_fraction_K"] == pytest.approx(1e-12)
    raw = next(v for k, v in metrics.items() if k.endswith("/raw-per_loop-none-residual"))
    assert raw["radial_fraction_K"] == pytest.approx(1e-2) and raw["ppl_K"] == pytest.approx(8.0)
    for v in metrics.values():  # flat: numbers (or null), nothing nested
        assert all(x is None or isinstance(x, (int, float)) and math.isfinite(x) for x in v.values())


def test_missing_radial_is_null(tmp_path):
    root = tmp_path / "runs"
    make_run(root, diags=("depth",))
    out = tmp_path / "results"
    assert main(["report", "tables", "--runs", str(root), "--out", str(out)]) == 0
    (entry,) = json.loads((out / "metrics.json").read_text()).values()
    assert entry["radial_fraction_K"] is None and entry["ppl_K"] == pytest.approx(10.0)


def test_metrics_equal_the_written_csvs(grid, tmp_path):  # noqa: F811
    from loopscale.report.metrics import headline_metrics
    out = tmp_path / "results"
    assert main(["report", "tables", "--runs", str(grid), "--out", str(out)]) == 0
    from_csv = headline_metrics({n: pd.read_csv(out / f"{n}.csv") for n in ("main", "radial")})
    assert from_csv == json.loads((out / "metrics.json").read_text())
