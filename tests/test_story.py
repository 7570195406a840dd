"""The endpoint-scale story (report/endpoint_scale.py, `loopscale eval story`) against the official
endpoint_scale_story_metrics.py's output on the same numbers (tests/fixtures/story/)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from loopscale.cli import main
from loopscale.config import preset
from loopscale.registry import condition
from loopscale.report.groups import group_runs
from loopscale.report.runs import find_run_dirs
from loopscale.report.runs import load_runs
from loopscale.report.endpoint_scale import (pearson, per_loop, scale_visible, spearman, story_point, story_points,
                                    story_summary, story_table)

FIX = Path(__file__).parent / "fixtures" / "story"
OFFICIAL_COND = {"terminal_norm": ("rmsnorm", "terminal", "none"), "terminal_raw": ("raw", "terminal", "none"),
                 "perstep_norm": ("rmsnorm", "per_loop", "none"), "perstep_raw": ("raw", "per_loop", "none"),
                 "perstep_final_norm": ("final_norm", "per_loop", "none"),
                 "terminal_norm_penalty": ("rmsnorm", "terminal", "norm_penalty")}
SIZES = {"44m": 32, "129m": 64}  # d_model of the two synthetic sizes


def write_run(root: Path, readout, loss, regularizer, recurrence="residual", d_model=32, seed=1,
              exit_ppl=(20.0, 15.0, 12.0), norm_k=10.0, radial_k=1e-3, status="completed", depth=True) -> Path:
    cfg = preset("smoke", {"model": {"readout": readout, "recurrence": recurrence, "d_model": d_model},
                           "objective": {"loss": loss, "regularizer": regularizer}, "train": {"seed": seed}}).to_dict()
    d = root / f"d{d_model}" / f"{readout}-{loss}-{regularizer}-{recurrence}" / f"seed{seed}"
    (d / "eval").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"config": cfg}))
    ces = [math.log(p) for p in exit_ppl]
    (d / "summary.json").write_text(json.dumps({"status": status, "steps": 30, "total_steps": 30,
                                                "validation": {"val_ce": ces, "val_norm": [1.0] * 2 + [norm_k]}}))
    hdr = {"status": "ok", "seed": seed}
    if depth:
        rows = [{"k": k + 1, "ce": c, "ppl": p, "norm": 1.0 if k < len(ces) - 1 else norm_k}
                for k, (c, p) in enumerate(zip(ces, exit_ppl))]
        (d / "eval" / "depth.json").write_text(json.dumps({"diagnostic": "depth", **hdr, "exits": rows}))
    (d / "eval" / "radial.json").write_text(json.dumps({"diagnostic": "radial", **hdr, "loops": [
        {"k": k, "radial_fraction": 0.5} for k in (1, 2)] + [{"k": 3, "radial_fraction": radial_k}]}))
    return d


@pytest.fixture
def official_grid(tmp_path) -> Path:
    """The runs of tests/fixtures/story/mechanism_metrics.csv, as loopscale run directories."""
    root = tmp_path / "runs"
    with (FIX / "mechanism_metrics.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            scale, cond = row["checkpoint"].split("_", 1)
            write_run(root, *OFFICIAL_COND[cond], d_model=SIZES[scale],
                      exit_ppl=(float(row["ppl_K1"]), 1.0, float(row["ppl_K4"])), norm_k=float(row["norm_K4"]),
                      radial_k=float(row["radial_cos_loop4"]))
    return root


def groups_of(root: Path):
    return group_runs(load_runs(find_run_dirs([str(root)])))


def test_summary_equals_the_official_script(official_grid):
    ours = story_summary(story_points(groups_of(official_grid)))
    official = json.loads((FIX / "official_story_summary.json").read_text())
    for name, o in official.items():
        r = ours[name]
        assert r["n"] == o["n"]
        for key in ("pearson_log_radial_vs_log_norm", "spearman_log_radial_vs_log_norm"):
            assert math.isclose(r[key], o[key], rel_tol=1e-12), (name, key)
        for flag in ("False", "True"):
            assert math.isclose(r["mean_ce_gap_by_per_loop"][flag], o["mean_ce_gap_by_endpoint_trained"][flag],
                                rel_tol=1e-12)
            assert math.isclose(r["mean_log10_norm_by_scale_visible"][flag],
                                o["mean_log10_norm_by_scale_visible"][flag], rel_tol=1e-12)


def test_per_run_numbers_equal_the_official_script(official_grid):
    with (FIX / "official_story_metrics.csv").open(newline="") as f:
        official = {(r["scale"], r["condition"]): r for r in csv.DictReader(f)}
    by_d = {v: k for k, v in SIZES.items()}
    inv = {v: k for k, v in OFFICIAL_COND.items()}
    seen = 0
    for g in groups_of(official_grid):
        for run in g.used:
            o = official[(by_d[g.size.d_model], inv[(g.cond.readout, g.cond.loss, g.cond.regularizer)])]
            p = story_point(run)
            assert p["per_loop"] == (o["endpoint_trained"] == "True")
            assert p["scale_visible"] == (o["scale_visible"] == "True")
            for ours, theirs in (("ppl_1", "ppl_K1"), ("ppl_K", "ppl_K4"), ("ce_gap", "early_exit_ce_gap"),
                                 ("norm_K", "norm_K4"), ("r_K", "radial_cos_loop4"), ("log10_norm_K", "log10_norm_K4"),
                                 ("log10_r_K", "log10_radial_K4")):
                assert math.isclose(p[ours], float(o[theirs]), rel_tol=1e-12), (ours, p[ours], o[theirs])
            seen += 1
    assert seen == len(official) == 12


def test_correlations_against_numpy_and_ties():
    x, y = [1.0, 2.0, 2.0, 5.0, 7.0], [3.0, 1.0, 4.0, 4.0, 9.0]
    rx = np.argsort(np.argsort(x)).astype(float)
    rx[[1, 2]] = rx[[1, 2]].mean()
    ry = np.argsort(np.argsort(y)).astype(float)
    ry[[2, 3]] = ry[[2, 3]].mean()
    assert math.isclose(spearman(x, y), np.corrcoef(rx, ry)[0, 1], rel_tol=1e-12)
    assert math.isclose(pearson(x, y), np.corrcoef(x, y)[0, 1], rel_tol=1e-12)
    for short in (([1.0], [2.0]), ([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]), ([1.0, 2.0], [4.0, 4.0])):
        assert math.isnan(pearson(*short)) and math.isnan(spearman(*short))  # too few points, or constant


def test_quadrants_follow_the_official_definitions():
    visible = {c: scale_visible(condition(*v)) for c, v in OFFICIAL_COND.items()}
    assert visible == {"terminal_norm": False, "terminal_raw": True, "perstep_norm": False, "perstep_raw": True,
                       "perstep_final_norm": True, "terminal_norm_penalty": True}
    assert per_loop(condition("rmsnorm", "per_loop")) and not per_loop(condition("raw", "terminal"))
    assert not scale_visible(condition("rmsnorm", "per_loop", recurrence="inter_loop_norm"))


def test_table_and_extra_conditions(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "rmsnorm", "per_loop", "none", seed=1, exit_ppl=(18.0, 16.0, 15.0), norm_k=1000.0, radial_k=1e-13)
    write_run(root, "rmsnorm", "per_loop", "none", seed=2, exit_ppl=(20.0, 16.0, 15.0), norm_k=3000.0, radial_k=1e-11)
    write_run(root, "rmsnorm", "per_loop", "none", recurrence="inter_loop_norm", exit_ppl=(18.0, 16.0, 15.0),
              norm_k=30.0, radial_k=1e-10)
    write_run(root, "raw", "per_loop", "none", seed=3, status="diverged")
    t = story_table(groups_of(root))
    row = t.df[t.df["condition_id"] == "rmsnorm-per_loop-none-residual"].iloc[0]
    assert row["n"] == 2 and math.isclose(row["norm_K_mean"], 2000.0)
    assert math.isclose(row["ce_gap_mean"], (math.log(18 / 15) + math.log(20 / 15)) / 2)
    assert math.isclose(row["r_K_mean"], (1e-13 + 1e-11) / 2)
    assert t.df[t.df["condition_id"] == "raw-per_loop-none-residual"].iloc[0]["n"] == 0  # diverged: excluded
    summ = story_summary(story_points(groups_of(root)))
    assert summ["core_2x2"]["n"] == 2 and summ["all"]["n"] == 3  # the inter-loop run counts only in "all"
    assert "r_K" in t.md and "seed 3" in t.md


def test_cli_writes_table_summary_and_figure(official_grid, tmp_path, capsys):
    out = tmp_path / "story"
    assert main(["eval", "story", "--runs", str(official_grid), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"story.csv", "story.md", "story_summary.json", "story_quadrant.png",
                                               "story_quadrant.pdf"}
    summary = json.loads((out / "story_summary.json").read_text())
    official = json.loads((FIX / "official_story_summary.json").read_text())
    assert math.isclose(summary["core_2x2"]["pearson_log_radial_vs_log_norm"],
                        official["core_2x2"]["pearson_log_radial_vs_log_norm"], rel_tol=1e-12)
    assert (out / "story_quadrant.png").read_bytes().startswith(b"\x89PNG")


def test_cli_bad_runs_dir_is_one_line(tmp_path, capsys):
    assert main(["eval", "story", "--runs", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------
# the Table-5 frontier: exit readouts (frontier_exits) beside the final readout (frontier)
# ---------------------------------------------------------------------------
def test_frontier_exits_reads_each_depth_through_its_exit_readout(tmp_path, monkeypatch):
    from loopscale.report import figures as F
    root = tmp_path / "runs"
    d = write_run(root, "final_norm", "per_loop", "none", exit_ppl=(400.0, 90.0, 12.0))
    depth = json.loads((d / "eval" / "depth.json").read_text())
    # the same depths read with the final readout (RMSNorm): other numbers
    depth["depth"] = [{"k": k, "ppl": p, "ce": math.log(p), "norm": 1.0} for k, p in ((1, 30.0), (2, 14.0), (3, 12.0),
                                                                                       (4, 13.0))]
    (d / "eval" / "depth.json").write_text(json.dumps(depth))
    (d / "eval" / "throughput.json").write_text(json.dumps({"diagnostic": "throughput", "status": "ok", "depth": [
        {"k": k, "tokens_per_s": 9000.0 / k} for k in range(1, 5)]}))
    drawn = {}

    def keep(fig, path):
        ax = fig.axes[-1]  # the main panel (the overview panel comes first)
        drawn[Path(path).stem] = [tuple(map(float, xy)) for line in ax.lines for xy in line.get_xydata()]
        import matplotlib.pyplot as plt
        plt.close(fig)
        return path
    monkeypatch.setattr(F, "save_figure", keep)
    groups = groups_of(root)
    F.fig_frontier_exits(groups, tmp_path / "frontier_exits.png")
    F.fig_frontier(groups, tmp_path / "frontier.png")
    exits_line = [xy for xy in drawn["frontier_exits"]][:3]
    assert exits_line == [(9000.0, 400.0), (4500.0, 90.0), (3000.0, 12.0)]
    assert (9000.0, 30.0) in drawn["frontier"] and (9000.0, 400.0) not in drawn["frontier"]
    assert all(x >= 3000.0 for x, _ in drawn["frontier_exits"])  # only k <= K: exits exist up to K


def test_paper_halting_table_reads_the_paper_protocol(tmp_path):
    from loopscale.report.tables import halting_paper_table
    root = tmp_path / "runs"
    for seed, speed in ((1, 2.0), (2, 4.0)):
        d = write_run(root, "raw", "per_loop", "none", seed=seed)
        cal = {"threshold": 0.5, "official_policy": "logit_margin", "calib_fixed_ppl": 10.0, "calib_dynamic_ppl": 10.1,
               "calib_dynamic_avg_loops": 1.5, "bench_fixed_ppl": 10.0, "bench_dynamic_ppl": 10.1,
               "bench_dynamic_avg_loops": 1.5, "bench_speedup": speed}
        (d / "eval" / "halting.json").write_text(json.dumps({"diagnostic": "halting", "status": "ok", "policies": {},
                                                            "paper": {"calibrated": {"margin": cal}}}))
    write_run(root, "rmsnorm", "per_loop", "none")  # no halting.json: an empty row
    t = halting_paper_table(groups_of(root))
    (row,) = t.df.to_dict("records")
    assert row["policy"] == "margin" and row["official_policy"] == "logit_margin"
    assert math.isclose(row["calib_ppl_ratio_mean"], 1.01) and math.isclose(row["bench_speedup_mean"], 3.0)
    assert row["bench_speedup_n"] == 2 and "in sample" in t.md
