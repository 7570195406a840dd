"""tools/study_sitting.py: which runs of a study are finished, what is kept in git (results, never
checkpoints), restoring them into a fresh worktree, and the plan recorded for when the study's own
Snakemake holds the experiment."""
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sitting(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("study_sitting", REPO / "tools" / "study_sitting.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "REPO", tmp_path / "repo")  # studies/<study>/runs lands here
    return mod


def make_run(wt: Path, run: str, status="completed", evals=("depth",), extra=("state.pt", "model.pt")):
    d = wt / run
    (d / "eval").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"status": status}))
    (d / "loopscale.json").write_text("{}")
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    for e in evals:
        (d / "eval" / f"{e}.json").write_text("{}")
    for x in extra:
        (d / x).write_bytes(b"\0" * 8)
    return [f"{run}/eval/{e}.json" for e in evals]


SUMMARY = ("output_file\tdate\trule\tlog-file(s)\tstatus\tplan\n"
           "runs/s/d64/a/seed42/eval/depth.json\t-\teval\t\tmissing\tupdate pending\n"
           "runs/s/d64/a/seed42/summary.json\t-\ttrain\t\tmissing\tupdate pending\n"
           "runs/s/d64/a/seed101/eval/depth.json\t-\teval\t\tmissing\tupdate pending\n"
           "runs/s/d64/a/seed101/eval/halting.json\t-\teval\t\tmissing\tupdate pending\n"
           "runs/s/d64/b/seed42/summary.json\t-\ttrain\t\tmissing\tupdate pending\n"
           "results/s/claims.csv\t-\treport\t\tmissing\tupdate pending\n")


def test_the_plan_is_read_from_snakemakes_summary(sitting):
    runs = sitting.parse_summary("s", SUMMARY)
    assert runs == {"runs/s/d64/a/seed42": ["runs/s/d64/a/seed42/eval/depth.json"],
                    "runs/s/d64/a/seed101": ["runs/s/d64/a/seed101/eval/depth.json",
                                             "runs/s/d64/a/seed101/eval/halting.json"],
                    "runs/s/d64/b/seed42": []}
    assert sorted(runs, key=sitting.seed_order)[0].endswith("seed42")  # whole seeds first
    with pytest.raises(SystemExit, match="plans no run under runs/other/"):
        sitting.parse_summary("other", SUMMARY)


def test_finished_needs_a_completed_summary_and_every_evaluation(sitting, tmp_path):
    wt = tmp_path / "wt"
    done = make_run(wt, "runs/s/a/seed42")
    assert sitting.finished(wt / "runs/s/a/seed42", done, wt)
    assert not sitting.finished(wt / "runs/s/a/seed42", done + ["runs/s/a/seed42/eval/halting.json"], wt)
    running = make_run(wt, "runs/s/a/seed101", status="running")
    assert not sitting.finished(wt / "runs/s/a/seed101", running, wt)
    torn = make_run(wt, "runs/s/a/seed202")
    (wt / torn[0]).write_text('{"half')  # an evaluation cut off mid-write is not a result
    assert not sitting.finished(wt / "runs/s/a/seed202", torn, wt)


def test_save_keeps_results_not_checkpoints_and_restore_brings_them_back(sitting, tmp_path):
    wt = tmp_path / "wt"
    plan = {"runs/s/a/seed42": make_run(wt, "runs/s/a/seed42"),
            "runs/s/a/seed101": make_run(wt, "runs/s/a/seed101", status="running")}
    assert sitting.save("s", wt, plan) == ["runs/s/a/seed42"]
    kept = sitting.kept_dir("s")
    files = sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file())
    assert files == ["a/seed42/eval/depth.json", "a/seed42/loopscale.json", "a/seed42/metrics.jsonl",
                     "a/seed42/summary.json"]
    assert sitting.todo("s", wt, plan) == ["runs/s/a/seed101"]

    fresh = tmp_path / "fresh"  # the next machine's worktree: the kept run counts as finished there
    assert sitting.restore("s", fresh) == len(files)
    assert sitting.todo("s", fresh, plan) == ["runs/s/a/seed101"]
    (fresh / "runs/s/a/seed42/metrics.jsonl").write_text("local\n")
    assert sitting.restore("s", fresh) == 0  # a file already there is never overwritten
    assert (fresh / "runs/s/a/seed42/metrics.jsonl").read_text() == "local\n"


def test_a_running_study_uses_the_recorded_plan(sitting, tmp_path, monkeypatch):
    wt = tmp_path / "wt"

    def fake(stdout="", stderr="", rc=0):
        return lambda *a, **k: subprocess.CompletedProcess(a, rc, stdout=stdout, stderr=stderr)

    locked = "loopscale pipeline: error: another snakemake (pid 7) is running experiment s in this directory"
    monkeypatch.setattr(sitting.subprocess, "run", fake(stderr=locked, rc=1))
    with pytest.raises(SystemExit, match="another snakemake"):  # no plan recorded yet: says why
        sitting.planned_runs("s", wt)
    monkeypatch.setattr(sitting.subprocess, "run", fake(stdout=SUMMARY))
    plan = sitting.planned_runs("s", wt)
    monkeypatch.setattr(sitting.subprocess, "run", fake(stderr=locked, rc=1))
    assert sitting.planned_runs("s", wt) == plan
    monkeypatch.setattr(sitting.subprocess, "run", fake(stderr="SyntaxError in Snakefile", rc=1))
    with pytest.raises(SystemExit, match="SyntaxError"):  # any other failure is not hidden by the record
        sitting.planned_runs("s", wt)


def test_refuses_an_unregistered_study_and_a_folder_that_is_no_worktree(sitting, tmp_path):
    wt = tmp_path / "wt"
    with pytest.raises(SystemExit, match="no Snakefile"):
        sitting.main(["todo", "s", "--worktree", str(wt)])
    wt.mkdir()
    (wt / "Snakefile").write_text("")
    with pytest.raises(SystemExit, match=r"studies/s/preregistration.md missing"):
        sitting.main(["todo", "s", "--worktree", str(wt)])
