"""loopscale's diagnostics against the official release's evaluation scripts, on every
fixture checkpoint (tests/fixtures/official/*/last.pt, written by the unmodified official
trainer; outputs of the official scripts beside them in <cond>/eval/).

Each test converts the checkpoint (tests/official.py), runs the loopscale diagnostic on the
windows the official script used (the first non-overlapping validation windows of
token_ids/validation_ids.json, as many as its command in scripts/commands.sh asked for) and
compares with what the script wrote:
  radial_clamp_intervention.py  eval/radial_clamp/radial_clamp_{per_loop,summary}.csv
  scale_sensitivity.py          eval/scale_sensitivity.log (printed with 4 decimals)
  lemma2_verification.py        eval/lemma2_verification/lemma2_results.json
  token_norm_stats.py           eval/token_norm_stats/token_norm_stats.json
"""
from __future__ import annotations

import csv
import json
import math
import re

import pytest

from loopscale import diagnostics as G
from loopscale.data import DataError
from loopscale.evaluate import tokens_run
from official import (CHECKPOINTS, cond_params, eval_windows, flag, load_official, official_run,
                      trained_conditions, validation_ids)

CE_TOL = 1e-4  # nats, per exit


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_fixture_checkpoint_is_covered():
    # the fixture set: one checkpoint per condition the official trainer ran (scripts/commands.sh)
    conds = trained_conditions()
    assert conds and len(set(conds)) == len(conds)
    assert sorted(p.parent.name for p in CHECKPOINTS) == sorted(conds)


def test_tokens_run_refuses_bad_streams():
    model, cfg = load_official(CHECKPOINTS[0].parent)
    with pytest.raises(DataError, match="fewer than one window"):
        tokens_run(model, cfg, validation_ids()[: cfg.model.seq_len])
    bad = validation_ids().copy()
    bad[5] = cfg.model.vocab_size
    with pytest.raises(DataError, match=rf"token ids must lie in \[0, {cfg.model.vocab_size}\)"):
        tokens_run(model, cfg, bad)


# ---------------------------------------------------------------- radial_clamp_intervention.py
@pytest.mark.parametrize("cond_dir", cond_params())
def test_clamp_equals_official(cond_dir):
    run = official_run(cond_dir)
    res = G.evaluate_diagnostic("clamp", run)  # what `loopscale eval clamp` writes
    n = res["tokens"]
    rows = _csv(cond_dir / "eval" / "radial_clamp" / "radial_clamp_per_loop.csv")
    assert n == int(rows[0]["num_tokens"]) == eval_windows("radial_clamp_intervention", cond_dir.name) * run.seq_len
    official = {(r["mode"], int(r["loop"])): r for r in rows}
    assert {m for m, _ in official} == {"none", *G.OFFICIAL_CLAMP_MODES}
    base = {k: float(official[("none", k)]["ce"]) for k in range(1, run.K + 1)}
    for (mode, k), r in official.items():
        ours = res["modes"][mode][k - 1]
        assert ours["k"] == k
        assert ours["ce"] == pytest.approx(float(r["ce"]), abs=CE_TOL), (mode, k)
        assert ours["delta_ce"] == pytest.approx(float(r["ce"]) - base[k], abs=CE_TOL), (mode, k)
        assert ours["norm"] == pytest.approx(float(r["norm_l2"]), rel=1e-4), (mode, k)
        assert ours["norm_rms"] == pytest.approx(float(r["norm_rms"]), rel=1e-4), (mode, k)
    K = run.K
    for r in _csv(cond_dir / "eval" / "radial_clamp" / "radial_clamp_summary.csv"):
        s = res["summary"][r["mode"]]
        assert s["delta_ce_vs_none"] == pytest.approx(float(r["delta_ce_vs_none"]), abs=CE_TOL)
        assert s["rel_ppl_vs_none"] == pytest.approx(float(r["rel_ppl_vs_none"]), rel=CE_TOL)
        assert s["ppl_K"] == pytest.approx(float(r[f"ppl_K{K}"]), rel=CE_TOL)
        assert s["norm_ratio_vs_none"] == pytest.approx(float(r["norm_l2_ratio_vs_none"]), rel=1e-4)


@pytest.mark.parametrize("cond_dir", cond_params(oracle=False))
def test_official_clamps_leave_loop1_alone(cond_dir):
    """Both official clamps leave loop 1 as it is (there is no previous state); loopscale's
    earlier variant clamps loop 1 against the embedding and so changes exit 1."""
    res, _ = G.clamp(official_run(cond_dir))
    for mode in G.OFFICIAL_CLAMP_MODES:
        assert res["modes"][mode][0]["ce"] == res["modes"]["none"][0]["ce"]
    assert abs(res["modes"]["remove_radial_from_embedding"][0]["delta_ce"]) > 1e-4


# ---------------------------------------------------------------- scale_sensitivity.py
_ALPHA_LINE = re.compile(r"α=\s*([0-9.]+): CE=([0-9.]+|nan|inf) PPL=([0-9.]+|nan|inf)")


@pytest.mark.parametrize("cond_dir", cond_params())
def test_scale_equals_official(cond_dir):
    text = (cond_dir / "eval" / "scale_sensitivity.log").read_text(encoding="utf-8")
    official = [(float(a), float(c), float(p)) for a, c, p in _ALPHA_LINE.findall(text)]
    assert [a for a, _, _ in official] == list(G.SCALE_ALPHAS)
    run = official_run(cond_dir)
    res, n = G.scale(run)
    assert n == eval_windows("scale_sensitivity", cond_dir.name) * run.seq_len and res["alphas"] == list(G.SCALE_ALPHAS)
    for row, (a, ce, p) in zip(res["sweep"], official):
        assert row["alpha"] == a
        assert row["ce"] == pytest.approx(ce, abs=5e-5 + 1e-6), a  # printed with 4 decimals
        assert row["ppl"] == pytest.approx(p, rel=1e-5, abs=5e-3), a  # 2 decimals
    assert res["summary"]["ce_alpha1"] == res["sweep"][G.SCALE_ALPHAS.index(1.0)]["ce"]


# ---------------------------------------------------------------- lemma2_verification.py
@pytest.mark.parametrize("cond_dir", cond_params())
def test_lemma_paper_units_equal_official(cond_dir):
    (official,) = json.loads((cond_dir / "eval" / "lemma2_verification" / "lemma2_results.json").read_text()).values()
    L = len(official["s"])
    run = official_run(cond_dir, lemma_loops=L)
    res, n = G.lemma(run)
    assert n == eval_windows("lemma2_verification", cond_dir.name) * run.seq_len
    paper = res["paper_units"]["loops"]
    assert len(paper) == L == int(flag("lemma2_verification", cond_dir.name, "--target-K"))
    scale = max(official["s"])
    d = run.cfg.model.d_model
    for k, row in enumerate(paper):
        assert row["s"] == pytest.approx(official["s"][k], rel=1e-4), k
        if k < L - 1:
            # the radial increment is a channel sum of size ~d·s: compared relative to that
            assert row["radial_increment"] == pytest.approx(official["radial_increment"][k], rel=1e-4,
                                                            abs=1e-5 * scale * d), k
            assert row["angular_step"] == pytest.approx(official["angular_step"][k], rel=1e-4, abs=1e-6), k
            assert row["b_perp_estimate"] == pytest.approx(official["b_perp_estimate"][k], rel=1e-4, abs=1e-6), k
    # the L2 version is kept beside it: the same states, other units (‖H‖ = √d · RMS(H))
    for row, prow in zip(res["loops"], paper):
        assert row["scale"] == pytest.approx(prow["s"] * math.sqrt(d), rel=1e-9)


# ---------------------------------------------------------------- token_norm_stats.py
@pytest.mark.parametrize("cond_dir", cond_params())
def test_norms_equal_official_token_norm_stats(cond_dir):
    (official,) = json.loads((cond_dir / "eval" / "token_norm_stats" / "token_norm_stats.json").read_text()).values()
    run = official_run(cond_dir)
    res, n = G.norms(run)
    final = res["final"]
    assert n == final["n_tokens"] == official["n_tokens"] == eval_windows("token_norm_stats", cond_dir.name) * run.seq_len
    for key in ("mean", "median", "p99", "max", "std", "min"):
        assert final[key] == pytest.approx(official[key], rel=1e-5), key
