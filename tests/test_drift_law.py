"""The cross-experiment drift law (loopscale.report.drift_law) on synthetic training logs."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from loopscale.report import drift_law as DL
from loopscale.report.drift import paper_steps

RMS = DL.DRIFTING


def law(t, d, L, lr):  # ‖H_K‖ = 0.5 · t^0.45 · √d^1.2 · L^0.3 · lr^0.2
    return 0.5 * t ** 0.45 * math.sqrt(d) ** 1.2 * L ** 0.3 * lr ** 0.2


def logs(configs, seeds=(1, 2), steps=range(50, 1501, 50), noise=0.02, fn=law, cond=RMS, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for exp, d, L, lr in configs:
        for s in seeds:
            run = f"{exp}/d{d}L{L}lr{lr}/{cond}/seed{s}"
            off = rng.normal(0, noise)  # a per-run offset: records within a run are correlated
            for t in steps:
                rows.append({"experiment": exp, "size": f"d{d}", "condition_id": cond, "seed": s, "run": run,
                             "d_model": d, "n_layers": L, "n_loops": 4, "lr": lr, "batch_size": 16, "seq_len": 64,
                             "step": t, "norm_K": fn(t, d, L, lr) * math.exp(off + rng.normal(0, noise / 4))})
    return pd.DataFrame(rows)


STUDY = [("confirm", d, 2, 1e-3) for d in (32, 64, 128, 256)] + [("confirm", 64, 2, 3e-4), ("confirm", 64, 4, 1e-3)]


def test_the_power_law_recovers_every_factor():
    rec = DL.fit_records(logs(STUDY))
    fitted = DL.fit_drift_law(rec, n_boot=50)
    assert fitted.factors == ("width", "depth", "lr")
    c = fitted.fits["power"].coef
    assert c[1] == pytest.approx(0.45, abs=0.02) and c[2] == pytest.approx(1.2, abs=0.05)
    assert c[3] == pytest.approx(0.3, abs=0.05) and c[4] == pytest.approx(0.2, abs=0.05)
    assert fitted.fits["power"].r2 > fitted.fits["log"].r2
    p = fitted.predict("x", 10_000, d_model=512, n_layers=8, lr=3e-4)
    lo, hi = p.band
    assert lo < law(10_000, 512, 8, 3e-4) < hi and lo <= p.by_law["log"][1] and hi >= p.by_law["power"][2]


def test_collinear_or_constant_factors_are_not_predicted():
    # width and depth change together (as cpu -> cpu_long did): only one of them is identified
    rec = DL.fit_records(logs([("cpu", 64, 2, 1e-3), ("cpu_long", 128, 4, 1e-3)]))
    fitted = DL.fit_drift_law(rec, n_boot=20)
    assert fitted.factors == ("width",)
    p = fitted.predict("44M", paper_steps(), d_model=512, n_layers=8, lr=3e-4)
    assert "do not vary depth" in p.reason and not p.by_law and math.isnan(p.band[0])


def test_held_out_experiment_is_predicted_before_it_is_used():
    configs = STUDY + [("cpu_long", 128, 4, 1e-3)]
    rec = DL.fit_records(logs(configs, seed=1))
    ho = DL.held_out_check(rec, "cpu_long", n_boot=50)
    assert ho.n_runs == 2 and ho.inside is True
    assert DL.held_out_check(rec, "cpu_long", n_boot=50).prediction.band == ho.prediction.band  # deterministic
    assert ho.observed == pytest.approx(law(1500, 128, 4, 1e-3), rel=0.1)
    # a held-out experiment that does not follow the law falls outside the band
    off = logs([("odd", 128, 4, 1e-3)], fn=lambda t, d, L, lr: 20 * law(t, d, L, lr))
    rec2 = DL.fit_records(pd.concat([logs(STUDY), off]))
    assert DL.held_out_check(rec2, "odd", n_boot=50).inside is False
    with pytest.raises(DL.DriftLawError, match="held-out experiment 'nope'"):
        DL.held_out_check(rec, "nope")


def test_fit_records_keep_one_condition_and_the_late_log():
    df = pd.concat([logs(STUDY[:2]), logs(STUDY[:2], cond="raw-per_loop-none-residual")])
    rec = DL.fit_records(df)
    assert set(rec.condition_id) == {RMS} and rec.step.min() >= 0.2 * 1500
    with pytest.raises(DL.DriftLawError, match="lack the column"):
        DL.fit_records(df.drop(columns=["lr"]))


def test_cli_writes_the_report_and_refuses_bad_input_in_one_line(tmp_path):
    for name, cfgs in (("cpu_confirm", STUDY), ("cpu_long", [("cpu_long", 128, 4, 1e-3)])):
        d = tmp_path / name
        d.mkdir()
        logs(cfgs).to_csv(d / "train_norms.csv", index=False)
    out = tmp_path / "law"
    cmd = [sys.executable, "-m", "loopscale.cli", "report", "drift-law", "--results", str(tmp_path / "cpu_confirm"),
           str(tmp_path / "cpu_long"), "--holdout", "cpu_long", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = (out / "drift_law.md").read_text()
    assert "Held-out check" in md and "**inside** the band" in md and "39,207" in md and "56,051" in md
    table = pd.read_csv(out / "drift_law.csv")
    assert list(table.kind) == ["held-out", "paper", "paper"]
    assert (table[table.kind == "paper"].step.tolist() == [paper_steps(), paper_steps(batch_size=32)])
    assert (out / "drift_law.png").stat().st_size > 1000
    assert "Made by `loopscale report drift-law --results" in md and "git commit" in md
    assert "Per configuration" in md and len(pd.read_csv(out / "drift_law_configs.csv")) == len(STUDY) + 1
    bad = subprocess.run(cmd[:6] + [str(tmp_path / "missing"), "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "train_norms.csv: no such file" in bad.stderr


def test_per_configuration_table_shows_where_the_shared_exponent_fails():
    # one width's norm stops growing (exponent 0) while the others follow t^0.45: its own
    # exponent and its measured / law ratio say so; the conforming configurations sit near 1
    def bent(t, d, L, lr):
        return law(t if d != 256 else 300, d, L, lr)
    rec = DL.fit_records(logs(STUDY, fn=bent))
    cfg = DL.per_configuration(DL.fit_drift_law(rec, n_boot=10)).set_index(["d_model", "n_layers", "lr"])
    assert len(cfg) == len(STUDY) and (cfg.runs == 2).all() and (cfg.step == 1500).all()
    flat = cfg.loc[(256, 2, 1e-3)]
    assert abs(flat.own_time_exponent) < 0.05
    assert cfg.drop(index=(256, 2, 1e-3)).own_time_exponent.between(0.4, 0.5).all()
    assert flat.power_ratio < 0.8  # the shared exponent over-predicts the flat one at its last step
    good = DL.per_configuration(DL.fit_drift_law(DL.fit_records(logs(STUDY)), n_boot=10))
    assert good.own_time_exponent.between(0.4, 0.5).all() and good.power_ratio.between(0.9, 1.1).all()
    assert good.measured.to_numpy() == pytest.approx(
        [law(1500, d, L, lr) for d, L, lr in good[["d_model", "n_layers", "lr"]].to_numpy()], rel=0.1)


def test_exponent_spread_and_configuration_scatter():
    # every configuration shares t^0.45: the spread collapses onto the law; an unseen
    # configuration's band is wider than a seen one's only by the (small) configuration scatter
    fitted = DL.fit_drift_law(DL.fit_records(logs(STUDY)), n_boot=20)
    assert all(e == pytest.approx(0.45, abs=0.03) for e in fitted.own_exponents.values())
    lo, hi = fitted.exponent_spread(100_000, d_model=512, n_layers=8, lr=3e-4)
    assert lo <= fitted.fits["power"].predict(100_000, d_model=512, n_layers=8, lr=3e-4) * 1.3 and hi / lo < 1.4
    assert fitted.seen(d_model=64, n_layers=2, lr=1e-3) and not fitted.seen(d_model=512, n_layers=8, lr=3e-4)
    assert math.isnan(fitted.exponent_spread(1000, d_model=64, n_layers=2, lr=1e-3)[0])  # no extrapolation
    # one width that stops growing: its own exponent enters the spread, which then brackets a
    # flat continuation and the shared-exponent law alike
    def bent(t, d, L, lr):
        return law(t if d != 256 else 300, d, L, lr)
    fb = DL.fit_drift_law(DL.fit_records(logs(STUDY, fn=bent)), n_boot=20)
    lo, hi = fb.exponent_spread(100_000, d_model=512, n_layers=8, lr=3e-4)
    at_last = fb.fits["power"].predict(1500, d_model=512, n_layers=8, lr=3e-4)
    assert lo == pytest.approx(at_last * (100_000 / 1500) ** min(fb.own_exponents.values()), rel=1e-9)
    assert lo < fb.fits["power"].predict(100_000, d_model=512, n_layers=8, lr=3e-4) < hi
    p = fb.predict("x", 100_000, d_model=512, n_layers=8, lr=3e-4)
    assert p.exponent_spread == (lo, hi)
    # misfit between configurations widens the band of an unseen configuration, not of a seen one
    assert fb.config_scatter["power"] > fitted.config_scatter["power"]
    seen_band = fb.predict("s", 1500, n_runs=2, d_model=64, n_layers=2, lr=1e-3).band
    unseen_band = fb.predict("u", 1500, n_runs=2, d_model=96, n_layers=2, lr=1e-3).band
    assert unseen_band[1] / unseen_band[0] > seen_band[1] / seen_band[0]
