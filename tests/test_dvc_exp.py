"""DVC experiments that compare: two `dvc exp run` of the smoke stage with different settings
(through exp.yaml, the `-S` surface) in a copy of the session's completed smoke workspace
(tests/test_pipeline.py); each retrains every run at its setting, `dvc metrics show` changes,
`dvc exp show --json` then lists both side by side with different metric values under stable
`<condition>.<metric>` names, and the commented params.yaml is left byte-identical."""
from __future__ import annotations

import json

import pytest
import yaml

from loopscale import pipeline as P
from test_dvc_metrics import metrics_of
from test_pipeline import (DVC, REPO, SCHEMA, copy_worktree, fresh_copy, run, smoke_local,  # noqa: F401  (fixture)
                           smoke_runs)

CONDITIONS = {"rmsnorm-per_loop-none-residual", "raw-per_loop-none-residual"}


def _experiments(shown: list) -> dict:
    """{experiment name: (params of exp.yaml, metrics of results/smoke/metrics.json)}."""
    out = {}
    for baseline in shown:
        for exp in (baseline.get("experiments") or []):
            for rev in exp["revs"]:
                data = rev.get("data") or {}
                if rev.get("name") and data.get("metrics"):
                    out[rev["name"]] = (data["params"]["exp.yaml"]["data"],
                                        data["metrics"]["results/smoke/metrics.json"]["data"])
    return out


def _layered(tmp_path, settings: str):
    (tmp_path / "exp.yaml").write_text(settings)
    return P.load_and_validate(REPO / "params.yaml", SCHEMA, settings_path=tmp_path / "exp.yaml")[1]


def test_exp_yaml_layers_over_params(tmp_path):
    """exp.yaml's model/train keys reach every run of the experiment (over the preset and the
    experiment's own train settings), its seeds replace the experiment's; others are untouched."""
    plain = P.load_and_validate(REPO / "params.yaml", SCHEMA)[1]
    committed = _layered(tmp_path, (REPO / "exp.yaml").read_text())
    assert [r.config for r in committed["smoke"].runs] == [r.config for r in plain["smoke"].runs]  # same values
    exps = _layered(tmp_path, "smoke: {train: {max_steps: 7}, model: {d_model: 48}, seeds: [1, 2]}\n")
    runs = exps["smoke"].runs
    assert {r.seed for r in runs} == {1, 2} and len(runs) == 2 * len(plain["smoke"].runs)
    assert all(r.config.train.max_steps == 7 and r.config.model.d_model == 48 for r in runs)
    assert [r.config for r in exps["cpu"].runs] == [r.config for r in plain["cpu"].runs]


@pytest.mark.parametrize("settings, message", [
    ("nosuch: {train: {max_steps: 3}}\n", "exp.yaml: nosuch: no experiment of that name in params.yaml"),
    ("smoke: {trian: {max_steps: 3}}\n", "exp.yaml: smoke.trian: unknown key; choose one of model, objective"),
    ("smoke: {train: {max_stepz: 3}}\n", "max_stepz"),
    ("smoke: {train: {max_steps: -3}}\n", "max_steps"),
    ("- smoke\n", "exp.yaml: must hold a mapping"),
])
def test_a_bad_exp_yaml_is_one_line(tmp_path, settings, message):
    with pytest.raises(P.ParamsError, match=message.replace(".", r"\.")) as e:
        _layered(tmp_path, settings)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_two_experiments_compare_side_by_side(smoke_local, tmp_path):  # noqa: F811
    repo = fresh_copy(smoke_local[0], tmp_path / "repo")
    params_before = (repo / "params.yaml").read_bytes()
    before = metrics_of(repo)
    for name, steps in (("short", 4), ("long", 12)):
        run([DVC, "exp", "run", "smoke", "-n", name, "-S", f"exp.yaml:smoke.train.max_steps={steps}"], repo,
            timeout=1200)
        assert (repo / "params.yaml").read_bytes() == params_before  # -S edits exp.yaml only
        assert yaml.safe_load((repo / "exp.yaml").read_text())["smoke"]["train"]["max_steps"] == steps
        for r in smoke_runs(repo):
            assert json.loads((r / "summary.json").read_text())["steps"] == steps  # retrained at the new setting
        after = metrics_of(repo)
        assert after.keys() == before.keys() and after != before
        before = after
    exps = _experiments(json.loads(run([DVC, "exp", "show", "--json"], repo).stdout))
    assert {"short", "long"} <= set(exps), list(exps)
    (p_short, m_short), (p_long, m_long) = exps["short"], exps["long"]
    assert p_short["smoke"]["train"]["max_steps"] == 4 and p_long["smoke"]["train"]["max_steps"] == 12
    assert set(m_short) == set(m_long) == CONDITIONS  # <condition>.<metric>: no size label in the name
    for c in CONDITIONS:
        assert m_short[c]["ppl_K"] != m_long[c]["ppl_K"]
        assert m_short[c]["params"] == m_long[c]["params"]
    # the blind spot reads in `dvc metrics show`: log10 of the radial fraction, not 0.0
    rmsnorm, raw = (m_long[c]["log10_radial_fraction_K"] for c in sorted(CONDITIONS, reverse=True))
    assert rmsnorm < -8 and -6 < raw < 0
    table = run([DVC, "exp", "show", "--no-pager", "--md"], repo).stdout
    assert "rmsnorm-per_loop-none-residual.log10_radial_fraction_K" in table.replace("…", "")
    # the run configs of the last experiment carry its setting (the pipeline read exp.yaml)
    cfg = yaml.safe_load(next((repo / "runs" / "smoke").glob("*/*/seed42/config.yaml")).read_text())
    assert cfg["train"]["max_steps"] == 12


@pytest.mark.slow
def test_plots_render_offline(tmp_path):
    """The DVC plots are static images: the page `dvc plots show` writes loads no script."""
    repo = copy_worktree(tmp_path / "repo")
    plots = yaml.safe_load((repo / "dvc.yaml").read_text())["plots"]
    assert all(isinstance(p, str) and p.endswith(".png") for p in plots)
    src = repo / "results" / "cpu" / "figures" / "norm_per_loop.png"
    assert src.is_file()
    run([DVC, "plots", "show", "-o", "page", "results/cpu/figures/norm_per_loop.png"], repo)
    html = (repo / "page" / "index.html").read_text()
    assert "<img" in html and "<script" not in html and "http" not in html.replace("http-equiv", "")
