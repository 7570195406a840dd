"""The Snakemake profiles (profiles/ next to the Snakefile) are found with the documented
commands and ask SLURM for what each job really uses.

Dry runs in a copy of the working tree, as a user types them (docs/pipeline.md "On a SLURM
cluster, step by step"): `snakemake --workflow-profile slurm --config experiment=NAME -n`. The partition
each job would be sent to is worked out with the SLURM plugin's own partition selection
from profiles/slurm/partitions.yaml and the job's resources as Snakemake resolved them.
"""
from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from workflow_support import REPO, copy_worktree, smk
from workflow_support import jobs_of

PROFILES = REPO / "profiles"
# rules that never use a GPU and run single-threaded; the others train or evaluate a model
CPU_RULES = {"settings", "prepare_data", "aggregate", "figures", "report"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_worktree(tmp_path_factory.mktemp("profiles") / "repo")




def partition_of(job: dict) -> str:
    """The partition the SLURM plugin picks for this job from profiles/slurm/partitions.yaml."""
    from snakemake_executor_plugin_slurm.partitions import get_best_partition, read_partition_file
    partitions = read_partition_file(PROFILES / "slurm" / "partitions.yaml")
    stub = SimpleNamespace(name=job["rule"], resources=job["resources"], threads=job["resources"]["cpus_per_task"])
    return get_best_partition(partitions, stub, logging.getLogger("test"))


# the profiles are quiet (no rule blocks); this shows each job's block again, without its reason
LISTED = ("--quiet", "reason")


@functools.lru_cache(maxsize=None)
def slurm_dry_run(repo: Path, experiment: str) -> tuple[list[dict], str]:
    """The documented dry run, every job listed (memoised: each experiment is dry-run once per session)."""
    proc = smk(repo, "--workflow-profile", "slurm", "--config", f"experiment={experiment}", "-n", *LISTED)
    return jobs_of(proc.stdout), proc.stderr


def experiment(name: str) -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())["experiments"][name]


def test_slurm_profile_is_found_and_selects_the_slurm_executor(repo, monkeypatch):
    from snakemake.cli import parse_args
    monkeypatch.chdir(repo)
    _, args = parse_args(["--workflow-profile", "slurm", "--config", "experiment=paper", "-n"])
    assert args.executor == "slurm"
    assert args.retries >= 2  # a time limit or preemption is retried: training resumes
    assert args.cores == 1024  # no cap of the login node's cores on the jobs' threads
    _, stderr = slurm_dry_run(repo, "smoke")
    # ./slurm (the profile's name at the root, for `--profile slurm`) is profiles/slurm
    used = re.search(r"Using workflow specific profile (\S+) for setting default", stderr).group(1)
    assert (repo / used).resolve() == repo / "profiles" / "slurm"
    assert "profiles/default" not in stderr


def test_the_slurm_profile_is_found_by_its_name(repo, monkeypatch):
    """`snakemake --profile slurm`, as Snakemake users type it (Snakemake looks for a profile
    name in the working directory, then ~/.config/snakemake), loads the same profile as
    `--workflow-profile slurm`, its partition file included."""
    from snakemake.cli import parse_args
    monkeypatch.chdir(repo)
    _, by_name = parse_args(["--profile", "slurm", "--config", "experiment=paper", "-n"])
    _, by_workflow = parse_args(["--workflow-profile", "slurm", "--config", "experiment=paper", "-n"])
    def plain(v):  # Snakemake's Resources as {name: the value as written}
        return {k: plain(x) for k, x in v.items()} if hasattr(v, "items") else getattr(v, "raw", v)
    for key in ("executor", "retries", "cores", "jobs", "default_resources", "set_resources", "latency_wait"):
        assert plain(getattr(by_name, key)) == plain(getattr(by_workflow, key)), key
    assert plain(by_name.default_resources)["slurm_account"]
    assert by_name.executor == "slurm"
    assert Path(by_name.slurm_partition_config).resolve() == (repo / "profiles" / "slurm" / "partitions.yaml")
    proc = smk(repo, "--profile", "slurm", "--config", "experiment=smoke", "-n", *LISTED)
    assert "Using profile slurm for setting default" in proc.stderr
    assert jobs_of(proc.stdout) == slurm_dry_run(repo, "smoke")[0]


def test_the_dry_run_warns_of_the_placeholder_account(repo, tmp_path):
    """The profile as shipped names the account `my_account`: the dry run says so in one
    line (sbatch would refuse every job); with an account of the user's, it says nothing."""
    from loopscale.pipeline import PLACEHOLDER_ACCOUNT, placeholder_account
    config = yaml.safe_load((PROFILES / "slurm" / "config.yaml").read_text())
    assert config["default-resources"]["slurm_account"] == PLACEHOLDER_ACCOUNT
    _, stderr = slurm_dry_run(repo, "smoke")
    warnings = [line for line in stderr.splitlines() if "placeholder" in line]
    assert len(warnings) == 1 and f"slurm_account is still the placeholder '{PLACEHOLDER_ACCOUNT}'" in warnings[0]
    assert warnings[0].startswith("loopscale pipeline: warning:")
    mine = smk(repo, "--workflow-profile", "slurm", "--config", "experiment=smoke", "-n", *LISTED,
               "--default-resources", "slurm_account='lab42'")
    assert "placeholder" not in mine.stderr and jobs_of(mine.stdout)
    assert placeholder_account({"slurm_account": "lab42"}) is None and placeholder_account(None) is None
    assert placeholder_account({"slurm_account": f"'{PLACEHOLDER_ACCOUNT}'"})


def test_local_runs_load_no_profile(repo, monkeypatch):
    """There is no profiles/default: a plain `snakemake` takes only its command line (and a
    bad params.yaml still gives exactly one line on stderr, tests/test_pipeline.py)."""
    from snakemake.cli import parse_args
    assert not (repo / "profiles" / "default").exists()
    monkeypatch.chdir(repo)
    _, args = parse_args(["--cores", "2", "-n"])
    assert args.executor in (None, "local") and not args.rerun_incomplete and not args.retries
    proc = smk(repo, "--cores", "2", "-n", "--config", "experiment=smoke")
    assert "profile" not in proc.stderr


def test_paper_jobs_ask_for_gpus_threads_memory_and_time(repo):
    jobs, _ = slurm_dry_run(repo, "paper")
    threads = experiment("paper")["train"]["threads"]
    gpus = experiment("paper")["gpu"]
    by_rule = {}
    for j in jobs:
        by_rule.setdefault(j["rule"], []).append(j)
    assert set(by_rule) == CPU_RULES | {"train", "eval"}
    for rule, js in by_rule.items():
        for j in js:
            r = j["resources"]
            assert r["runtime"] > 0 and r["mem_mb"] > 0 and r["slurm_account"]
            if rule in CPU_RULES:
                assert "gpu" not in r and r["cpus_per_task"] == 1 and partition_of(j) == "cpu"
            else:
                assert r["gpu"] == gpus and r["cpus_per_task"] == threads and partition_of(j) == "gpu"
    assert {j["resources"]["runtime"] for j in by_rule["train"]} == {720}
    assert {j["resources"]["mem_mb"] for j in by_rule["train"]} == {64000}


def test_paper_grid_needs_at_most_two_gpu_allocations_per_run(repo):
    jobs, _ = slurm_dry_run(repo, "paper")
    # every run: one training allocation + at most one evaluation allocation
    per_run: dict[tuple, int] = {}
    for j in jobs:
        if j["resources"].get("gpu"):
            w = j["wildcards"]
            key = (w["size"], w["cond"], w["seed"])
            per_run[key] = per_run.get(key, 0) + 1
    assert len(per_run) == 54 and max(per_run.values()) <= 2, sorted(set(per_run.values()))


@pytest.mark.parametrize("name", ["smoke", "cpu"])
def test_cpu_experiments_ask_for_no_gpu(repo, name):
    jobs, _ = slurm_dry_run(repo, name)
    threads = experiment(name)["train"]["threads"]
    assert any(j["rule"] == "train" for j in jobs)
    for j in jobs:
        r = j["resources"]
        assert not r.get("gpu") and "gres" not in r, j  # gpu=0: the plugin passes no --gpus
        assert partition_of(j) == "cpu"
        assert r["cpus_per_task"] == (1 if j["rule"] in CPU_RULES else threads), j


def test_make_runs_snakemake_quietly(repo):
    """`make smoke` and `make reproduce` call Snakemake with SNAKEMAKE_QUIET: no job prints its
    rule block (the ~40 source files of its inputs, its outputs, the reason) and a job is the
    scheduler's line; the same dry run without the flags lists every job's inputs."""
    import shlex
    import subprocess
    makefile = (REPO / "Makefile").read_text()
    quiet = shlex.split(re.search(r"^SNAKEMAKE_QUIET \?= (.*)$", makefile, re.M).group(1))
    assert quiet[0] == "--quiet" and "rules" in quiet
    for target in ("smoke", "reproduce"):  # both go through $(SNAKEMAKE)
        shown = subprocess.run(["make", "-n", "-W", "Makefile", target], cwd=repo, capture_output=True, text=True)
        calls = [line for line in shown.stdout.splitlines() if "snakemake" in line and "--config" in line]
        assert calls and all(" ".join(quiet) in line for line in calls), shown.stdout
    loud = smk(repo, "--config", "experiment=smoke", "-n")
    assert re.search(r"^\s+input: .*src/loopscale/", loud.stdout, re.M)
    quiet_run = smk(repo, *quiet, "--config", "experiment=smoke", "-n")
    text = quiet_run.stdout + quiet_run.stderr
    assert not re.search(r"^\s+(input|output|reason):", text, re.M) and not re.search(r"^(local)?rule \w+:", text, re.M)
    assert "Job stats:" in text and len(text.splitlines()) < len((loud.stdout + loud.stderr).splitlines()) / 3


@pytest.mark.parametrize("profile", [("--workflow-profile", "slurm"), ("--profile", "slurm"),
                                     ("--profile", str(PROFILES / "slurm-local"), "--workflow-profile", "none")],
                         ids=["workflow-profile slurm", "profile slurm", "slurm-local"])
def test_profiles_are_quiet(repo, profile):
    """Every profile runs Snakemake quietly (`quiet: [rules, host]`): a dry run of the smoke
    experiment prints at most a few lines per job (the job count read from the dry run itself),
    no rule block and no input list; `--quiet reason` on the command line lists the jobs again."""
    for d in PROFILES.iterdir():
        if d.is_dir():
            assert yaml.safe_load((d / "config.yaml").read_text())["quiet"] == ["rules", "host"], d.name
    proc = smk(repo, *profile, "--config", "experiment=smoke", "-n")
    lines = (proc.stdout + proc.stderr).splitlines()
    jobs = int(re.search(r"^total\s+(\d+)$", proc.stdout, re.M).group(1))
    assert jobs == len(jobs_of(smk(repo, *profile, "--config", "experiment=smoke", "-n", *LISTED).stdout)) + 1  # + all
    assert len(lines) <= 3 * jobs, "\n".join(lines)
    assert not [line for line in lines if re.match(r"\s+(input|output|reason|resources):|(local)?rule \w+:", line)]
