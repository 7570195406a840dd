"""results/<exp>/metrics.json (DVC metrics): final-exit PPL, ||H_K|| and radial fraction at
exit K per size x condition, written by `loopscale report tables` and equal to the tables."""
import json
import math

import pandas as pd
import pytest

from loopscale.cli import main
from report_support import make_run


def test_metrics_json_per_condition(grid, tmp_path):  # noqa: F811
    out = tmp_path / "results"
    assert main(["report", "tables", "--runs", str(grid), "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    main_csv = pd.read_csv(out / "main.csv")
    assert len(metrics) == len(main_csv) == 3
    assert set(metrics) == set(main_csv["condition_id"])  # DVC's names: <condition>.<metric>
    drift = metrics["rmsnorm-per_loop-none-residual"]
    # two completed seeds (a diverged and a failed one excluded): means over them
    assert drift["seeds"] == 2
    assert drift["ppl_K"] == pytest.approx(11.0) and drift["norm_K"] == pytest.approx(1200.0)
    assert drift["log10_radial_fraction_K"] == pytest.approx(-12.0)
    raw = metrics["raw-per_loop-none-residual"]
    assert raw["log10_radial_fraction_K"] == pytest.approx(-2.0) and raw["ppl_K"] == pytest.approx(8.0)
    assert drift["params"] == raw["params"] == int(main_csv["params"].iloc[0])
    for v in metrics.values():  # flat: numbers (or null), nothing nested
        assert all(x is None or isinstance(x, (int, float)) and math.isfinite(x) for x in v.values())


def test_missing_radial_is_null(tmp_path):
    root = tmp_path / "runs"
    make_run(root, diags=("depth",))
    out = tmp_path / "results"
    assert main(["report", "tables", "--runs", str(root), "--out", str(out)]) == 0
    (entry,) = json.loads((out / "metrics.json").read_text()).values()
    assert entry["log10_radial_fraction_K"] is None and entry["ppl_K"] == pytest.approx(10.0)


def test_metrics_equal_the_written_csvs(grid, tmp_path):  # noqa: F811
    from loopscale.report.metrics import headline_metrics
    out = tmp_path / "results"
    assert main(["report", "tables", "--runs", str(grid), "--out", str(out)]) == 0
    from_csv = headline_metrics({n: pd.read_csv(out / f"{n}.csv") for n in ("main", "radial")})
    assert from_csv == json.loads((out / "metrics.json").read_text())


def test_several_sizes_nest_under_a_stable_size_index():
    from loopscale.report.metrics import headline_metrics
    main = pd.DataFrame([{"size": s, "params": p, "condition_id": c, "n_loops": 4, "ppl_K_mean": 10.0 + p / 1e6,
                          "norm_K_mean": 5.0, "n": 1}
                         for s, p in (("129M (d768)", 128_800_000), ("44M (d512)", 43_900_000))
                         for c in ("raw-per_loop-none-residual", "rmsnorm-per_loop-none-residual")])
    m = headline_metrics({"main": main})
    assert set(m) == {"size1", "size2"} and set(m["size1"]) == {"raw-per_loop-none-residual",
                                                                "rmsnorm-per_loop-none-residual"}
    assert m["size1"]["raw-per_loop-none-residual"]["params"] == 43_900_000  # smallest first
    assert m["size2"]["raw-per_loop-none-residual"]["log10_radial_fraction_K"] is None
