"""What the workflow tests share (test_pipeline, test_profiles, the SLURM, DVC, README, golden and
Ouro pipeline tests): a copy of the working tree as a fresh git repository, Snakemake and DVC run
in it with the copy's code, dry-run job lists, and the smoke grid run once per session
(`smoke_run_once`, behind conftest.py's `smoke_local` fixture). A helper module, not a test file."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from loopscale import pipeline as P

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SNAKEMAKE = str(VENV_BIN / "snakemake")
DVC = str(VENV_BIN / "dvc")
SCHEMA = REPO / "workflow" / "schemas" / "params.schema.yaml"
SMOKE = ("--config", "experiment=smoke")
# tables whose numbers are a pure function of the runs (no timings): equal across hosts
DETERMINISTIC_TABLES = ("main", "norms", "radial", "lemma", "clamp", "norm_loops", "depth")
TIMING_COLUMN = re.compile(r"tokens_per_s|tok_per_s|wall|speedup|throughput|time", re.I)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def pipeline_env(repo: Path, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = str(repo / "src")
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", DVC_NO_ANALYTICS="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra or {})
    return env


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=loopscale-test", "-c", "user.email=test@loopscale",
                           *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def copy_worktree(dest: Path) -> Path:
    """The repository's working tree (tracked + untracked, not ignored) as a fresh git repo."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    dest.mkdir(parents=True)
    for f in filter(None, files):
        src = REPO / f
        if src.is_symlink():  # the `slurm` profile's name at the root (profiles/slurm)
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dest / f)
        elif src.is_file() and "__pycache__" not in f:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "working tree")
    return dest


def fresh_copy(src: Path, dest: Path) -> Path:
    """A copy of a completed workspace, mtimes kept, without Snakemake's metadata (.snakemake/),
    i.e. what a fresh clone with the outputs restored looks like to Snakemake."""
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    return dest


def run(cmd: list[str], repo: Path, check: bool = True, timeout: float = 900, env: dict | None = None):
    proc = subprocess.run(cmd, cwd=repo, env=env or pipeline_env(repo), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}", pytrace=False)
    return proc


def smk(repo: Path, *args: str, **kw):
    return run([SNAKEMAKE, *args], repo, **kw)


def dry_run(repo: Path, *args: str) -> list[tuple[str, str]]:
    """(rule, output) of every job `snakemake -n` would run ([] when nothing to do)."""
    out = smk(repo, "-n", *SMOKE, *args).stdout
    if "Nothing to be done" in out:
        return []
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        m = re.match(r"(?:local)?rule (\w+):", block)
        if m:
            o = re.search(r"^\s+output: (.*)$", block, re.M)
            jobs.append((m.group(1), o.group(1) if o else ""))
    return jobs


def counts(jobs) -> dict[str, int]:
    out: dict[str, int] = {}
    for rule, _ in jobs:
        out[rule] = out.get(rule, 0) + 1
    return out


def tree_digest(repo: Path, dirs=("data", "runs", "results", "logs")) -> dict[str, str]:
    """path -> sha256 of every file under `dirs` (plus mtimes of the files)."""
    out = {}
    for d in dirs:
        for p in sorted((repo / d).rglob("*")) if (repo / d).exists() else []:
            if p.is_file():
                out[str(p.relative_to(repo))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def edit_params(repo: Path, fn) -> None:
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    fn(params)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def read_table(path: Path) -> list[dict]:
    import csv
    with open(path) as f:
        return [{k: v for k, v in row.items() if not TIMING_COLUMN.search(k)} for row in csv.DictReader(f)]


def assert_same_tables(a: Path, b: Path) -> None:
    for name in DETERMINISTIC_TABLES:
        ta, tb = read_table(a / f"{name}.csv"), read_table(b / f"{name}.csv")
        assert ta == tb, f"{name}.csv differs between {a} and {b}"


def smoke_runs(repo: Path) -> list[Path]:
    return sorted((repo / "runs" / "smoke").glob("*/*/seed*"))


def smoke_run_once(tmp_path_factory) -> tuple[Path, float]:
    """The smoke grid run once per session through `snakemake --cores 2` (memoised on disk,
    so every test file that asks for the `smoke_local` fixture reuses it, and so do the other pytest-xdist workers: under
    xdist it lies in the session's folder, above the workers' own, behind a file lock).
    Tests read it or copy it, never change it."""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    base = root / "smoke-local"
    marker = base / "wall_s"
    with FileLock(str(root / "smoke-local.lock")):
        if marker.exists():
            return base / "repo", float(marker.read_text())
        if base.exists():
            shutil.rmtree(base)
        repo = copy_worktree(base / "repo")
        t0 = time.monotonic()
        smk(repo, "--cores", "2", *SMOKE)
        wall = time.monotonic() - t0
        marker.write_text(f"{wall:.1f}")
        return repo, wall


def load(params: dict, tmp_path: Path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return P.load_and_validate(path, SCHEMA)


def jobs_of(dry_run_output: str) -> list[dict]:
    """rule, wildcards and resources of every job of a dry run's output (local rules too)."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", dry_run_output):
        m = re.match(r"(?:local)?rule (\w+):", block)
        if not m or m.group(1) == "all":
            continue
        fields = {k: v for k, v in re.findall(r"^\s+(wildcards|resources): (.*)$", block, re.M)}
        parse = lambda s: dict(kv.split("=", 1) for kv in s.split(", ")) if s else {}  # noqa: E731
        res = {k: int(v) if v.isdigit() else v for k, v in parse(fields.get("resources", "")).items()}
        jobs.append({"rule": m.group(1), "wildcards": parse(fields.get("wildcards", "")), "resources": res})
    return jobs
