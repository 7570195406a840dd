"""The pre-registered claims: evidence vs sanity checks, (c-depth), (g) with its control (g-ctrl),
the researcher-choice cells, the claims families (factorial arms, the dose-response D1–D4), the
claims rebuilt from committed CSVs, and the cross-experiment claims matrix -- each on synthetic runs
that pass and that fail the rule."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from loopscale.report import claims as C
from loopscale.report import claims_matrix as M
from loopscale.report import dose as D
from loopscale.report.records import RecordsError, RunRecord, records_from_results
from loopscale.registry import condition

from report_support import cs, cs_exits, make_grid, runs_of, verdict

RMS, RAW, IL = C.PER_LOOP_RMS, C.PER_LOOP_RAW, C.INTER_LOOP
D_MODEL = 64


def rec(cond, seed, ppl, norms, clamp=None, arm="a1", completed=True, train_last=math.nan, median=math.nan):
    """One synthetic run record: exit PPLs and exit norms per k = 1..K, the clamps' ΔCE at exit K."""
    return RunRecord(arm=arm, size=f"(d{D_MODEL}, 2L, K={len(ppl)})", d_model=D_MODEL, K=len(ppl), cond=cond,
                     seed=seed, completed=completed, note="completed" if completed else "diverged at step 3",
                     exit_ppl=list(ppl), exit_ce=[math.log(p) for p in ppl], exit_norm=list(norms),
                     clamp=dict(clamp or {}), norm_train_last=train_last, norm_median=median)


def by_id(results):
    return {(r.arm, r.id): r for r in results}


# ---------------------------------------------------------------------------
# kinds, (c-depth), (g) and (g-ctrl)
# ---------------------------------------------------------------------------
def test_every_claim_has_a_kind_and_sanity_checks_say_why():
    kinds = {C.claim_id(s): s for s in C.CLAIM_SPECS}
    assert {i for i, s in kinds.items() if s.kind == C.SANITY} == {"b-pen", "c-acc", "d"}
    for s in kinds.values():
        assert s.kind in (C.EVIDENCE, C.SANITY)
        assert bool(s.why_sanity) == (s.kind == C.SANITY)
    assert "loss" in kinds["b-pen"].why_sanity and "fixed-RMS" in kinds["c-acc"].why_sanity
    assert kinds["c"].fn({}).claim == "Inter-loop normalisation keeps ‖H_K‖ small"


def test_claim_c_depth_inter_loop_restores_depth_use():
    flat = cs_exits(RMS, (16.0, 16.0, 16.1, 16.2), (1, 2, 3, 4))  # G = -1.2%
    gains = cs_exits(IL, (17.0, 16.0, 15.6, 15.5), (1, 1, 1, 1))  # G = 8.8%
    assert verdict(C.claim_inter_loop_depth, flat, gains) == C.REPRODUCED
    k_invariant = cs_exits(IL, (16.3, 16.3, 16.4, 16.4), (1, 1, 1, 1))  # as flat as the drifting model
    assert verdict(C.claim_inter_loop_depth, flat, k_invariant) == C.NOT_REPRODUCED
    # the threshold is twice the drifting model's gain when that exceeds the 1% floor
    steep = cs_exits(RMS, (20.0, 18.0, 17.0, 16.0), (1, 2, 3, 4))  # G = 20% -> needs 40%
    assert verdict(C.claim_inter_loop_depth, steep, gains) == C.NOT_REPRODUCED
    assert verdict(C.claim_inter_loop_depth, flat) == C.NOT_RUN


def clamp_pair(dce_rms, dce_raw, norms_raw, norms_rms=(100.0, 200.0, 300.0, 400.0)):
    """The drifting and the raw model with their freeze_loop1 ΔCE and exit norms (A = ‖H_K‖/‖H_1‖)."""
    a = cs_exits(RMS, (16.0, 16.0, 16.0, 16.0), norms_rms)
    b = cs_exits(RAW, (15.0, 14.0, 13.5, 13.5), norms_raw)
    a.log_scale, b.log_scale = abs(math.log(norms_rms[-1] / norms_rms[0])), abs(math.log(norms_raw[-1] / norms_raw[0]))
    a.clamp_dce = {"freeze_loop1": dce_rms, "remove_radial": 0.09}
    b.clamp_dce = {"freeze_loop1": dce_raw, "remove_radial": 0.02}
    return a, b


def test_claim_g_is_a_fixed_bound_whatever_the_raw_gap():
    for raw_ppl in (15.9, 5.0):  # a small and a large CE gap to raw: the bound does not move
        raw = cs(RAW, ppl=(raw_ppl,) * 3)
        assert verdict(C.claim_freeze, cs(RMS, ppl=(16.0,) * 3, clamp={"freeze_loop1": 0.019}), raw) == C.REPRODUCED
        assert verdict(C.claim_freeze, cs(RMS, ppl=(16.0,) * 3, clamp={"freeze_loop1": 0.021}), raw) == C.NOT_REPRODUCED
    # the other clamp, a researcher choice
    s = cs(RMS, clamp={"freeze_loop1": 0.01, "remove_radial": 0.09})
    assert verdict(C.claim_freeze, s) == C.REPRODUCED
    assert C.claim_freeze({RMS: s}, mode="remove_radial").verdict == C.NOT_REPRODUCED


def test_claim_g_ctrl_compares_scale_sensitivity_with_the_raw_control():
    # drifting: |ΔCE| 0.016 over ln 4 = 1.39 -> S 0.012; raw: 0.016 over ln 1.12 = 0.113 -> S 0.14
    a, b = clamp_pair(0.016, 0.016, (4.0, 4.2, 4.4, 4.48))
    r = C.claim_clamp_control({a.cond: a, b.cond: b})
    assert r.verdict == C.REPRODUCED and "remove_radial |ΔCE| 0.0900" in r.ours and r.id == "g-ctrl"
    # the raw model moves its scale as much and its CE as little: S(raw) ≤ 2 S(drifting)
    a, b = clamp_pair(0.016, 0.016, (1.0, 2.0, 3.0, 4.0))
    assert C.claim_clamp_control({a.cond: a, b.cond: b}).verdict == C.NOT_REPRODUCED
    # the control's clamp changes its scale by |ln A| < 0.05: uninformative, neither reproduced nor not
    a, b = clamp_pair(0.001, 0.05, (4.0, 4.05, 4.1, 4.1))
    r = C.claim_clamp_control({a.cond: a, b.cond: b})
    assert r.verdict == C.UNINFORMATIVE and r.outcome == C.UNINFORMATIVE
    assert C.combine(C.UNINFORMATIVE, {1: C.UNINFORMATIVE, 2: C.REPRODUCED}) == C.UNINFORMATIVE
    assert verdict(C.claim_clamp_control, a) == C.NOT_RUN  # no raw control


# ---------------------------------------------------------------------------
# researcher choices, per seed
# ---------------------------------------------------------------------------
def drift_records(raw_train_last: float):
    """Seeds 1, 2 of the drifting and raw model; the raw model's training-log ‖H_K‖ given."""
    out = []
    for seed in (1, 2):
        out.append(rec(RMS, seed, (16.0, 16.0, 16.0), (100.0, 300.0, 1000.0), {"freeze_loop1": 0.01,
                                                                             "remove_radial": 0.05},
                       train_last=1000.0))
        out.append(rec(RAW, seed, (16.0, 14.0, 13.0), (4.0, 4.5, 5.0), {"freeze_loop1": 0.05, "remove_radial": 0.03},
                       train_last=raw_train_last))
    return out


def test_choice_cells_and_agreement_with_the_headline():
    res = by_id(C.evaluate_records(drift_records(raw_train_last=5.0)))
    a = res[("a1", "a")]
    # (a): 2 seeds × {mean, median, training log's last}; the median is absent -> not run, not counted
    assert len(a.choice_cells) == 2 * len(C.NORM_STATS)
    assert a.choices_agree() == (4, 4) and "4/4" in a.choices_text()
    g = res[("a1", "g")]  # freeze_loop1 0.01 passes the 0.02 bound, remove_radial 0.05 does not
    assert g.mean_verdict == C.REPRODUCED and g.choices_agree() == (2, 4)
    assert {(o, v) for _, o, _, v in g.choice_cells} == {("freeze_loop1", C.REPRODUCED),
                                                         ("remove_radial", C.NOT_REPRODUCED)}
    # the training log's last ‖H_K‖ of the raw model is 200: (a) under that statistic fails in both seeds
    a = by_id(C.evaluate_records(drift_records(raw_train_last=200.0)))[("a1", "a")]
    assert a.verdict.startswith(C.REPRODUCED) and a.choices_agree() == (2, 4)
    frame = C.choices_frame([a])
    assert list(frame.columns) == C.CHOICES_COLUMNS and len(frame) == len(a.choice_cells)
    assert frame["agrees"].tolist().count(False) == 2
    md = C.choices_markdown([a])
    assert "the training log's last ‖H_K‖" in md and "median" not in md.split("| Claim")[1]  # all-not-run row left out


def test_f_exits_and_e_metric_choices():
    recs = []
    for seed in (1, 2):
        recs.append(rec(RMS, seed, (5.0, 4.98, 4.99, 5.0), (1, 2, 3, 4)))
        # better than RMSNorm at the final exit, worse at exit 2
        recs.append(rec(RAW, seed, (6.0, 5.2, 4.9, 4.5), (1, 1, 1, 1)))
    res = by_id(C.evaluate_records(recs))
    f = res[("a1", "f")]
    assert f.mean_verdict == C.NOT_REPRODUCED
    cells = {(o, s): v for _, o, s, v in f.choice_cells}
    assert cells[("every exit k = 2..K", 1)] == C.NOT_REPRODUCED and cells[("final exit only", 1)] == C.REPRODUCED
    assert f.choices_agree() == (2, 4)
    e = res[("a1", "e")]
    assert {o for _, o, _, _ in e.choice_cells} == {"exit-PPL range R", "depth gain G"}


# ---------------------------------------------------------------------------
# families, arms, pre-registration
# ---------------------------------------------------------------------------
def test_factorial_family_evaluates_each_arm():
    recs = []
    for arm, drift in (("w128", 1000.0), ("l4", 20.0)):
        for seed in (42, 101):
            recs.append(rec(RMS, seed, (16.0, 16.0, 16.0), (100.0, 300.0, drift), {"freeze_loop1": 0.01}, arm=arm))
            recs.append(rec(RAW, seed, (16.0, 14.0, 13.0), (4.0, 4.5, 5.0), {"freeze_loop1": 0.05}, arm=arm))
    specs = C.specs_of("factorial")
    assert [C.claim_id(s) for s in specs] == list(C.FACTORIAL_IDS)
    res = by_id(C.evaluate_records(recs, specs, preregistered="studies/cpu_factorial/preregistration.md"))
    assert {a for a, _ in res} == {"w128", "l4"} and len(res) == 2 * len(C.FACTORIAL_IDS)
    assert res[("w128", "a")].verdict == "reproduced (2/2 seeds)"  # 1000 vs 5
    assert res[("l4", "a")].verdict == "not reproduced (0/2 seeds)"  # 20 vs 5
    for r in res.values():
        assert r.amendment == "pre-registered (studies/cpu_factorial/preregistration.md)" and not r.registered_rule
    md = C.claims_markdown(list(res.values()))
    assert "| Arm |" in md and "Registered rule" not in md
    with pytest.raises(ValueError, match="unknown claims family"):
        C.specs_of("nope")


def dose_records(norm_by_lam: dict, ppl_by_lam: dict, seeds=(42, 101, 202)):
    out = []
    for lam, norm in norm_by_lam.items():
        cond = condition("rmsnorm", "per_loop", "norm_penalty", penalty_weight=lam) if lam else RMS
        for i, seed in enumerate(seeds):
            r = rec(cond, seed, ppl_by_lam[lam], (1.0, norm / 2, norm * (1 + 0.01 * i)), arm=f"lam{lam:g}")
            r.norm_eval = [1.0, norm / 2, norm * (1 + 0.01 * i)]
            out.append(r)
    return out


LAMS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1)


def test_dose_rules_pass_on_a_monotone_dose_response(tmp_path):
    norms = dict(zip(LAMS, (500.0, 300.0, 100.0, 10.0, 2.0)))
    ppl = dict(zip(LAMS, ((16.0, 16.0, 16.0), (16.0, 15.9, 15.85), (16.0, 15.8, 15.7), (16.0, 15.6, 15.5),
                          (16.0, 15.5, 15.3))))
    results, df = D.evaluate(dose_records(norms, ppl))
    assert [r.id for r in results] == ["D1", "D2", "D3", "D4"]
    assert len(df) == len(LAMS) * 3 and list(df.columns) == D.DOSE_COLUMNS
    assert sorted(set(df["lambda"])) == list(LAMS)
    v = {r.id: r.verdict for r in results}
    assert v["D1"] == v["D2"] == v["D4"] == "reproduced (3/3 seeds)"
    assert v["D3"] == f"reproduced (pooled over {len(df)} runs)"
    assert all(r.kind == C.EVIDENCE for r in results)
    png = D.fig_dose(df, tmp_path / "dose.png")
    assert png.read_bytes().startswith(b"\x89PNG") and png.with_suffix(".pdf").is_file()
    md = D.dose_markdown(results, df)
    assert "| 0.1 | 3 |" in md


def test_dose_rules_fail_on_a_non_monotone_response():
    norms = dict(zip(LAMS, (500.0, 600.0, 100.0, 700.0, 400.0)))  # no trend; λ=0.1 keeps 80% of λ=0's norm
    ppl = {lam: (16.0, 16.0, 16.0) for lam in LAMS}  # no depth gain anywhere, no PPL change
    v = {r.id: r.verdict for r in D.evaluate(dose_records(norms, ppl))[0]}
    assert v["D1"].startswith(C.NOT_REPRODUCED) and v["D2"].startswith(C.NOT_REPRODUCED)
    assert v["D3"].startswith(C.NOT_REPRODUCED) and v["D4"].startswith(C.NOT_REPRODUCED)
    # the norms fall monotonically but not tenfold: D1's second half fails alone
    norms = dict(zip(LAMS, (500.0, 450.0, 400.0, 300.0, 200.0)))
    r = D.rule_d1(D.run_rows(dose_records(norms, ppl)))
    assert r.verdict == C.NOT_REPRODUCED and "ρ = -1.00" in r.ours


def test_dose_rules_need_the_control_arm_and_three_levels():
    norms = {1e-3: 100.0, 1e-2: 10.0, 1e-1: 2.0}  # no λ = 0
    ppl = {lam: (16.0, 15.6, 15.5) for lam in norms}
    v = {r.id: r.verdict for r in D.evaluate(dose_records(norms, ppl))[0]}
    assert v["D1"] == v["D2"] == v["D4"] == C.NOT_RUN
    two = D.evaluate(dose_records({0.0: 500.0, 1e-1: 2.0}, {0.0: (16.0,) * 3, 1e-1: (16.0, 15.5, 15.3)}))[0]
    assert {r.id: r.verdict for r in two}["D1"] == C.NOT_RUN  # a rank correlation over two λ is not evaluated


# ---------------------------------------------------------------------------
# claims rebuilt from the committed CSVs, and the matrix
# ---------------------------------------------------------------------------
def test_claims_from_committed_csvs_equal_those_from_run_directories(tmp_path, monkeypatch):
    from loopscale.cli import main
    from loopscale.report.groups import group_runs
    monkeypatch.chdir(tmp_path)
    grid = make_grid(tmp_path / "runs")
    assert main(["report", "tables", "--runs", str(grid), "--out", str(tmp_path / "res")]) == 0
    from_runs = pd.read_csv(tmp_path / "res" / "claims.csv")
    assert (tmp_path / "res" / "choices.csv").is_file()
    assert main(["report", "claims", "--results", str(tmp_path / "res"), "--out", str(tmp_path / "again")]) == 0
    again = pd.read_csv(tmp_path / "again" / "claims.csv")
    assert list(again.columns) == C.CLAIMS_COLUMNS
    cols = ["id", "kind", "verdict", "ours", "registered_verdict"]
    pd.testing.assert_frame_equal(from_runs[cols], again[cols])
    # and the same as evaluating the run directories directly
    direct = {r.id: r.verdict for r in C.evaluate_groups(group_runs(runs_of(grid)))}
    assert dict(zip(again["id"], again["verdict"])) == direct


def test_records_from_results_errors_name_the_file(tmp_path):
    with pytest.raises(RecordsError, match="per_seed.csv: not found"):
        records_from_results(tmp_path)
    (tmp_path / "per_seed.csv").write_text("size,k\nx,1\n")
    with pytest.raises(RecordsError, match="missing column"):
        records_from_results(tmp_path)


def write_claims(d, rows):
    d.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(d / "claims.csv", index=False)
    return d


def test_claims_matrix_cells(tmp_path):
    e1 = write_claims(tmp_path / "exp1", [
        {"arm": "x", "id": "a", "kind": "evidence", "claim": "drift", "verdict": "reproduced (3/3 seeds)",
         "registered_verdict": ""},
        {"arm": "x", "id": "d", "kind": "sanity", "claim": "radial", "verdict": "reproduced (3/3 seeds)",
         "registered_verdict": ""},
        {"arm": "x", "id": "g", "kind": "evidence", "claim": "clamp", "verdict": "not reproduced (0/3 seeds)",
         "registered_verdict": "reproduced (3/3 seeds)"},
        {"arm": "x", "id": "g-ctrl", "kind": "evidence", "claim": "control", "verdict": "control uninformative",
         "registered_verdict": ""}])
    e2 = write_claims(tmp_path / "exp2", [
        {"arm": arm, "id": "a", "kind": "evidence", "claim": "drift", "verdict": v, "registered_verdict": ""}
        for arm, v in (("w128", "mixed: 1/2 seeds (seed means: reproduced)"), ("l4", "not run at this scale"))])
    m = M.build([e1, e2])
    assert list(m.columns) == ["id", "kind", "claim", "exp1", "exp2: w128", "exp2: l4"]
    assert list(m["id"]) == ["a", "g", "g-ctrl", "d"]  # evidence first, sanity apart, in claim order
    row = m.set_index("id")
    assert row.loc["a", "exp1"] == "✓ 3/3" and row.loc["a", "exp2: w128"] == "mixed 1/2"
    assert row.loc["a", "exp2: l4"] == M.NOT_RUN_CELL and row.loc["d", "exp2: w128"] == M.NOT_RUN_CELL
    assert row.loc["g", "exp1"] == "✗ 0/3 (registered ✓ 3/3)" and row.loc["g-ctrl", "exp1"] == "uninformative"
    written = M.write([e1, e2], tmp_path / "out")
    md = written[1].read_text()
    assert md.index("## Evidence") < md.index("## Sanity checks") and "(g) clamp" in md
    assert pd.read_csv(written[0]).shape == m.shape


def test_claims_matrix_readme_view_and_splice(tmp_path):
    """--readme COLUMNS: the named columns (spaces ignored), the rest summarised in one column,
    evidence and sanity in two tables; --splice puts it between a file's markers and keeps the
    rest of the file; bad input is refused before anything is written."""
    rows = lambda verdicts: [{"arm": "x", "id": i, "kind": k, "claim": i.upper(), "verdict": v,
                              "registered_verdict": r} for i, k, v, r in verdicts]
    e1 = write_claims(tmp_path / "exp1", rows([("a", "evidence", "reproduced (3/3 seeds)", ""),
                                               ("d", "sanity", "reproduced (3/3 seeds)", "")]))
    e2 = write_claims(tmp_path / "exp2", [
        {"arm": arm, "id": "a", "kind": "evidence", "claim": "A", "verdict": v, "registered_verdict": r}
        for arm, v, r in (("w128", "reproduced (2/2 seeds)", "not reproduced (0/2 seeds)"),
                          ("l4", "reproduced (2/2 seeds)", ""),
                          ("w64", "mixed: 1/2 seeds (seed means: reproduced)", ""))])
    readme = tmp_path / "README.md"
    readme.write_text("# top\n<!-- claims-matrix:begin -->\nold table\n<!-- claims-matrix:end -->\ntail\n")
    from loopscale.cli import main
    out = tmp_path / "out"
    assert main(["report", "claims-matrix", "--results", str(e1), str(e2), "--out", str(out),
                 "--readme", "exp1, exp2:w128", "--splice", str(readme)]) == 0
    view = (out / M.README_FILE).read_text()
    assert view.startswith(f"<!-- made by: loopscale report claims-matrix --results {e1} {e2} --out {out} "
                           f"--readme exp1, exp2:w128 -->")
    tables = [[ln for ln in part.splitlines() if ln.startswith("|")] for part in view.split("\n\n")]
    assert tables[0][0] == "| Claim (evidence) | exp1 | exp2: w128 | the 2 other columns |"
    assert tables[0][2] == "| (a) A | ✓ 3/3 | ✓ 2/2 (registered ✗ 0/2) | ✓ in 1, mixed in 1 |"
    assert tables[1][0].startswith("| Sanity check") and tables[1][2] == "| (d) D | ✓ 3/3 | – | – |"
    text = readme.read_text()
    assert text.startswith("# top\n<!-- claims-matrix:begin -->\n") and text.endswith("<!-- claims-matrix:end -->\ntail\n")
    assert view.strip() in text and "old table" not in text
    assert M.summarise(["✓ 2/2 (registered ✗ 0/2)", "✓ 2/2 (registered mixed 1/2)", "–"]) == \
        "✓ in 2 (registered ✗ in 1, mixed in 1)"
    assert M.summarise(["–", "–"]) == "–"
    # refused, nothing written: an unknown column, a file without markers, --splice alone
    with pytest.raises(M.MatrixError, match="no column 'exp3'.*its columns: exp1, exp2:w128"):
        M.write([e1, e2], tmp_path / "bad1", readme="exp1,exp3")
    assert not (tmp_path / "bad1").exists()
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    with pytest.raises(M.MatrixError, match="plain.md: needs one <!-- claims-matrix:begin --> line"):
        M.write([e1, e2], tmp_path / "bad2", readme="exp1", splice_into=plain)
    assert not (tmp_path / "bad2").exists() and plain.read_text() == "no markers\n"
    assert main(["report", "claims-matrix", "--results", str(e1), "--out", str(tmp_path / "bad3"),
                 "--splice", str(readme)]) == 2
    assert not (tmp_path / "bad3").exists()


def test_claims_matrix_reads_an_old_claims_csv_and_rejects_a_missing_one(tmp_path):
    old = write_claims(tmp_path / "old", [{"size": "s", "id": "d", "claim": "radial", "verdict": "reproduced (2/2 seeds)"}])
    m = M.build([old]).set_index("id")
    assert m.loc["d", "kind"] == C.SANITY and m.loc["d", "old"] == "✓ 2/2"
    with pytest.raises(M.MatrixError, match="claims.csv: not found"):
        M.build([old, tmp_path / "absent"])
    from loopscale.cli import main
    assert main(["report", "claims-matrix", "--results", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert main(["report", "claims-matrix", "--results", str(old), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "claims_matrix.md").is_file()


def test_params_declare_the_studies_claims_and_the_schema_checks_them():
    import copy
    from pathlib import Path
    from loopscale import pipeline as P
    repo = Path(__file__).resolve().parents[1]
    schema = P.load_schema(repo / "workflow" / "schemas" / "params.schema.yaml")
    params = P.load_params(repo / "params.yaml")
    P.check_schema(params, schema, "params.yaml")
    for name, exp in params["experiments"].items():
        c = exp.get("claims")
        if c and c.get("preregistered"):  # a declared pre-registration exists
            assert (repo / c["preregistered"]).is_file(), name
    assert params["experiments"]["cpu_dose"]["claims"]["family"] == "dose"
    for bad, msg in (({"family": "doses"}, "unknown value 'doses'"), ({"family": "dose", "preregistered": "x.md"},
                                                                      "does not match")):
        p = copy.deepcopy(params)
        p["experiments"]["cpu_dose"]["claims"] = bad
        with pytest.raises(P.ParamsError, match=msg):
            P.check_schema(p, schema, "params.yaml")
