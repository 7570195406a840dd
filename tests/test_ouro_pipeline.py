"""The Ouro track in the pipeline: `paper-ouro` plans multi-GPU training jobs under the SLURM
profile (dry run), and `ouro-smoke` trains, evaluates and reports tiny Ouro runs on a CPU."""
import csv
import json

import pytest

from test_pipeline import copy_worktree, smk
from test_profiles import jobs_of


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_worktree(tmp_path_factory.mktemp("ouro-pipeline") / "repo")


def test_paper_ouro_trains_data_parallel_under_slurm(repo):
    out = smk(repo, "--workflow-profile", "slurm", "--config", "experiment=paper-ouro", "-n").stdout
    train = [j for j in jobs_of(out) if j["rule"] == "train"]
    conds = sorted(j["wildcards"]["cond"] for j in train)
    assert conds == sorted(f"{r}-terminal-none-inter_loop_norm"
                           for r in ("rmsnorm", "final_raw", "final_alpha", "per_loop_alpha"))
    assert all(j["resources"]["gpu"] == 4 for j in train)
    assert out.count("torchrun --standalone --nproc-per-node 4 -m loopscale.cli train") == 4
    from loopscale import pipeline as P
    runs = P.build_experiment(P.load_params(repo / "params.yaml"), "paper-ouro").runs
    assert {r.config.model.arch for r in runs} == {"ouro"} and {r.config.model.d_ff for r in runs} == {5632}


@pytest.mark.slow
def test_ouro_smoke_end_to_end(repo):
    smk(repo, "--cores", "2", "--config", "experiment=ouro-smoke")
    with open(repo / "results/ouro-smoke/main.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    base = repo / "runs/ouro-smoke/ouro-smoke"
    for r in ("rmsnorm", "final_raw", "final_alpha"):
        run = base / f"{r}-terminal-none-inter_loop_norm/seed42"
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"
        radial = json.loads((run / "eval/radial.json").read_text())
        assert radial["status"] == "ok"
        assert radial["loops"][-1]["readout"] == {"rmsnorm": "rmsnorm", "final_raw": "raw", "final_alpha": "alpha"}[r]
    assert (repo / "results/ouro-smoke/REPORT.md").is_file()
