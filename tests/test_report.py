"""Reports: aggregation over seeds, failed/diverged runs, missing files, verdict rules,
figures and determinism -- all on small synthetic run directories."""
from __future__ import annotations

import ast
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from loopscale.report import claims as C
from loopscale.report.groups import group_runs, write_tables
from loopscale.report.tables import build_tables
from loopscale.report.figures import FIGURES, write_figures
from loopscale.registry import condition
from loopscale.report.runs import load_run
from loopscale.report.document import report_markdown
from loopscale import cli
from loopscale.config import preset
from loopscale.train import train
from cli_support import one_line_error, run_cli
from report_support import K, cs, cs_exits, make_grid, make_run, runs_of, verdict

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# synthetic run directories
# ---------------------------------------------------------------------------




@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> list[Path]:
    """write_figures on the grid, once for the module: the PNGs it returns, with their PDFs."""
    d = tmp_path_factory.mktemp("figures")
    return write_figures(runs_of(make_grid(d / "runs")), d / "fig")




def _main_row(df: pd.DataFrame, cond) -> pd.Series:
    return df[df["condition_id"] == cond.slug].iloc[0]


# ---------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------
def test_mean_std_over_seeds_and_seed_count(grid, tmp_path):
    tables = {t.name: t for t in build_tables(runs_of(grid))}
    row = _main_row(tables["main"].df, condition("rmsnorm", "per_loop"))
    assert row["ppl_K_mean"] == pytest.approx(11.0)
    assert row["ppl_K_std"] == pytest.approx(math.sqrt(2.0))  # sample std (ddof=1) of 10, 12
    assert row["norm_K_mean"] == pytest.approx(1200.0)
    assert row["n"] == 2 and row["n_runs"] == 4
    md = tables["main"].md
    line = next(l for l in md.splitlines() if l.startswith("| ") and "per-loop CE + RMSNorm readout |" in l)
    assert "11.00 ± 1.41" in line and "2/4" in line and "1,200 ± 283" in line
    # a single seed: mean, no std
    il = _main_row(tables["main"].df, condition("rmsnorm", "per_loop", "none", "inter_loop_norm"))
    assert il["n"] == 1 and math.isnan(il["ppl_K_std"])
    # per-k means in the depth table
    dp = tables["depth"].df
    raw = dp[(dp.condition_id == condition("raw", "per_loop").slug) & (dp.kind == "exit") & (dp.k == 1)].iloc[0]
    assert raw["ppl_mean"] == pytest.approx(30.0) and raw["ppl_n"] == 2


def test_scale_table(grid):
    t = {t.name: t for t in build_tables(runs_of(grid))}["scale"]
    df = t.df
    rms = df[df.condition_id == condition("rmsnorm", "per_loop").slug]
    raw = df[df.condition_id == condition("raw", "per_loop").slug]
    assert len(rms) == len(raw) == 10  # every alpha of the sweep
    assert (rms["delta_ce_mean"] == 0).all() and rms.set_index("alpha").loc[1.0, "ce_n"] == 2
    r10 = raw.set_index("alpha").loc[10.0]
    assert r10["delta_ce_mean"] == pytest.approx(0.5 * math.log(10)) and r10["ce_n"] == 1  # seed 2: no eval files
    line = next(l for l in t.md.splitlines() if "per-loop CE + raw readout |" in l)
    assert line.endswith("| 1.15 |") and "| 1/2 |" in line  # max |ΔCE| of the raw model: 0.5·ln 10
    assert "scale_sensitivity.py" in t.md


def test_failed_and_diverged_runs_shown_and_excluded(grid):
    runs = runs_of(grid)
    assert len(runs) == 7
    status = {(r.condition.slug, r.seed): (r.status, r.note) for r in runs}
    slug = condition("rmsnorm", "per_loop").slug
    assert status[(slug, 3)] == ("diverged", "diverged at step 17")
    assert status[(slug, 4)][0] == "failed"
    tables = {t.name: t for t in build_tables(runs)}
    row = _main_row(tables["main"].df, condition("rmsnorm", "per_loop"))
    assert "seed 3 diverged at step 17" in row["runs"] and "seed 4 failed" in row["runs"]
    assert row["ppl_K_mean"] == pytest.approx(11.0)  # diverged/failed runs excluded
    assert "diverged at step 17" in tables["main"].md and "Excluded from the means" in tables["main"].md
    assert "diverged at step 17" in tables["radial"].md  # every table notes the exclusion
    rt = tables["runs"].df
    assert len(rt) == 7 and set(rt["status"]) == {"completed", "diverged", "failed"}


def test_missing_eval_files_do_not_crash(tmp_path):
    root = tmp_path / "runs"
    make_run(root, seed=1, diags=())
    make_run(root, readout="raw", seed=1, diags=("depth",))
    (root / "rmsnorm-per_loop-none-residual" / "seed1" / "eval").mkdir(exist_ok=True)
    (root / "rmsnorm-per_loop-none-residual" / "seed1" / "eval" / "radial.json").write_text("{not json")
    runs = runs_of(root)
    tables = {t.name: t for t in build_tables(runs)}
    rad = tables["radial"].df
    assert rad["radial_fraction_mean"].isna().all()
    assert "unreadable" in tables["radial"].md  # says why the cells are empty
    # the main table falls back to the end-of-training validation
    row = _main_row(tables["main"].df, condition("rmsnorm", "per_loop"))
    assert row["ppl_K_mean"] == pytest.approx(10.0) and row["ppl_source"] == "summary"
    write_tables(list(tables.values()), tmp_path / "out")
    paths = write_figures(runs, tmp_path / "fig")
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    text = report_markdown(runs, tmp_path / "out", tmp_path / "out" / "REPORT.md", "t")
    assert C.NOT_RUN in text


def test_config_yaml_fallback_and_missing_summary(tmp_path):
    d = make_run(tmp_path / "runs", readout="raw", seed=5, config_json=False, summary=False, status="failed")
    r = load_run(d)
    assert r.condition == condition("raw", "per_loop") and r.seed == 5
    assert r.status == "failed" and "no summary.json" in r.note


# ---------------------------------------------------------------------------
# verdict rules
# ---------------------------------------------------------------------------


RMS, RAW = C.PER_LOOP_RMS, C.PER_LOOP_RAW




def test_claim_a_drift():
    assert verdict(C.claim_drift, cs(RMS, norm=5000), cs(RAW, norm=20)) == C.REPRODUCED
    assert verdict(C.claim_drift, cs(RMS, norm=100), cs(RAW, norm=20)) == C.NOT_REPRODUCED
    assert verdict(C.claim_drift, cs(RMS, norm=5000)) == C.NOT_RUN
    assert verdict(C.claim_drift, cs(RMS, norm=5000), cs(RAW, norm=20, n=0)) == C.NOT_RUN  # all seeds diverged


def test_claim_b_small_norms():
    sq = math.sqrt(64)
    # (b) reads the raw readouts only; the penalties are (b-pen), a sanity check; the registered (b) read both
    assert verdict(C.claim_small_norms, cs(RAW, norm=3 * sq), cs(C.PER_LOOP_PENALTY, norm=11 * sq)) == C.REPRODUCED
    assert verdict(C.claim_small_norms, cs(RAW, norm=11 * sq), cs(C.PER_LOOP_PENALTY, norm=2 * sq)) == C.NOT_REPRODUCED
    assert verdict(C.claim_small_norms_penalty, cs(RAW, norm=3 * sq), cs(C.PER_LOOP_PENALTY, norm=11 * sq)) \
        == C.NOT_REPRODUCED
    assert verdict(C.claim_small_norms_penalty, cs(C.PER_LOOP_PENALTY, norm=2 * sq)) == C.REPRODUCED
    assert verdict(C.claim_small_norms_penalty, cs(RAW, norm=3 * sq)) == C.NOT_RUN
    assert verdict(C.claim_small_norms_registered, cs(RAW, norm=3 * sq), cs(C.PER_LOOP_PENALTY, norm=2 * sq)) \
        == C.REPRODUCED
    assert verdict(C.claim_small_norms_registered, cs(RAW, norm=3 * sq), cs(C.PER_LOOP_PENALTY, norm=11 * sq)) \
        == C.NOT_REPRODUCED
    assert verdict(C.claim_small_norms, cs(RMS, norm=5)) == C.NOT_RUN


def test_claim_c_inter_loop():
    assert verdict(C.claim_inter_loop, cs(C.INTER_LOOP, norm=20), cs(RMS, norm=5000)) == C.REPRODUCED
    assert verdict(C.claim_inter_loop, cs(C.INTER_LOOP, norm=2000), cs(RMS, norm=5000)) == C.NOT_REPRODUCED
    assert verdict(C.claim_inter_loop, cs(C.INTER_LOOP, norm=20), cs(RMS, norm=50)) == C.NOT_REPRODUCED  # no drift
    assert verdict(C.claim_inter_loop, cs(RMS, norm=5000)) == C.NOT_RUN


def test_claim_d_radial():
    lay = condition("layernorm", "per_loop")
    ok = (cs(RMS, radial=[1e-9, 2e-9, 1e-9]), cs(lay, radial=[1e-8] * 3), cs(RAW, radial=[1e-2] * 3))
    assert verdict(C.claim_radial, *ok) == C.REPRODUCED
    assert verdict(C.claim_radial, cs(RMS, radial=[1e-9, 1e-3, 1e-9]), ok[2]) == C.NOT_REPRODUCED
    assert verdict(C.claim_radial, ok[0], cs(RAW, radial=[1e-7] * 3)) == C.NOT_REPRODUCED
    assert verdict(C.claim_radial, ok[0]) == C.NOT_RUN
    assert verdict(C.claim_radial, cs(RMS), ok[2]) == C.NOT_RUN  # no radial data for the RMSNorm model


def test_claim_e_k_invariance():
    flat, steep = (4.98, 4.95, 4.95, 4.97), (4.68, 4.55, 4.54, 4.55)
    assert verdict(C.claim_k_invariance, cs(RMS, ppl=flat), cs(RAW, ppl=steep)) == C.REPRODUCED
    assert verdict(C.claim_k_invariance, cs(RMS, ppl=steep), cs(RAW, ppl=flat)) == C.NOT_REPRODUCED
    assert verdict(C.claim_k_invariance, cs(RAW, ppl=steep)) == C.NOT_RUN
    assert verdict(C.claim_k_invariance, cs(RMS, ppl=(5.0,)), cs(RAW, ppl=steep)) == C.NOT_RUN  # K=1: no range


def test_claim_f_scale_control():
    rms = cs(RMS, ppl=(5.0, 5.0, 4.97))
    assert verdict(C.claim_scale_control, rms, cs(RAW, ppl=(4.6, 4.55)), cs(C.PER_LOOP_FINAL, ppl=(4.6, 4.55))) \
        == C.REPRODUCED
    assert verdict(C.claim_scale_control, rms, cs(RAW, ppl=(4.6, 4.55)), cs(C.PER_LOOP_FINAL, ppl=(4.96,))) \
        == C.NOT_REPRODUCED  # < 1% better is not enough
    assert verdict(C.claim_scale_control, rms) == C.NOT_RUN
    assert verdict(C.claim_scale_control, cs(RAW, ppl=(4.55,))) == C.NOT_RUN


def test_claim_g_clamp():
    rms = dict(ppl=(100.0, 100.0, 100.0))  # CE gap to raw: log(100) - log(50) = 0.69 nats -> registered threshold 0.17
    raw = cs(RAW, ppl=(50.0, 50.0, 50.0))
    # the rule in force reads freeze_loop1 only, against the fixed bound; remove_radial is reported beside it
    res = C.claim_freeze({s.cond: s for s in (cs(RMS, clamp={"freeze_loop1": 0.015, "remove_radial": 0.3}, **rms),
                                               raw)})
    assert res.verdict == C.REPRODUCED and "remove_radial |ΔCE| 0.3000" in res.ours
    assert verdict(C.claim_freeze, cs(RMS, clamp={"freeze_loop1": 0.05, "remove_radial": 0.01}, **rms), raw) \
        == C.NOT_REPRODUCED  # 0.05 > 0.02 nats although it is under a quarter of the CE gap (0.17)
    # as registered: the worse of remove_radial and freeze_loop1 (other clamp modes never enter)
    assert verdict(C.claim_clamp, cs(RMS, clamp={"freeze_loop1": 0.05, "remove_radial": -0.1,
                                                 "remove_radial_from_embedding": 0.9}, **rms), raw) == C.REPRODUCED
    assert verdict(C.claim_clamp, cs(RMS, clamp={"freeze_loop1": 0.05, "remove_radial": -0.3}, **rms), raw) \
        == C.NOT_REPRODUCED
    # the fixed bound needs no raw condition
    assert verdict(C.claim_freeze, cs(RMS, clamp={"freeze_loop1": 0.005}, **rms)) == C.REPRODUCED
    assert verdict(C.claim_freeze, cs(RMS, clamp={"freeze_loop1": 0.05}, **rms)) == C.NOT_REPRODUCED
    assert verdict(C.claim_freeze, cs(RMS, **rms), raw) == C.NOT_RUN
    assert verdict(C.claim_clamp, cs(RMS, **rms), raw) == C.NOT_RUN


def test_claims_from_run_directories(grid):
    res = {r.id: r for r in C.evaluate_groups(group_runs(runs_of(grid)))}
    assert res["a"].verdict == "reproduced (2/2 seeds)"  # 1200 vs 12; seeds 1 and 2 of both conditions
    assert res["c"].verdict == "reproduced (1/1 seed)"  # 8 ≤ 10·√d and 1200 ≥ 10 × 8; only seed 1 has the inter-loop run
    assert res["d"].verdict == "reproduced (1/1 seed)"  # 1e-12 vs 1e-2; raw seed 2 has no radial.json
    assert res["e"].outcome == C.REPRODUCED  # flat vs 30 -> 8
    # (f) amended: raw is worse at exit 2 (12 vs 11); as registered (final exit only: 8 vs 11) it held
    assert res["f"].outcome == C.NOT_REPRODUCED and res["f"].registered_verdict.startswith(C.REPRODUCED)
    assert res["f"].amendment.startswith("amended after results, because")
    assert res["g"].outcome == C.REPRODUCED  # |ΔCE| 0.002 ≤ 0.02 nats
    assert res["e2"].outcome == C.REPRODUCED  # raw gains 73% from depth, RMSNorm 0%
    assert res["c"].registered_verdict == "" and "the rule as first registered" in res["c"].amendment
    assert res["c-acc"].kind == C.SANITY and res["c-acc"].outcome == C.REPRODUCED  # A 1.33 vs 20 (residual)
    assert res["c-depth"].outcome == C.REPRODUCED  # G 55% with inter-loop norm vs 0% residual
    assert res["a"].seed_verdicts == {1: C.REPRODUCED, 2: C.REPRODUCED}
    assert res["c"].seed_verdicts == {1: C.REPRODUCED, 2: C.NOT_RUN}
    assert all(r.rule for r in res.values())


def test_verdict_that_flips_between_seeds_says_mixed(tmp_path):
    # (a) drift: ratio 100 in seeds 1 and 2, 2 in seed 3 -> the seed means pass, one seed fails
    root = tmp_path / "runs"
    for seed, norm in ((1, 1000.0), (2, 1000.0), (3, 20.0)):
        make_run(root, seed=seed, norm_k=(5.0, 8.0, norm))
        make_run(root, readout="raw", seed=seed, exit_ppl=(30.0, 12.0, 8.0), norm_k=(5.0, 8.0, 10.0))
    res = {r.id: r for r in C.evaluate_groups(group_runs(runs_of(root)))}
    a = res["a"]
    assert a.mean_verdict == C.REPRODUCED  # mean 673 vs 10
    assert a.seed_verdicts == {1: C.REPRODUCED, 2: C.REPRODUCED, 3: C.NOT_REPRODUCED}
    assert a.verdict == "mixed: 2/3 seeds (seed means: reproduced)" and a.outcome == C.MIXED
    row = a.as_dict()
    assert (row["seeds_reproduced"], row["seeds_evaluated"]) == (2, 3)
    assert row["per_seed"] == "1: reproduced; 2: reproduced; 3: not reproduced"
    assert res["d"].verdict == "reproduced (3/3 seeds)"  # the radial rule holds in every seed
    text = report_markdown(runs_of(root), tmp_path / "out", tmp_path / "out" / "REPORT.md", "t")
    assert "mixed: 2/3 seeds" in text and "1 mixed between seeds" in text


def test_combine_verdicts():
    R, N = C.REPRODUCED, C.NOT_REPRODUCED
    assert C.combine(R, {1: R, 2: R, 3: R}) == "reproduced (3/3 seeds)"
    assert C.combine(N, {1: N, 2: N}) == "not reproduced (0/2 seeds)"
    assert C.combine(N, {1: R, 2: N, 3: N}) == "mixed: 1/3 seeds (seed means: not reproduced)"
    assert C.combine(N, {1: R, 2: R}) == "mixed: 2/2 seeds (seed means: not reproduced)"  # means disagree
    assert C.combine(R, {1: R, 2: C.NOT_RUN}) == "reproduced (1/1 seed)"  # seed 2 cannot be evaluated
    assert C.combine(C.NOT_RUN, {1: C.NOT_RUN}) == C.NOT_RUN


# ---------------------------------------------------------------------------
# figures, CLI, determinism
# ---------------------------------------------------------------------------
def test_figures_are_valid_pngs(figures):
    import matplotlib.image as mpimg
    paths = figures
    assert sorted(p.name for p in paths) == sorted(f"{n}.png" for n in FIGURES)
    for p in paths:
        assert p.read_bytes().startswith(PNG_MAGIC)
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 300
    assert not list(paths[0].parent.glob(".*"))  # no temp files left


def _snapshot(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_cli_outputs_are_deterministic(grid, tmp_path, monkeypatch):
    from loopscale.cli import main
    monkeypatch.chdir(tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text("experiments:\n  t:\n    description: a test\n    sizes: {smoke: {preset: smoke}}\n"
                      "    seeds: [1, 2, 3, 4]\n")
    seeds = sorted(str(p) for p in grid.glob("*/seed*"))
    outs = []
    for i, order in enumerate((seeds, seeds[::-1])):  # the order of --runs does not matter
        res = tmp_path / f"results{i}"
        assert main(["report", "tables", "--runs", *order, "--out", str(res)]) == 0
        assert main(["report", "figures", "--runs", *order, "--out", str(res / "figures")]) == 0
        assert main(["report", "write", "--runs", *order, "--results", str(res), "--params", str(params),
                     "--experiment", "t", "--out", str(res / "REPORT.md")]) == 0
        outs.append(_snapshot(res))
    assert outs[0].keys() == outs[1].keys()
    for name in outs[0]:
        assert outs[0][name] == outs[1][name], name
    names = set(outs[0])
    for t in ("main", "depth", "norms", "radial", "lemma", "clamp", "scale", "halting", "drift", "runs", "claims"):
        assert f"{t}.csv" in names and f"{t}.md" in names
    assert "per_seed.csv" in names and "figures/drift.png" in names and "figures/ppl_depth.pdf" in names
    report = outs[0]["REPORT.md"].decode()
    assert "](figures/norm_per_loop.png)" in report and "](main.csv)" in report
    assert "a test" in report and "diverged at step 17" in report
    for cid in "abcdefg":
        assert f"| ({cid}) " in report
    claims = pd.read_csv(tmp_path / "results0" / "claims.csv")
    assert set(claims["outcome"]) <= {C.REPRODUCED, C.NOT_REPRODUCED, C.MIXED, C.NOT_RUN}
    assert (claims["seeds_evaluated"] >= claims["seeds_reproduced"]).all()


def test_no_runs_is_an_error(tmp_path):
    from loopscale.cli import main
    (tmp_path / "empty").mkdir()
    assert main(["report", "tables", "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2


# ---------------------------------------------------------------------------
# tidy per-seed table, drift law, PDFs
# ---------------------------------------------------------------------------
def test_per_seed_csv_schema(grid, tmp_path):
    from loopscale.report.tables import COLUMNS
    runs = runs_of(grid)
    write_tables(build_tables(runs), tmp_path)
    df = pd.read_csv(tmp_path / "per_seed.csv")
    assert list(df.columns) == COLUMNS
    assert len(df) == len(runs) * K  # one row per run × exit, every run shown
    for col in ("params", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "vocab_size", "n_loops", "k", "seed",
                "ppl", "ce", "norm", "radial_fraction", "penalty_weight"):
        assert pd.api.types.is_numeric_dtype(df[col]), col
    assert set(df["readout"]) == {"rmsnorm", "raw"} and set(df["recurrence"]) == {"residual", "inter_loop_norm"}
    done = df[(df.status == "completed") & (df.condition_id == condition("rmsnorm", "per_loop").slug)]
    assert sorted(done.seed.unique()) == [1, 2]
    # groupby answers the tables' questions: seed mean of the exit-K PPL
    assert done[done.k == K].ppl.mean() == pytest.approx(11.0)
    assert done[(done.seed == 1)].sort_values("k").norm.tolist() == [50.0, 300.0, 1000.0]
    assert (done.radial_fraction == 1e-12).all()
    assert df[df.status != "completed"].ppl.isna().all()  # diverged/failed runs: rows without values
    raw2 = df[(df.readout == "raw") & (df.seed == 2)]
    assert raw2.radial_fraction.isna().all() and raw2.ppl.notna().all()  # no eval files: exits from summary.json


def test_drift_law_recovers_a_power_law_and_a_log_law():
    from loopscale.report import extrapolation as drift
    t = np.arange(20, 2001, 20, dtype=float)
    fits = drift.fit_laws(t, 3.0 * t ** 0.7)
    assert drift.choose(fits).law == "power" and fits["power"].b == pytest.approx(0.7)
    assert fits["power"].r2 == pytest.approx(1.0) and not fits["log"].r2 > 0.99  # NaN: predicts <= 0 early
    fits = drift.fit_laws(t, 50 + 10 * np.log(t))
    assert drift.choose(fits).law == "log" and fits["log"].r2 == pytest.approx(1.0)
    assert fits["log"].predict(1e4) == pytest.approx(50 + 10 * math.log(1e4))
    # the paper's 44M recipe on its token stream: 103,227,021 WikiText-103 words × 2.05 regex tokens per word,
    # 257-token windows every 128 tokens, batch 64, 4 epochs (≈100k steps, not the ≈50k that words would give)
    n = round(103_227_021 * 2.05)
    windows = -(-(n - 256) // 128)
    assert drift.paper_steps() == 4 * -(-windows // 64) == 103328  # the official DataLoader keeps the short batch
    assert drift.paper_steps(batch_size=32) == 206656


def test_drift_table_extrapolates_with_an_interval(tmp_path):
    from loopscale.report.extrapolation import drift_table, paper_steps
    root = tmp_path / "runs"
    for seed in (1, 2):
        d = make_run(root, seed=seed)
        recs = [{"step": s, "norm": [1.0, 2.0, 5.0 * s ** 0.5 * (1 + 0.01 * seed)], "ce": [3.0] * 3}
                for s in range(10, 301, 10)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    make_run(root, readout="raw", seed=1)  # 3 log records: too few for a fit
    t = drift_table(group_runs(runs_of(root)))
    row = t.df[t.df.condition_id == condition("rmsnorm", "per_loop").slug].iloc[0]
    assert row.law == "power" and row.power_b == pytest.approx(0.5, abs=0.01) and row.power_r2 > 0.99
    assert row.n_seeds == 2 and row.fit_from_step == 60  # from 0.2 × the last step (300) on
    expect = 5.0 * 1.015 * paper_steps() ** 0.5
    assert row.norm_K_at_target == pytest.approx(expect, rel=0.02)
    assert row.ci_low <= row.norm_K_at_target <= row.ci_high and row.ci_high / row.ci_low < 1.2
    # both laws extrapolated to both paper targets; the band spans both laws' intervals
    assert row.steps_44m == paper_steps() and row.steps_129m == paper_steps(batch_size=32)
    assert row.band_44m_low <= min(row.power_44m_low, row.log_44m_low)
    assert row.band_44m_high >= max(row.power_44m_high, row.log_44m_high) > row.power_at_44m
    assert row.power_at_129m > row.power_at_44m and row.bootstrap == "runs"
    raw = t.df[t.df.condition_id == condition("raw", "per_loop").slug].iloc[0]
    assert raw.law == "" and math.isnan(raw.norm_K_at_target)
    assert "too few log records" in t.md and "extrapolation" in t.md


def test_every_figure_also_as_pdf(figures):
    paths = figures
    assert paths
    for p in paths:
        pdf = p.with_suffix(".pdf")
        assert pdf.read_bytes().startswith(b"%PDF-"), pdf


def test_workflow_captions_and_dvc_plots_name_every_figure():
    """The figure list lives in loopscale.report.figures; the Snakemake rule's outputs, the
    report captions and dvc.yaml's plots must name the same figures."""
    repo = Path(__file__).resolve().parents[1]
    smk = (repo / "workflow" / "rules" / "report.smk").read_text()
    listed = ast.literal_eval(re.search(r"^FIGURES = (\[.*?\])", smk, re.S | re.M).group(1))
    assert listed == list(FIGURES)
    captions = re.findall(r"^(\w+)$", (repo / "workflow" / "report" / "figures.rst").read_text(), re.M)
    assert captions == list(FIGURES)
    plots = {p for p in yaml.safe_load((repo / "dvc.yaml").read_text())["plots"] if isinstance(p, str)}
    exps = {p.split("/")[1] for p in plots}  # every experiment dvc.yaml plots shows all its figures
    assert {"smoke", "smoke_dvc", "cpu", "cpu_long"} <= exps
    assert plots == {f"results/{exp}/figures/{f}.png" for exp in exps for f in FIGURES}


def test_drift_law_never_extrapolates_a_negative_norm():
    from loopscale.report import extrapolation as drift
    t = np.arange(20, 401, 20, dtype=float)
    n = 16.0 - 2.4 * np.log(t) + 0.01 * np.sin(t)  # a falling norm: the log law reaches 0 by ~800 steps
    fits = drift.fit_laws(t, n)
    assert fits["log"].r2 > fits["power"].r2 and fits["log"].predict(5e4) < 0
    chosen = drift.choose(fits, 5e4)
    assert chosen.law == "power" and chosen.predict(5e4) > 0
    fits = drift.fit_laws(t, 0.1 * t ** 1.4)
    assert math.isnan(fits["log"].r2)  # the log law predicts norms <= 0 at early steps: no R²


def test_ppl_axes_zoom_to_the_band_at_k_train():
    import matplotlib.pyplot as plt
    from loopscale.report.figures import _lift_titles, _zoom
    fig, (top, ax) = plt.subplots(2, 1)
    ax._overview = top
    ax.plot([1, 2, 3, 4], [5000.0, 40.0, 20.5, 19.0])  # one extreme exit, the band 17-22 at K=4
    ax.plot([1, 2, 3, 4], [300.0, 25.0, 18.0, 17.0])
    ax.axvline(4)
    ax.set_title("PPL")
    _zoom(ax, band=[19.0, 17.0], values=[5000.0, 40.0, 20.5, 19.0, 300.0, 25.0, 18.0, 17.0])
    lo, hi = ax.get_ylim()
    assert 16.5 < lo < 17.0 and 19.0 < hi < 19.5 and ax.get_yscale() == "linear"  # the band, not 17-5000
    assert top.get_yscale() == "log" and len(top.get_lines()) == 3  # every line, the full range, K_train
    assert top.get_ylim()[1] >= 5000.0
    _lift_titles(fig)
    assert top.get_title() == "PPL" and ax.get_title() == ""
    plt.close(fig)


# ---------------------------------------------------------------------------
# the amended and added rules, registered verdicts, robustness
# ---------------------------------------------------------------------------


def test_claim_c_amended_tests_accumulation_not_magnitude():
    flat = (10.0, 10.0, 10.0, 10.0)
    # inter-loop norm: large but flat across loops (A = 1.0); residual accumulates (A = 4)
    il = cs_exits(C.INTER_LOOP, flat, (400.0, 410.0, 405.0, 400.0), growth=0.49)
    res = cs_exits(RMS, flat, (500.0, 1000.0, 1500.0, 2000.0), growth=0.45)
    r = C.claim_accumulation({s.cond: s for s in (il, res)})
    assert r.verdict == C.REPRODUCED and r.id == "c-acc"
    # the magnitude rule, (c) as registered and in force again, fails on the same numbers (400 > 10·√64 = 80)
    r = C.claim_inter_loop({s.cond: s for s in (il, res)})
    assert r.verdict == C.NOT_REPRODUCED
    assert "t^0.49" in r.ours and "‖H_K‖ 400" in r.ours  # magnitude and growth reported
    # accumulation inside the inter-loop model (A = 3) fails; so does a residual model that does not accumulate
    il3 = cs_exits(C.INTER_LOOP, flat, (100.0, 200.0, 250.0, 300.0))
    assert verdict(C.claim_accumulation, il3, res) == C.NOT_REPRODUCED
    res1 = cs_exits(RMS, flat, (500.0, 520.0, 530.0, 540.0))
    assert verdict(C.claim_accumulation, il, res1) == C.NOT_REPRODUCED  # 1.08 < 2 × 1.0
    assert verdict(C.claim_accumulation, il) == C.NOT_RUN


def test_claim_e2_depth_gain():
    rms = cs_exits(RMS, (4.98, 4.95, 4.95, 4.97), (1, 2, 3, 4))
    raw = cs_exits(RAW, (4.68, 4.55, 4.54, 4.55), (1, 1, 1, 1))
    fin = cs_exits(C.PER_LOOP_FINAL, (4.70, 4.57, 4.56, 4.55), (1, 1, 1, 1))
    assert verdict(C.claim_depth_gain, rms, raw, fin) == C.REPRODUCED  # paper Table 1 129M
    flat = cs_exits(C.PER_LOOP_FINAL, (4.70, 4.70, 4.70, 4.69), (1, 1, 1, 1))
    assert verdict(C.claim_depth_gain, rms, raw, flat) == C.NOT_REPRODUCED  # 0.2% < 1%
    steep_rms = cs_exits(RMS, (5.5, 5.0, 4.9, 4.8), (1, 2, 3, 4))  # the drifting model gains 12.7%
    assert verdict(C.claim_depth_gain, steep_rms, raw) == C.NOT_REPRODUCED
    assert verdict(C.claim_depth_gain, raw) == C.NOT_RUN


def test_claim_f_amended_compares_at_matched_depth():
    rms = cs_exits(RMS, (4.98, 4.95, 4.95, 4.97), (1, 2, 3, 4))
    raw = cs_exits(RAW, (4.68, 4.55, 4.54, 4.55), (1, 1, 1, 1))
    assert verdict(C.claim_matched_depth, rms, raw) == C.REPRODUCED
    # better at K but worse at exit 2: the registered rule passes, the amended one does not
    late = cs_exits(C.PER_LOOP_FINAL, (6.0, 5.2, 4.9, 4.5), (1, 1, 1, 1))
    assert verdict(C.claim_scale_control, rms, late) == C.REPRODUCED
    assert verdict(C.claim_matched_depth, rms, late) == C.NOT_REPRODUCED
    # exit 1 is not compared (k = 2..K)
    assert verdict(C.claim_matched_depth, rms, cs_exits(RAW, (9.0, 4.5, 4.5, 4.5), (1, 1, 1, 1))) == C.REPRODUCED


def test_claim_g_amended_uses_freeze_loop1_only():
    rms = dict(ppl=(100.0, 100.0, 100.0))  # gap to raw 0.69 nats -> registered threshold 0.17
    raw = cs(RAW, ppl=(50.0, 50.0, 50.0))
    big_remove = cs(RMS, clamp={"freeze_loop1": 0.015, "remove_radial": -0.3}, **rms)
    assert verdict(C.claim_freeze, big_remove, raw) == C.REPRODUCED
    assert verdict(C.claim_clamp, big_remove, raw) == C.NOT_REPRODUCED  # registered: max over modes
    r = C.claim_freeze({s.cond: s for s in (big_remove, raw)})
    assert "remove_radial |ΔCE| 0.3000" in r.ours  # reported beside it
    assert verdict(C.claim_freeze, cs(RMS, clamp={"freeze_loop1": 0.2}, **rms), raw) == C.NOT_REPRODUCED
    assert verdict(C.claim_freeze, cs(RMS, clamp={"remove_radial": 0.01}, **rms), raw) == C.NOT_RUN


def test_robustness_line_shows_the_verdict_over_thresholds():
    spec = next(s for s in C.CLAIM_SPECS if s.fn is C.claim_drift)
    t = {s.cond: s for s in (cs(RMS, norm=300.0), cs(RAW, norm=20.0))}  # ratio 15
    assert C.robustness(spec, t) == "ratio_min 3, 5, 10: reproduced; 20, 50: not reproduced"
    assert C.robustness(spec, {RMS: cs(RMS)}) == ""  # not run at any threshold
    # every grid holds the registered default, and every rule accepts its knob
    for s in C.CLAIM_SPECS:
        import inspect
        default = inspect.signature(s.fn).parameters[s.knob].default
        assert default in s.grid, s.fn.__name__


def test_claims_markdown_keeps_registered_rule_and_verdict(grid, tmp_path):
    results = C.evaluate_groups(group_runs(runs_of(grid)))
    assert [r.id for r in results] == ["a", "b", "b-pen", "c", "c-acc", "c-depth", "d", "e", "e2", "f", "g", "g-ctrl"]
    md = C.claims_markdown(results)
    # three rules changed after results show the registered rule and its verdict: (b), (f), (g)
    assert md.count("Registered rule: ") == 3
    assert "Registered rule: every present condition of {per-loop CE + raw readout, terminal CE + raw readout, " \
           "per-loop CE + RMSNorm readout + norm penalty" in md
    evidence, sanity = md.split("## Sanity checks")
    assert "(d) Scale-invariant" in sanity and "(d) Scale-invariant" not in evidence
    assert "(b-pen)" in sanity and "(c-acc)" in sanity and "(g-ctrl)" in evidence.split("## Researcher")[0]
    rows = {r.id: r.as_dict() for r in results}
    assert rows["a"]["robustness"].startswith("ratio_min ") and rows["a"]["amendment"] == ""
    assert rows["g"]["registered_rule"].startswith("on per-loop CE + RMSNorm, max over clamps")


def test_drift_bootstrap_resamples_runs_or_blocks_never_records():
    from loopscale.report import extrapolation as drift
    a = (np.arange(10.0, 110.0, 10.0), np.full(10, 1.0))
    b = (np.arange(10.0, 110.0, 10.0), np.full(10, 2.0))
    for t, y in drift.bootstrap_resamples([a, b], n=50):
        # whole runs: each resample is two runs' records, each run's records all present
        assert len(t) == 20 and set(np.unique(y)) <= {1.0, 2.0} and (np.sum(y == 1.0) % 10 == 0)
    size = 10 // drift.BLOCKS
    for t, y in drift.bootstrap_resamples([a], n=50):
        # one run: BLOCKS blocks of consecutive steps
        assert len(t) == drift.BLOCKS * size
        blocks = t.reshape(drift.BLOCKS, size)
        assert (np.diff(blocks, axis=1) == 10.0).all()


def test_norm_per_loop_draws_the_headline_condition_on_top_and_labels_it(tmp_path, monkeypatch):
    from loopscale.report import figures as Fg
    root = tmp_path / "runs"
    make_run(root, seed=1, norm_k=(100.0, 190.0, 374.0))
    make_run(root, readout="layernorm", seed=1, norm_k=(101.0, 191.0, 376.0))  # almost the same curve
    make_run(root, readout="raw", seed=1, norm_k=(5.0, 5.0, 5.1))
    got = {}
    monkeypatch.setattr(Fg, "save_figure", lambda fig, path: got.setdefault("fig", fig) and path)
    Fg.fig_norm_per_loop(group_runs(runs_of(root)), tmp_path / "f.png")
    ax = got["fig"].axes[0]
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 3]
    top = max(lines, key=lambda ln: ln.get_zorder())
    assert list(top.get_ydata()) == [100.0, 190.0, 374.0]  # per-loop RMSNorm, not LayerNorm, on top
    texts = [t.get_text() for t in ax.texts]
    assert any("per-loop CE + RMSNorm readout: ‖H_K‖ = 374" in t for t in texts)
    assert ax.get_ylim()[1] >= 374 * 1.8


def test_a_pipeline_check_says_so_and_leaves_out_verdicts_drift_and_empty_parts(tmp_path):
    """`evidence: false` (params.yaml; smoke): REPORT.md opens with the banner, gives no claim
    verdicts and no drift extrapolation; in any report, a figure none of whose panels has data
    and a table without rows are left out and named in one line. The same runs as evidence
    keep the verdicts."""
    from loopscale.report.figures import FIGURES, no_data
    from loopscale.report.document import NOT_EVIDENCE_FIGURES, has_data
    root = tmp_path / "runs"
    make_run(root, seed=1, diags=("depth", "norms"))
    make_run(root, readout="raw", seed=1, diags=("depth", "norms"))
    runs = runs_of(root)
    tables = build_tables(runs)
    write_tables(tables, tmp_path / "out")
    paths = write_figures(runs, tmp_path / "fig")
    empty = {p.stem: no_data(p) for p in paths if no_data(p)}
    assert empty and len(empty) < len(paths)  # this grid has both kinds (radial, lemma, scale: not run)
    assert "radial_vs_norm" in empty and "norm_per_loop" not in empty
    for check, params in ((True, {"evidence": False}), (False, {})):
        text = report_markdown(runs, tmp_path / "out", tmp_path / "out" / "REPORT.md", "t", params=params,
                               figures_dir=tmp_path / "fig")
        lines = text.splitlines()
        assert ("not evidence" in lines[2]) is check and ("**Verdicts:**" in text) is not check
        assert (C.NOT_RUN in text) is not check  # a claim verdict of the claims table
        shown = set(re.findall(r"!\[[^]]*\]\([^)]*/(\w+)\.png\)", text))
        assert shown == set(FIGURES) - set(empty) - (set(NOT_EVIDENCE_FIGURES) if check else set())
        left_out = [line for line in lines if line.startswith("Left out, no data") and ".png" in line]
        assert len(left_out) == 1 and set(re.findall(r"`(\w+)\.png`", left_out[0])) == \
            set(empty) - (set(NOT_EVIDENCE_FIGURES) if check else set())
        titles = set(re.findall(r"^### (.+)$", text, re.M))
        assert all(has_data(t) for t in tables if t.title in titles)
        no_rows = [t.title for t in tables if t.md and not has_data(t)]
        assert no_rows and not set(no_rows) & titles and all(title in text for title in no_rows)
        drift = next(t for t in tables if t.name == "drift")
        assert (drift.title in titles) == (not check and has_data(drift) and bool(drift.md))


def test_report_write_judges_an_experiment_by_its_own_claims_family(tmp_path, capsys):
    """`loopscale report write` reads the experiment's section of params.yaml (its `claims:`
    family and pre-registration): a dose experiment's REPORT.md gives the dose rules (D1–D4)
    with their thresholds and names the pre-registration, not the paper's (a)–(g)."""
    from loopscale.cli import main
    from loopscale.report import dose as D
    root = tmp_path / "runs"
    lams = (0.0, 1e-3, 1e-2, 1e-1)
    for i, lam in enumerate(lams):
        for seed in (1, 2):
            d = make_run(root / f"lam{i}", regularizer="norm_penalty" if lam else "none", seed=seed,
                         norm_k=(5.0, 8.0, 400.0 / (1 + 100 * lam)), exit_ppl=(30.0, 20.0 * (1 - lam), 10.0 - lam))
            rec = json.loads((d / "config.json").read_text())
            rec["config"]["objective"]["penalty_weight"] = lam or 0.01
            (d / "config.json").write_text(json.dumps(rec))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"experiments": {"dosey": {"claims": {
        "family": "dose", "preregistered": "studies/dosey/preregistration.md"}}}}))
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "REPORT.md"
    assert main(["report", "write", "--runs", str(root), "--results", str(tmp_path / "out"), "--params", str(params),
                 "--experiment", "dosey", "--out", str(out)]) == 0
    text = out.read_text()
    ids = set(re.findall(r"^\| \((\w+(?:-\w+)?)\) ", text, re.M))
    assert ids == {"D1", "D2", "D3", "D4"}
    assert "studies/dosey/preregistration.md" in text and D.thresholds_text() in text
    assert C.thresholds_text() not in text
    verdicts = re.search(r"\*\*Verdicts:\*\* .*\(of (\d+);", text)
    assert verdicts and int(verdicts.group(1)) == 4


def test_diverged_run_is_shown_as_diverged_in_the_aggregate(smoke_data, reference, tmp_path):
    bad = tmp_path / "runs" / "diverged"
    s = train(preset("smoke", {"model": {"readout": "raw"}, "train": {"lr": 1e6, "max_steps": 40}}),
              smoke_data, bad, progress=False)
    assert s["status"] == "diverged"
    out = tmp_path / "results"
    assert cli.main(["report", "tables", "--runs", str(reference), str(bad), "--out", str(out)]) == 0
    import pandas as pd
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 2  # the diverged run is listed, not dropped
    assert runs.astype(str).apply(lambda col: col.str.contains("diverged")).any().any()
    for cell in runs.select_dtypes("number").to_numpy().ravel():  # no inf written as a number
        assert cell != float("inf")


REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# report: only seeds of one experiment are averaged
# ---------------------------------------------------------------------------
def _set(run: Path, section: str, key: str, value) -> None:
    cj = json.loads((run / "config.json").read_text())
    cj["config"][section][key] = value
    (run / "config.json").write_text(json.dumps(cj))


def test_two_copies_of_one_run_are_refused(tmp_path, capsys):
    a = make_run(tmp_path / "exp1", seed=1)
    make_run(tmp_path / "exp1", seed=2)
    shutil.copytree(a, tmp_path / "copy" / "seed1")
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    one_line_error(rc, err, "two copies", "seed 1", str(a), str(tmp_path / "copy" / "seed1"))
    assert not (tmp_path / "out").exists()


def test_runs_of_two_experiments_in_one_row_are_refused(tmp_path, capsys):
    short = make_run(tmp_path / "short", seed=1)
    long_ = make_run(tmp_path / "long", seed=2)
    _set(short, "train", "max_steps", 20)
    _set(long_, "train", "max_steps", 1500)
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    one_line_error(rc, err, "not seeds of one experiment", "train.max_steps", "20", "1500")
    assert not (tmp_path / "out").exists()
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path, "--results", tmp_path,
                      "--out", tmp_path / "REPORT.md")
    one_line_error(rc, err, "not seeds of one experiment")
    assert not (tmp_path / "REPORT.md").exists()


def test_seeds_differing_only_in_free_settings_are_one_experiment(tmp_path, capsys):
    a = make_run(tmp_path / "e", seed=1)
    b = make_run(tmp_path / "e", seed=2)
    _set(a, "train", "threads", 1)
    _set(b, "train", "threads", 8)
    _set(b, "train", "device", "cuda")
    _set(b, "train", "ckpt_every", 7)
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    assert rc == 0, err
    import pandas as pd
    main = pd.read_csv(tmp_path / "out" / "main.csv")
    assert list(main["n"]) == [2]


# ---------------------------------------------------------------------------
# report: a mistyped value marks its run's file, never crashes the grid
# ---------------------------------------------------------------------------
def _edit(path: Path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d, allow_nan=True))


def _grid(root: Path) -> Path:
    a = make_run(root, seed=1)
    make_run(root, seed=2)
    make_run(root, readout="raw", seed=1)
    return a


@pytest.mark.parametrize("file, change, words", [
    ("eval/depth.json", lambda d: d["exits"][-1].update(norm="big"), "exits[2].norm is 'big', not a number"),
    ("eval/depth.json", lambda d: d["exits"][-1].update(ce=[1, 2]), "exits[2].ce is a list"),
    ("eval/depth.json", lambda d: d["exits"][-1].update(ppl=float("nan")), "exits[2].ppl is NaN"),
    ("eval/depth.json", lambda d: d["exits"][-1].update(norm=-5.0), "exits[2].norm is negative"),
    ("eval/norms.json", lambda d: d["loops"][0].update(k="one"), "loops[0].k is 'one'"),
    ("eval/norms.json", lambda d: d["final"].update(p99="x"), "final.p99 is 'x'"),
    ("eval/radial.json", lambda d: d["loops"][0].update(radial_fraction=[1]), "radial_fraction is a list"),
    ("summary.json", lambda d: d["validation"].update(val_norm="x"), "validation.val_norm is 'x'"),
    ("summary.json", lambda d: d["validation"].update(val_ce=[1.0, float("nan"), 2.0]), "val_ce[1] is NaN"),
])
def test_a_mistyped_metric_marks_its_run_and_says_so(tmp_path, capsys, file, change, words):
    a = _grid(tmp_path / "runs")
    if file == "summary.json":
        (a / "eval" / "depth.json").unlink()  # the summary's values would be the ones used
    _edit(a / file, change)
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path / "runs", "--out", tmp_path / "out")
    assert rc == 0, err
    runs_md = (tmp_path / "out" / "runs.md").read_text()
    row = next(l for l in runs_md.splitlines() if "seed1" in l and "RMSNorm" in l)
    assert "malformed" in row and words in row, row
    assert words in (tmp_path / "out" / "claims.md").read_text()
    import pandas as pd
    main = pd.read_csv(tmp_path / "out" / "main.csv")
    rms = main[main["condition_id"] == "rmsnorm-per_loop-none-residual"].iloc[0]
    if file in ("eval/depth.json", "summary.json"):  # the bad run's final exit counts nowhere
        assert rms["ppl_K_n"] == 1 and rms["norm_K_n"] == 1


def test_an_empty_depth_json_is_unreadable_and_not_replaced_by_the_summary(tmp_path, capsys):
    a = _grid(tmp_path / "runs")
    (a / "eval" / "depth.json").write_text("")
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path / "runs", "--out", tmp_path / "out")
    assert rc == 0, err
    main_md = (tmp_path / "out" / "main.md").read_text()
    assert "eval/depth.json is unusable" in main_md and "seed 1 (unreadable)" in main_md
    row = next(l for l in (tmp_path / "out" / "runs.md").read_text().splitlines() if "seed1" in l and "RMSNorm" in l)
    assert "unreadable: depth" in row and "empty" in row and "missing: depth" not in row


def test_report_write_refuses_an_unknown_experiment_or_missing_results(tmp_path, capsys):
    _grid(tmp_path / "runs")
    (tmp_path / "res").mkdir()
    out = tmp_path / "REPORT.md"
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path / "runs", "--results", tmp_path / "res",
                      "--params", REPO / "params.yaml", "--experiment", "nope", "--out", out)
    one_line_error(rc, err, "no experiment 'nope'")
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path / "runs", "--results", tmp_path / "missing",
                      "--out", out)
    one_line_error(rc, err, "results directory", "not found")
    assert not out.exists()
    rc, err = run_cli(capsys, "report", "write", "--runs", tmp_path / "runs", "--results", tmp_path / "res",
                      "--params", REPO / "params.yaml", "--experiment", "smoke", "--out", out)
    assert rc == 0 and out.exists(), err


def test_seeds_trained_before_a_setting_existed_are_still_one_experiment(tmp_path, capsys):
    a = make_run(tmp_path / "e", seed=1)
    make_run(tmp_path / "e", seed=2)
    cj = json.loads((a / "config.json").read_text())
    del cj["config"]["objective"]["ce_impl"]  # written by a version without it: its default then
    (a / "config.json").write_text(json.dumps(cj))
    rc, err = run_cli(capsys, "report", "tables", "--runs", tmp_path, "--out", tmp_path / "out")
    assert rc == 0, err


def test_report_write_with_a_missing_params_file_is_an_error(tmp_path, capsys):
    rc = cli.main(["report", "write", "--runs", str(tmp_path), "--results", str(tmp_path),
                   "--params", str(tmp_path / "nope.yaml"),
                   "--out", str(tmp_path / "REPORT.md")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "nope.yaml" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "REPORT.md").exists()


def test_a_metrics_log_with_invalid_utf8_does_not_stop_the_report(smoke_data, tmp_path):
    from loopscale.config import preset
    from loopscale.report.runs import _read_jsonl
    from loopscale.train import train
    run = tmp_path / "runs" / "r"
    train(preset("smoke", {"train": {"max_steps": 10}}), smoke_data, run, progress=False)
    good = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(good + b'{"step": 11, "loss": \xff\xfe}\n')
    assert len(_read_jsonl(run / "metrics.jsonl")) == len(good.splitlines())  # the bad line skipped
    assert cli.main(["report", "tables", "--runs", str(run), "--out", str(tmp_path / "results")]) == 0
