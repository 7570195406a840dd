"""One-node SLURM test cluster for pytest, plus helpers to run Snakemake on it.

The fixture ``slurm_cluster`` (session scope) runs ``tests/slurm/cluster.sh
install`` and ``up`` (apt packages slurmctld/slurmd/slurm-client/munge, config
at /etc/slurm/slurm.conf, daemons started by hand, node "localhost" in
partition "local" with this machine's CPUs and memory), yields a
:class:`SlurmCluster`, and ALWAYS runs ``cluster.sh down`` afterwards.

Needs root and apt (or the packages already installed). Otherwise the fixture
skips locally, but FAILS when the environment variable ``CI`` is ``true``, so
CI never silently skips the SLURM tests.

Using it from a test module (tests/ has no __init__.py, so under pytest's
default "prepend" import mode tests/ is on sys.path and this module imports as
``slurm_cluster``; should tests/ become a package, import ``tests.slurm_cluster``
instead)::

    import pytest
    from slurm_cluster import REPO_ROOT, slurm_cluster  # noqa: F401  (registers the fixture)

    @pytest.mark.slow
    def test_pipeline_on_slurm(slurm_cluster, tmp_path):
        proc = slurm_cluster.snakemake(
            "--config", "experiment=smoke",         # e.g.; any extra snakemake args
            "--set-resources", "train:runtime=120", # per-rule overrides, if needed
            cwd=REPO_ROOT,                          # where snakemake runs
            snakefile=REPO_ROOT / "Snakefile",  # optional
            timeout=900,                            # seconds; kills the run, fails the test
        )
        # a non-zero exit already failed the test (check=True), with the
        # output tail and the SLURM job logs in the message; proc.stdout has
        # the full snakemake output.

which runs (with :func:`snakemake_env`, i.e. the venv's bin/ first on PATH)::

    <venv>/bin/snakemake --profile <abs>/profiles/slurm-local \\
        --workflow-profile none [--snakefile S] <args...>

Why these details matter:

* ``--workflow-profile none``: no workflow profile is merged on top (there is
  no profiles/default today; one with ``cores: all`` would cap each job's
  threads, and thus sbatch --cpus-per-task, at the submit host's core count).
* PATH: the plugin submits with ``sbatch --export=ALL``, so jobs inherit the
  caller's environment; the venv's bin/ must be on PATH for rules that call
  ``python``/``loopscale``/``snakemake``. SLURM_* variables are stripped so a
  test started inside a real SLURM job does not confuse the plugin.
* The slurm-local profile polls with ``squeue`` (no slurmdbd, so ``sacct``
  fails) and checks job status after 2 s instead of 40 s.
* The test node has this machine's CPUs/memory; a job asking for more CPUs
  than exist is rejected at submission (EnforcePartLimits=ALL) rather than
  pending forever. Memory is a scheduling quantity only (not enforced);
  runtime is enforced. GPU resources (gpu/gres) cannot be satisfied.
* One cluster per machine: two pytest sessions at once share it, and the
  first to finish tears it down.
* SLURM logs of every job stay in ``<workdir>/.snakemake/slurm_logs/``; on
  failure :func:`run_snakemake` puts the tail of the output and of those logs
  into the assertion message.

Outside pytest: ``sudo tests/slurm/cluster.sh install && sudo tests/slurm/cluster.sh up``,
then the same snakemake command, then ``sudo tests/slurm/cluster.sh down``.
Set ``LOOPSCALE_SLURM_KEEP=1`` to leave the cluster up after the session.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO_ROOT / "tests" / "slurm" / "cluster.sh"
PROFILES_DIR = REPO_ROOT / "profiles"
SLURM_LOCAL_PROFILE = PROFILES_DIR / "slurm-local"
SLURM_PROFILE = PROFILES_DIR / "slurm"
DEFAULT_PROFILE = PROFILES_DIR / "default"
# The interpreter running pytest is the project venv's (it has snakemake).
VENV_BIN = Path(sys.executable).parent
SNAKEMAKE = VENV_BIN / "snakemake"
PARTITION = "local"  # the only partition of the test cluster (cluster.sh)
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "munged")

INSTALL_TIMEOUT_S = 600
UP_TIMEOUT_S = 180
DOWN_TIMEOUT_S = 120


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def skip_or_fail(reason: str) -> None:
    """pytest.skip locally, pytest.fail under CI=true (CI must not skip)."""
    if in_ci():
        pytest.fail(f"SLURM test cluster unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


def _slurm_installed() -> bool:
    paths = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return all(shutil.which(b, path=paths) for b in SLURM_BINARIES)


def snakemake_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for snakemake runs: venv bin/ first on PATH, no SLURM_* vars."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    path = [str(VENV_BIN)] + [p for p in env.get("PATH", "").split(os.pathsep) if p]
    for sbin in ("/usr/sbin", "/sbin"):  # slurm client tools, munge
        if sbin not in path:
            path.append(sbin)
    env["PATH"] = os.pathsep.join(path)
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _slurm_logs_tail(cwd: Path, lines: int = 30, max_files: int = 6) -> str:
    logdir = cwd / ".snakemake" / "slurm_logs"
    if not logdir.is_dir():
        return ""
    logs = sorted(logdir.rglob("*.log"), key=lambda p: p.stat().st_mtime)[-max_files:]
    parts = []
    for log in logs:
        try:
            parts.append(f"----- {log} -----\n{_tail(log.read_text(errors='replace'), lines)}")
        except OSError:
            continue
    return "\n".join(parts)


def run_snakemake(
    args: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike,
    profile: str | os.PathLike | None = SLURM_LOCAL_PROFILE,
    snakefile: str | os.PathLike | None = None,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run the venv's snakemake; profile=None runs without any profile.

    With a profile, ``--workflow-profile none`` is added (see module doc).
    Output (stdout+stderr) is captured in ``.stdout``. On timeout the whole
    process group is killed (any SLURM jobs left are cancelled by ``down``)
    and the test fails. With check=True a non-zero exit fails the test with
    the output tail and the SLURM job logs' tails.
    """
    cwd = Path(cwd)
    cmd: list[str] = [str(SNAKEMAKE)]
    if profile is not None:
        cmd += ["--profile", str(Path(profile).resolve()), "--workflow-profile", "none"]
    if snakefile is not None:
        cmd += ["--snakefile", str(snakefile)]
    cmd += [str(a) for a in args]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=dict(env) if env is not None else snakemake_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # own process group, killable as a whole
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(
            f"snakemake timed out after {timeout}s: {' '.join(cmd)}\n"
            f"{_tail(out or '')}\n{_slurm_logs_tail(cwd)}",
            pytrace=False,
        )
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and result.returncode != 0:
        pytest.fail(
            f"snakemake exited {result.returncode}: {' '.join(cmd)}\n"
            f"{_tail(out)}\n{_slurm_logs_tail(cwd)}",
            pytrace=False,
        )
    return result


@dataclass
class SlurmCluster:
    """Handle yielded by the ``slurm_cluster`` fixture."""

    profile: Path = SLURM_LOCAL_PROFILE
    partition: str = PARTITION
    cluster_sh: Path = CLUSTER_SH
    env: dict[str, str] = field(default_factory=snakemake_env)

    def snakemake(self, *args: str | os.PathLike, cwd: str | os.PathLike, **kwargs):
        """run_snakemake() through the slurm-local profile (see module doc)."""
        kwargs.setdefault("profile", self.profile)
        kwargs.setdefault("env", self.env)
        return run_snakemake(args, cwd=cwd, **kwargs)

    def sh(self, *cmd: str, timeout: float = 30) -> str:
        """Run a SLURM client command (sinfo, squeue, scontrol ...); return stdout."""
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=True
        ).stdout


def cluster_sh(action: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CLUSTER_SH), action],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        skip_or_fail("needs root (installs packages, starts slurmctld/slurmd/munged)")
    if not _slurm_installed() and shutil.which("apt-get") is None:
        skip_or_fail("SLURM is not installed and apt-get is not available")

    try:
        inst = cluster_sh("install", INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        skip_or_fail(f"'cluster.sh install' timed out after {INSTALL_TIMEOUT_S}s")
    if inst.returncode != 0:
        skip_or_fail(f"'cluster.sh install' failed:\n{inst.stdout}{_tail(inst.stderr)}")

    try:
        try:
            up = cluster_sh("up", UP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
            pytest.fail(f"'cluster.sh up' timed out after {UP_TIMEOUT_S}s:\n{err or ''}", pytrace=False)
        if up.returncode != 0:
            pytest.fail(f"'cluster.sh up' failed:\n{up.stdout}{up.stderr}", pytrace=False)
        yield SlurmCluster()
    finally:
        if os.environ.get("LOOPSCALE_SLURM_KEEP") != "1":
            down = cluster_sh("down", DOWN_TIMEOUT_S)
            if down.returncode != 0:
                sys.stderr.write(f"'cluster.sh down' failed:\n{down.stdout}{down.stderr}\n")
