"""DVC sees the results: `dvc metrics show` (results/<exp>/metrics.json) and `dvc plots show`
(the figures, static images), on the smoke experiment (a copy of the session's completed smoke
workspace, tests/test_pipeline.py). `dvc exp run -S exp.yaml:...` on an experiment's training
keys: tests/test_dvc_exp.py."""
from __future__ import annotations

import json

import pytest

from loopscale.report.figures import FIGURES
from workflow_support import DVC, fresh_copy, run

pytestmark = pytest.mark.slow


def metrics_of(repo) -> dict:
    shown = json.loads(run([DVC, "metrics", "show", "--json"], repo).stdout)
    return shown[""]["data"]["results/smoke/metrics.json"]["data"]  # "": the workspace


@pytest.fixture(scope="module")
def repo(smoke_local, tmp_path_factory):  # noqa: F811
    return fresh_copy(smoke_local[0], tmp_path_factory.mktemp("dvc") / "repo")


def test_metrics_show(repo):
    shown = metrics_of(repo)
    assert shown == json.loads((repo / "results" / "smoke" / "metrics.json").read_text())
    assert set(shown) == {"rmsnorm-per_loop-none-residual", "raw-per_loop-none-residual"}
    for v in shown.values():
        assert v["ppl_K"] > 1 and v["norm_K"] > 0 and v["log10_radial_fraction_K"] < 0 and v["seeds"] == 1


def test_plots_show(repo):
    plots = json.loads(run([DVC, "plots", "show", "--json"], repo).stdout)["data"]
    images = {p for p, entries in plots.items() if '"image"' in json.dumps(entries)}
    assert {f"results/smoke/figures/{f}.png" for f in FIGURES} <= images
    # static images only (the page renders offline); a committed study regenerated before a
    # figure existed simply lacks that file
    assert images == {p for p in plots if (repo / p).is_file()}
