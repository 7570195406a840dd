"""The smoke grid through SLURM: the slurm-local profile on the one-node test cluster
(fixture `slurm_cluster`, tests/slurm_cluster.py) gives the same tables as a local run
(training and evaluation are deterministic on CPU; timing columns are left out).

Works in a copy of the working tree under tmp_path, like tests/test_pipeline.py, and reuses
the session-wide local smoke run (conftest.py's `smoke_local`).
"""
from __future__ import annotations

import json
import time

import pytest

from slurm_cluster import slurm_cluster  # noqa: F401  (registers the fixture)
from workflow_support import SMOKE, assert_same_tables, copy_worktree, dry_run, pipeline_env, smoke_runs


@pytest.mark.slow
def test_smoke_grid_on_slurm_equals_local_run(slurm_cluster, smoke_local, tmp_path, record_property):  # noqa: F811
    repo = copy_worktree(tmp_path / "repo")
    env = {**slurm_cluster.env, **{k: v for k, v in pipeline_env(repo).items()
                                   if k in ("PYTHONPATH", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE",
                                            "PYTHONDONTWRITEBYTECODE")}}
    t0 = time.monotonic()
    slurm_cluster.snakemake(*SMOKE, cwd=repo, env=env, timeout=900)
    wall = time.monotonic() - t0
    record_property("smoke_slurm_wall_s", round(wall, 1))
    print(f"\nsmoke grid on the SLURM test cluster: {wall:.0f} s")

    runs = smoke_runs(repo)
    assert len(runs) == len(smoke_runs(smoke_local[0])) == 2
    for r in runs:
        assert json.loads((r / "summary.json").read_text())["status"] == "completed"
    assert list((repo / ".snakemake" / "slurm_logs").rglob("*.log")), "jobs did not go through SLURM"
    assert_same_tables(repo / "results" / "smoke", smoke_local[0] / "results" / "smoke")
    assert (repo / "results" / "smoke" / "REPORT.md").is_file()
    assert dry_run(repo) == []
