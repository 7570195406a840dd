"""The recorded GPU check (benchmarks/<dir>/gpu_check.json): its RESULTS.md is what its JSON
gives, its pre-registration precedes its results in git, and its rules can come out either way."""
import copy
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from git_support import first_commit, history_available, is_ancestor

REPO = Path(__file__).resolve().parents[1]
RECORDED = sorted(p.parent for p in (REPO / "benchmarks").glob("*/gpu_check.json"))


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", REPO / "benchmarks" / "gpu_check_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _module()


def prereg(d: Path) -> dict:
    return yaml.safe_load((d / "preregistration.yaml").read_text())


def test_there_is_a_recorded_gpu_check():
    assert RECORDED, "no benchmarks/*/gpu_check.json"


@pytest.mark.parametrize("d", RECORDED, ids=lambda d: d.name)
def test_results_page_is_what_the_json_gives(d):
    assert (d / "RESULTS.md").read_text() == report.render(d.relative_to(REPO), prereg(d)), (
        f"regenerate: python benchmarks/gpu_check_report.py {d.relative_to(REPO)}")


@pytest.mark.skipif(not history_available(), reason="needs the full git history (not a shallow clone)")
@pytest.mark.parametrize("d", RECORDED, ids=lambda d: d.name)
def test_preregistration_precedes_the_results(d):
    reg, res = first_commit(d / "preregistration.yaml"), first_commit(d / "drift.json")
    assert reg and res, "pre-registration or results not committed"
    assert reg != res, "pre-registration and results landed in one commit"
    assert is_ancestor(reg, res)


@pytest.mark.parametrize("d", RECORDED, ids=lambda d: d.name)
def test_every_qualitative_rule_is_evaluated_and_can_fail(d):
    drift = json.loads((d / "drift.json").read_text())
    registered = [q["id"] for q in prereg(d)["qualitative"]]
    assert [q["id"] for q in report.qualitative(drift, registered)] == registered
    # the drifting model's scale made as small as the raw one's: a-gpu fails; the raw one's
    # radial fraction made invisible: d-gpu fails; its norm made large: b-gpu fails
    bad = copy.deepcopy(drift)
    r = bad["readouts"]
    r["rmsnorm"]["final_validation"]["norm"][-1] = r["raw"]["final_validation"]["norm"][-1]
    for x in r["raw"]["radial"]:
        x["radial_fraction"] = 0.0
    r["raw"]["final_validation"]["norm"][-1] = 100.0 * r["raw"]["config"]["d_model"]
    assert not any(q["holds"] for q in report.qualitative(bad, ["a-gpu", "b-gpu", "d-gpu"]))
    # the raw model no better than the drifting one at any exit, nor gaining from depth: e2, f fail
    r["raw"]["final_validation"]["ppl"] = list(r["rmsnorm"]["final_validation"]["ppl"])
    assert not any(q["holds"] for q in report.qualitative(bad, ["e2-gpu", "f-gpu"]))


def test_an_unknown_preregistered_rule_is_an_error():
    with pytest.raises(ValueError, match="not one of"):
        report.qualitative({"readouts": {}}, ["z-gpu"])


@pytest.mark.parametrize("d", RECORDED, ids=lambda d: d.name)
def test_drift_band_rows_read_the_log_and_mark_the_largest_step_reached(d):
    reg, drift = prereg(d), json.loads((d / "drift.json").read_text())
    rows = report.drift_band_rows(reg, drift)
    reached = drift["readouts"]["rmsnorm"]["steps"]
    expected = [p["step"] for p in reg["drift_predictions"] if p["step"] <= reached]
    assert [r["step"] for r in rows] == sorted(expected)
    assert [r.get("headline", False) for r in rows] == [False] * (len(rows) - 1) + [True]
    rms = drift["readouts"]["rmsnorm"]
    log = {row["step"]: row["norm"][-1] for row in rms["log"] + [rms.get("final_train", {"step": -1, "norm": [0]})]}
    for r in rows:
        assert r["measured"] == log[r["step"]]
        assert r["inside"] == (r["lo"] <= r["measured"] <= r["hi"])
    # a run whose norm stayed small lands below every band
    small = copy.deepcopy(drift)
    for row in small["readouts"]["rmsnorm"]["log"] + [small["readouts"]["rmsnorm"].get("final_train", {"norm": [0]})]:
        row["norm"][-1] = 1.0
    assert rows and not any(r["inside"] for r in report.drift_band_rows(reg, small))


def test_report_refuses_a_folder_without_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path)])
    assert "gpu_check.json not found" in str(e.value)


@pytest.mark.parametrize("bad", ["a: [unclosed", "- just\n- a list\n", "qualitative: [{id: z-gpu}]\n"])
def test_a_bad_preregistration_is_a_one_line_error_and_writes_nothing(tmp_path, bad):
    d = RECORDED[0]
    for f in d.glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "preregistration.yaml").write_text(bad)
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path)])
    assert str(e.value).startswith("gpu_check_report: cannot read") and "\n" not in str(e.value)
    assert not (tmp_path / "RESULTS.md").exists()
