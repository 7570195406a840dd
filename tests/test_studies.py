"""The pre-registered studies (studies/<name>/): each pre-registration is well formed, names an
experiment of params.yaml and the code commit that defines it, and precedes its results in git."""
from pathlib import Path

import pytest
import yaml
from git_support import first_commit, git, history_available, is_ancestor

REPO = Path(__file__).resolve().parents[1]
STUDIES = sorted(p.parent for p in (REPO / "studies").glob("*/preregistration.yaml"))
VERDICTS = {"reproduced", "not reproduced", "mixed"}


def test_there_are_studies():
    assert STUDIES, "no studies/*/preregistration.yaml"


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_preregistration_is_well_formed(study):
    reg = yaml.safe_load((study / "preregistration.yaml").read_text())
    assert reg["study"] == study.name
    assert (study / "preregistration.md").is_file()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert reg["experiment"] in params["experiments"], f"{reg['experiment']} is not an experiment of params.yaml"
    exp_seeds = params["experiments"][reg["experiment"]]["seeds"]
    assert sorted(reg["seeds"]) == sorted(exp_seeds)
    ids = [r["id"] for r in reg["rules"]]
    assert len(ids) == len(set(ids)) and ids
    for r in reg["rules"]:
        assert r["kind"] in ("evidence", "sanity"), r
    preds = reg.get("predictions") or {r["id"]: r["prediction"] for r in reg["rules"] if "prediction" in r}
    flat = [v for p in preds.values() for v in (p.values() if isinstance(p, dict) else [p])]
    assert flat and all(v in VERDICTS for v in flat), flat
    sizes = set(params["experiments"][reg["experiment"]]["sizes"])
    for p in reg.get("drift_predictions", []):
        assert p["experiment"] == reg["experiment"] and p["size"] in sizes
        assert 0 < p["lo"] <= p["point"] <= p["hi"], p


@pytest.mark.skipif(not history_available(), reason="needs the full git history (not a shallow clone)")
@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_preregistration_precedes_results(study):
    reg = yaml.safe_load((study / "preregistration.yaml").read_text())
    code = git("rev-parse", "--verify", f"{reg['code_commit']}^{{commit}}")
    prereg = first_commit(study / "preregistration.yaml")
    assert prereg, "the pre-registration is not committed"
    assert is_ancestor(code, prereg), "the code commit it names does not precede the pre-registration"
    results = REPO / "results" / reg["experiment"]
    if results.exists():
        first = first_commit(results)
        assert first, f"results/{reg['experiment']} exists but is not committed"
        assert first != prereg and is_ancestor(prereg, first), \
            f"results/{reg['experiment']} were committed before (or with) the pre-registration"
