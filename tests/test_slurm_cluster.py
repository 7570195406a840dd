"""The one-node SLURM test cluster works, and Snakemake runs jobs through the
SLURM executor plugin on it with the slurm-local profile (tests/slurm_cluster.py
explains how to reuse the fixture and the profile)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

try:
    from slurm_cluster import run_snakemake, slurm_cluster  # noqa: F401  (fixture)
except ImportError:  # tests/ turned into a package
    from tests.slurm_cluster import run_snakemake, slurm_cluster  # noqa: F401

pytestmark = pytest.mark.slow

SAMPLES = ("a", "b", "c")

# seed -> square x3 (fan-out) -> gather (2 threads, 2 GB) -> all.
# Each job also writes "<SLURM_JOB_ID> <SLURM_CPUS_PER_TASK>" ("none none"
# outside SLURM) to its log, which the test inspects but does not compare.
TOY_SNAKEFILE = r"""
SAMPLES = ["a", "b", "c"]
JOBENV = "echo ${{SLURM_JOB_ID:-none}} ${{SLURM_CPUS_PER_TASK:-none}} > {log}"

rule all:
    input: "results/summary.txt"

rule seed:
    output: "data/seed.txt"
    log: "jobenv/seed.txt"
    shell: "python -c 'print(7)' > {output}; " + JOBENV

rule square:
    input: "data/seed.txt"
    output: "data/sq_{s}.txt"
    log: "jobenv/square_{s}.txt"
    shell:
        "python -c 'import sys; n = int(open(sys.argv[1]).read()); "
        "print(n * n + ord(sys.argv[2]))' {input} {wildcards.s} > {output}; " + JOBENV

rule gather:
    input: expand("data/sq_{s}.txt", s=SAMPLES)
    output: "results/summary.txt"
    log: "jobenv/gather.txt"
    threads: 2
    resources: mem_mb=2048
    shell:
        "python -c 'import sys; print(sum(int(open(f).read()) for f in sys.argv[1:]))' "
        "{input} > {output}; " + JOBENV
"""

EXPECTED_SUMMARY = sum(49 + ord(s) for s in SAMPLES)


def _outputs(workdir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(workdir)): p.read_bytes()
        for sub in ("data", "results")
        for p in sorted((workdir / sub).rglob("*"))
        if p.is_file()
    }


def _jobenv(workdir: Path) -> dict[str, list[str]]:
    return {p.stem: p.read_text().split() for p in sorted((workdir / "jobenv").glob("*.txt"))}


def _meminfo_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_node_advertises_machine_resources(slurm_cluster):  # noqa: F811
    node = slurm_cluster.sh("scontrol", "show", "node", "localhost")
    fields = dict(re.findall(r"(\w+)=(\S+)", node))
    assert int(fields["CPUTot"]) == os.cpu_count()
    assert abs(int(fields["RealMemory"]) - _meminfo_mb()) <= 0.05 * _meminfo_mb()
    assert fields["Partitions"] == slurm_cluster.partition
    state = slurm_cluster.sh("sinfo", "-h", "-N", "-n", "localhost", "-o", "%t").strip()
    assert state in {"idle", "mix", "alloc"}, state


def test_toy_dag_through_slurm_matches_local(slurm_cluster, tmp_path):  # noqa: F811
    slurm_dir, local_dir = tmp_path / "slurm", tmp_path / "local"
    for d in (slurm_dir, local_dir):
        d.mkdir()
        (d / "Snakefile").write_text(TOY_SNAKEFILE)

    t0 = time.monotonic()
    proc = slurm_cluster.snakemake(cwd=slurm_dir, timeout=300)
    slurm_wall = time.monotonic() - t0
    print(f"\ntoy DAG (5 jobs) through SLURM: {slurm_wall:.1f} s")
    run_snakemake(["--cores", "2"], cwd=local_dir, profile=None, timeout=300)

    # Same results either way.
    slurm_out, local_out = _outputs(slurm_dir), _outputs(local_dir)
    assert sorted(slurm_out) == ["data/seed.txt", "data/sq_a.txt", "data/sq_b.txt",
                                 "data/sq_c.txt", "results/summary.txt"]
    assert slurm_out == local_out
    assert int(slurm_out["results/summary.txt"]) == EXPECTED_SUMMARY

    # Every job really ran as its own SLURM job, with the requested CPUs ...
    envs = _jobenv(slurm_dir)
    assert sorted(envs) == ["gather", "seed", "square_a", "square_b", "square_c"]
    job_ids = [jobid for jobid, _ in envs.values()]
    assert all(j.isdigit() for j in job_ids), envs
    assert len(set(job_ids)) == len(job_ids), envs
    assert envs["gather"][1] == "2", envs
    assert envs["seed"][1] == "1", envs
    assert "submitted with SLURM jobid" in proc.stdout
    assert any((slurm_dir / ".snakemake" / "slurm_logs").rglob("*.log"))
    # ... while the local run did not touch SLURM.
    assert all(v == ["none", "none"] for v in _jobenv(local_dir).values())
