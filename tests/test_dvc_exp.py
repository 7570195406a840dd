"""DVC experiments that compare one change at a time: `dvc exp run --temp smoke_dvc -S
exp.yaml:smoke_dvc.<key>=<value>` (dvc.yaml, docs/pipeline.md) runs the smoke grid under its own
name (runs/smoke_dvc, never `make smoke`'s runs/smoke) beside the workspace, from the committed
exp.yaml. Two experiments with different single changes each differ from the baseline in their
own setting only, the workspace (exp.yaml included) is left as it was, the baseline row carries
the committed results/smoke_dvc/metrics.json, and `dvc exp show --only-changed` names just the
changed settings and the metrics they moved."""
from __future__ import annotations

import csv
import io
import json
import re

import pytest
import yaml

from loopscale import pipeline as P
from workflow_support import DVC, REPO, SCHEMA, copy_worktree, git, run

EXP = "smoke_dvc"  # the experiment (and DVC stage) that `dvc exp run` changes


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _rows(shown: list) -> tuple[dict, dict]:
    """(the baseline commit's row, {experiment name: row}) of `dvc exp show --json`; a row is
    (sha, params of exp.yaml, params of params.yaml, metrics of results/smoke_dvc/metrics.json)."""
    def row(rev):
        data = rev.get("data") or {}
        params, metrics = data.get("params") or {}, data.get("metrics") or {}
        return (rev["rev"], params.get("exp.yaml", {}).get("data"), params.get("params.yaml", {}).get("data"),
                metrics.get(f"results/{EXP}/metrics.json", {}).get("data"))
    baseline = next(b for b in shown if b["rev"] != "workspace")
    exps = {rev["name"]: row(rev) for e in (baseline.get("experiments") or []) for rev in e["revs"]
            if rev.get("name")}
    return row(baseline), exps


def _layered(tmp_path, settings: str):
    (tmp_path / "exp.yaml").write_text(settings)
    return P.load_and_validate(REPO / "params.yaml", SCHEMA, settings_path=tmp_path / "exp.yaml")[1]


def test_exp_yaml_layers_over_params(tmp_path):
    """exp.yaml's model/train keys reach every run of the experiment (over the preset and the
    experiment's own train settings), its seeds replace the experiment's; others are untouched.
    The committed exp.yaml states the smoke grid's own settings: smoke_dvc is the smoke grid
    under its own name, in run directories of its own."""
    exps_yaml = yaml.safe_load((REPO / "params.yaml").read_text())["experiments"]
    assert ({k: v for k, v in exps_yaml[EXP].items() if k != "description"}
            == {k: v for k, v in exps_yaml["smoke"].items() if k != "description"})
    plain = P.load_and_validate(REPO / "params.yaml", SCHEMA)[1]
    committed = _layered(tmp_path, (REPO / "exp.yaml").read_text())
    assert [r.config for r in committed[EXP].runs] == [r.config for r in plain["smoke"].runs]  # same values
    assert [r.config for r in committed[EXP].runs] == [r.config for r in plain[EXP].runs]
    assert all(r.dir.startswith(f"runs/{EXP}/") for r in committed[EXP].runs)
    assert not {r.dir for r in committed[EXP].runs} & {r.dir for r in plain["smoke"].runs}
    exps = _layered(tmp_path, f"{EXP}: {{train: {{max_steps: 7}}, model: {{d_model: 48}}, seeds: [1, 2]}}\n")
    runs = exps[EXP].runs
    assert {r.seed for r in runs} == {1, 2} and len(runs) == 2 * len(plain[EXP].runs)
    assert all(r.config.train.max_steps == 7 and r.config.model.d_model == 48 for r in runs)
    for other in ("smoke", "cpu"):
        assert [r.config for r in exps[other].runs] == [r.config for r in plain[other].runs]


def test_only_the_experiment_stage_reads_exp_yaml():
    """exp.yaml names exactly the experiments whose DVC stage layers it (settings=exp.yaml and
    an exp.yaml params dependency): `make smoke` and the smoke stage never read it."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    layered = {name for name, st in stages.items() if "settings=exp.yaml" in st["cmd"]}
    assert layered == set(yaml.safe_load((REPO / "exp.yaml").read_text())) == {EXP}
    for name, st in stages.items():
        reads = [p["exp.yaml"] for p in st["params"] if isinstance(p, dict) and "exp.yaml" in p]
        assert reads == ([[name]] if name in layered else []), name
    assert "settings=" not in re.search(r"^smoke:.*?(?=^\S|\Z)", (REPO / "Makefile").read_text(), re.M | re.S).group(0)


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


def _committed_table(repo, sha: str, name: str) -> list[dict]:
    text = git(repo, "show", f"{sha}:results/{EXP}/{name}")
    return list(csv.DictReader(io.StringIO(text)))


@pytest.mark.slow
def test_each_experiment_changes_one_setting(tmp_path):
    repo = copy_worktree(tmp_path / "repo")
    base = yaml.safe_load((repo / "exp.yaml").read_text())[EXP]
    changes = {"steps": ("train.max_steps", base["train"]["max_steps"] // 2),
               "width": ("model.d_model", base["model"]["d_model"] * 3 // 2)}
    workspace = {f: (repo / f).read_bytes() for f in ("exp.yaml", "params.yaml", "dvc.yaml")}
    for name, (key, value) in changes.items():
        run([DVC, "exp", "run", "--temp", EXP, "-n", name, "-S", f"exp.yaml:{EXP}.{key}={value}"], repo,
            timeout=1200)
        # the workspace is the baseline still: the next experiment starts from it
        assert {f: (repo / f).read_bytes() for f in workspace} == workspace
        assert git(repo, "status", "--porcelain") == ""
        assert not (repo / "runs").exists()  # trained beside the workspace, not in it
    (b_sha, b_exp, b_params, b_metrics), exps = _rows(json.loads(run([DVC, "exp", "show", "--json"], repo).stdout))
    assert set(changes) <= set(exps), list(exps)
    # the baseline row has the committed metrics (no `!`)
    assert b_metrics == json.loads((repo / "results" / EXP / "metrics.json").read_text())
    assert _flat(b_exp) == _flat({EXP: base})
    b_runs = _committed_table(repo, b_sha, "per_seed.csv")
    for name, (key, value) in changes.items():
        sha, p_exp, p_params, metrics = exps[name]
        assert p_params == b_params  # -S edits exp.yaml only
        flat, b_flat = _flat(p_exp), _flat(b_exp)
        assert {k for k in flat.keys() | b_flat.keys() if flat.get(k) != b_flat.get(k)} == {f"{EXP}.{key}"}
        assert flat[f"{EXP}.{key}"] == value
        assert metrics.keys() == b_metrics.keys()
        assert all(metrics[c]["ppl_K"] != b_metrics[c]["ppl_K"] for c in metrics)
        # the experiment's runs were trained with its one change and the baseline's other settings
        runs = _committed_table(repo, sha, "per_seed.csv")
        assert len(runs) == len(b_runs)
        for r, b in zip(runs, b_runs):
            assert int(r["steps"]) == (value if key == "train.max_steps" else int(b["steps"]))
            assert int(r["d_model"]) == (value if key == "model.d_model" else int(b["d_model"]))
    m_steps, m_width = exps["steps"][3], exps["width"][3]
    assert all(m_steps[c]["params"] == b_metrics[c]["params"] != m_width[c]["params"] for c in b_metrics)
    # the blind spot reads in the metrics: log10 of the radial fraction, not 0.0
    assert min(m["log10_radial_fraction_K"] for m in m_steps.values()) < -8
    assert -6 < max(m["log10_radial_fraction_K"] for m in m_steps.values()) < 0
    # the documented table: the two changed settings and the metrics they moved, nothing else
    table = run([DVC, "exp", "show", "--only-changed", "--csv"], repo).stdout
    header = next(csv.reader(io.StringIO(table)))
    # a metric's column names its file where another metrics file has the same key (results/smoke)
    columns = {c.removeprefix(f"results/{EXP}/metrics.json:") for c in header} - {"Experiment", "rev", "typ", "Created"}
    moved = {f"{c}.{m}" for c in b_metrics for m in b_metrics[c]
             if len({b_metrics[c][m], m_steps[c][m], m_width[c][m]}) > 1}
    assert columns == moved | {f"{EXP}.{key}" for key, _ in changes.values()}, header
    assert len(run([DVC, "exp", "show", "--csv"], repo).stdout.splitlines()[0].split(",")) > 10 * len(header)


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
