"""Run a long pre-registered study in sittings, keeping each finished run's results in git.

A study such as `cpu_length` (15 runs of ~2,000 s of CPU each) needs more hours than one sitting
on a 2-core machine, and a machine may not outlive the sitting: checkpoints (which stay out of
git) are then lost with it. So the unit kept between sittings is a *finished run's results*:
its run record, summary, training log and evaluation JSONs (everything `loopscale report`
reads), copied to `studies/<study>/runs/` and committed. Each sitting:

    git worktree add --detach ../studies-wt <pre-registration commit>    # once per machine
    (cd ../studies-wt && ln -s ../main/.venv .venv)                      # or `make setup` there
    python tools/study_sitting.py run cpu_length --worktree ../studies-wt --runs 4
    git add studies/cpu_length/runs && git commit -m "cpu_length: runs of sitting N (commit ...)"

`run` = `restore` (the committed results back into the worktree's runs/<study>/, so they are not
redone), Snakemake on the targets of the next unfinished runs (in seed order, so whole seeds
finish first), then `save`. The tables, figures and REPORT.md are built once every run is kept,
from `studies/<study>/runs` with `loopscale report` (as studies/cpu_dose/RESULTS.md shows).

Snakemake is asked which files each run produces (`--summary`), so the tool needs nothing of the
pinned commit's Python API and works for any experiment of params.yaml.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from loopscale.io import atomic_write_text  # main's package (the venv's), not the pinned commit's

# what `loopscale report` reads from a run directory (checkpoints, weights and tokenizer excluded)
RESULT_FILES = ("loopscale.json", "config.json", "config.yaml", "eval.yaml", "summary.json", "metrics.jsonl")
REPO = Path(__file__).resolve().parent.parent


def fail(msg: str) -> None:
    sys.exit(f"study_sitting: {msg}")


def snakemake_cmd(worktree: Path) -> list[str]:
    exe = worktree / ".venv" / "bin" / "snakemake"
    return [str(exe) if exe.exists() else "snakemake"]


def env_for(worktree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(worktree / "src")  # the pinned commit's package, whatever venv runs it
    env["PATH"] = f"{worktree / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def planned_runs(study: str, worktree: Path) -> dict[str, list[str]]:
    """{run dir (relative to the worktree): [its evaluation outputs]} from `snakemake --summary`."""
    cmd = snakemake_cmd(worktree) + ["--summary", "--nolock", "--config", f"experiment={study}"]
    out = subprocess.run(cmd, cwd=worktree, env=env_for(worktree), capture_output=True, text=True)
    cache = plan_cache(study, worktree)
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1:]
        if cache.is_file() and any("another snakemake" in line for line in last):
            # the study's own Snakemake holds the experiment (its plan is fixed by the pinned commit)
            print(f"study_sitting: {study} is running; using the plan recorded in {cache}", file=sys.stderr)
            return json.loads(cache.read_text())
        fail(f"`{' '.join(cmd)}` failed in {worktree}: {last}")
    runs = parse_summary(study, out.stdout)
    atomic_write_text(cache, json.dumps(runs, indent=1, sort_keys=True))
    return runs


def plan_cache(study: str, worktree: Path) -> Path:
    """Where the last plan of a study is kept (inside the pinned worktree, out of git)."""
    return worktree / ".snakemake" / f"study_sitting-{study}.json"


def parse_summary(study: str, summary: str) -> dict[str, list[str]]:
    """{run dir: [its evaluation outputs]} from the text of `snakemake --summary`."""
    runs: dict[str, list[str]] = {}
    prefix = f"runs/{study}/"
    for line in summary.splitlines():
        path = line.split("\t", 1)[0]
        if not path.startswith(prefix):
            continue
        p = Path(path)
        if p.parent.name == "eval":
            runs.setdefault(str(p.parent.parent), []).append(path)
        elif p.name == "summary.json":
            runs.setdefault(str(p.parent), [])
    if not runs:
        fail(f"snakemake plans no run under {prefix} (is '{study}' an experiment of params.yaml at that commit?)")
    return runs


def seed_order(run: str) -> tuple:
    seed = Path(run).name
    return (int(seed[4:]) if seed.startswith("seed") and seed[4:].isdigit() else 0, run)


def finished(run_dir: Path, evals: list[str], root: Path) -> bool:
    """A completed run with every evaluation output present and readable."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(summary, dict) or summary.get("status") not in ("completed", "diverged"):
        return False
    for e in evals:
        try:
            json.loads((root / e).read_text())
        except (OSError, ValueError):
            return False
    return True


def kept_dir(study: str) -> Path:
    return REPO / "studies" / study / "runs"


def restore(study: str, worktree: Path) -> int:
    """Copy the committed results into the worktree's runs/<study>/ (files already there are kept)."""
    src = kept_dir(study)
    n = 0
    for f in sorted(src.rglob("*")) if src.is_dir() else []:
        if f.is_file():
            dst = worktree / "runs" / study / f.relative_to(src)
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst)
                n += 1
    return n


def save(study: str, worktree: Path, runs: dict[str, list[str]]) -> list[str]:
    """Copy every finished run's result files to studies/<study>/runs/ (atomically per file)."""
    saved = []
    for run, evals in sorted(runs.items(), key=lambda kv: seed_order(kv[0])):
        rd = worktree / run
        if not finished(rd, evals, worktree):
            continue
        dst = kept_dir(study) / Path(run).relative_to(Path("runs") / study)
        files = [rd / n for n in RESULT_FILES if (rd / n).is_file()] + [worktree / e for e in evals]
        for f in files:
            target = dst / f.relative_to(rd)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            shutil.copy2(f, tmp)
            os.replace(tmp, target)
        saved.append(run)
    return saved


def todo(study: str, worktree: Path, runs: dict[str, list[str]]) -> list[str]:
    return [r for r in sorted(runs, key=seed_order) if not finished(worktree / r, runs[r], worktree)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("run", "restore", "todo", "save"))
    ap.add_argument("study", help="the experiment of params.yaml (studies/<study>/ holds its pre-registration)")
    ap.add_argument("--worktree", required=True, type=Path, help="the worktree pinned at the pre-registration commit")
    ap.add_argument("--runs", type=int, default=0, help="run: at most this many unfinished runs (0: all)")
    ap.add_argument("--cores", default="2", help="run: snakemake --cores (default 2)")
    a = ap.parse_args(argv)
    wt = a.worktree.resolve()
    if not (wt / "Snakefile").is_file():
        fail(f"{wt} is not a loopscale worktree (no Snakefile)")
    if not (REPO / "studies" / a.study / "preregistration.md").is_file():
        fail(f"studies/{a.study}/preregistration.md missing: register the study before running it")
    if a.action == "restore":
        print(f"restored {restore(a.study, wt)} files into {wt}/runs/{a.study}")
        return 0
    runs = planned_runs(a.study, wt)
    if a.action == "save":
        saved = save(a.study, wt, runs)
        print(f"kept {len(saved)} of {len(runs)} runs in {kept_dir(a.study).relative_to(REPO)}")
        return 0
    if a.action == "todo":
        left = todo(a.study, wt, runs)
        print(f"{len(runs) - len(left)} of {len(runs)} runs finished; next: " + (", ".join(left) or "none"))
        return 0
    print(f"restored {restore(a.study, wt)} files")
    left = todo(a.study, wt, runs)
    batch = left[: a.runs] if a.runs else left
    print(f"{len(runs) - len(left)} of {len(runs)} runs finished; this sitting: {len(batch)}")
    rc = 0
    if batch:
        targets = [e for r in batch for e in runs[r]] + [f"{r}/summary.json" for r in batch if not runs[r]]
        cmd = snakemake_cmd(wt) + ["--cores", a.cores, "--rerun-incomplete", "--keep-going", "--quiet", "rules",
                                   "host", "--config", f"experiment={a.study}", "--"] + targets
        rc = subprocess.call(cmd, cwd=wt, env=env_for(wt))
    saved = save(a.study, wt, runs)
    print(f"kept {len(saved)} of {len(runs)} runs in {kept_dir(a.study).relative_to(REPO)}; "
          f"commit them: git add {kept_dir(a.study).relative_to(REPO)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
