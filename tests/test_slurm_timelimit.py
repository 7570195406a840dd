"""A training job killed by its SLURM time limit resumes from its checkpoint on retry.

On the one-node test cluster (fixture `slurm_cluster`), through the slurm-local profile
(`retries: 2`, like profiles/slurm): one smoke run is submitted; once it has written a
checkpoint the test freezes the training process (SIGSTOP, standing in for a run longer
than its allocation) and moves the job's end time to now (`scontrol update EndTime=now`),
so SLURM kills it for its time limit at its next check (SIGCONT + SIGTERM, then SIGKILL).
Snakemake sees the job fail, resubmits it, and the second job resumes from state.pt and
completes the run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurm_cluster import SNAKEMAKE, slurm_cluster  # noqa: F401  (registers the fixture)
from workflow_support import SMOKE, copy_worktree, edit_params, pipeline_env, smk

pytestmark = pytest.mark.slow

RUN = Path("runs/smoke/smoke/raw-per_loop-none-residual/seed42")
STEPS = 100


def training_process(repo: Path, run: Path) -> int | None:
    """pid of the `loopscale train` process of this run of the pipeline in `repo`, if one is
    running. The run directory on the command line is relative, so the process's working
    directory must be `repo` too: under pytest-xdist another test may be training the same
    run of its own copy of the repository (freezing that one hung it)."""
    repo = str(repo.resolve())
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
                cwd = os.readlink(d / "cwd")
            except OSError:
                continue
            if (b"train" in argv and str(run).encode() in argv and any(a.endswith(b"loopscale") for a in argv)
                    and cwd == repo):
                return int(d.name)
    return None


def slurm_job_of(pid: int) -> str:
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return env[b"SLURM_JOB_ID"].decode()


def test_job_killed_by_time_limit_resumes_on_retry(slurm_cluster, tmp_path, record_property):  # noqa: F811
    t0 = time.monotonic()
    repo = copy_worktree(tmp_path / "repo")

    def one_long_run(p):
        smoke = p["experiments"]["smoke"]
        smoke["conditions"] = [{"readout": "raw", "loss": "per_loop"}]
        smoke["train"] = {"max_steps": STEPS, "ckpt_every": 5, "log_every": 20, "threads": 1}
    edit_params(repo, one_long_run)
    smk(repo, "--cores", "1", *SMOKE, "--until", "prepare_data")  # locally: only training goes to SLURM

    env = {**slurm_cluster.env, **{k: v for k, v in pipeline_env(repo).items()
                                   if k in ("PYTHONPATH", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}}
    cmd = [str(SNAKEMAKE), str(RUN / "summary.json"), "--profile", str(slurm_cluster.profile),
           "--workflow-profile", "none", *SMOKE, "--set-resources", "train:runtime=10"]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    run = repo / RUN
    try:
        deadline = time.monotonic() + 180
        pid = None
        while time.monotonic() < deadline and proc.poll() is None:
            pid = training_process(repo, RUN)
            if pid and (run / "state.pt").exists():
                break
            time.sleep(0.05)
        if not pid or proc.poll() is not None:
            pytest.fail(f"training never started or checkpointed:\n{proc.communicate()[0][-6000:]}", pytrace=False)
        os.kill(pid, signal.SIGSTOP)
        job = slurm_job_of(pid)
        slurm_cluster.sh("scontrol", "update", f"JobId={job}", "EndTime=now")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-6000:]

    # the first job was killed for its time limit, and Snakemake retried it ...
    state = slurm_cluster.sh("squeue", "-h", "-j", job, "-t", "all", "-o", "%T").strip()
    assert state == "TIMEOUT", state
    first_log = next((repo / ".snakemake" / "slurm_logs").rglob(f"{job}.log")).read_text()
    assert "DUE TO TIME LIMIT" in first_log
    assert out.count("submitted with SLURM jobid") == 2, out[-6000:]
    # ... and the second job resumed from the checkpoint and finished the run
    log = (repo / "logs" / "smoke" / RUN.relative_to("runs/smoke") / "train.log").read_text()
    resumed = [line for line in log.splitlines() if "resuming from" in line]
    assert len(resumed) == 1 and int(resumed[0].split(" at step ")[1].split("/")[0]) >= 5, log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert not (run / "state.pt").exists()
    steps = [json.loads(l).get("step") for l in (run / "metrics.jsonl").read_text().splitlines()]
    record_property("timelimit_retry_wall_s", round(time.monotonic() - t0, 1))
    print(f"\nkilled at its time limit, resumed at {resumed[0].split(' at step ')[1]}: "
          f"{time.monotonic() - t0:.0f} s")
    train_steps = steps[:-1]  # the last record is the final validation
    assert train_steps == list(range(20, STEPS + 1, 20)), steps
