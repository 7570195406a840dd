"""Runs grouped by size × condition, the values each run's diagnostics hold, and the `Table`
every report table is: the substrate of tables.py, figures.py, claims.py and the drift modules.

Every run given is shown somewhere: `runs.csv` lists each one with its status, and each
table's `n` counts the seeds that went into its means. Runs that diverged or failed are
excluded from every mean (they appear in the `runs` column of the main table and in a
note under each table); a completed run without a diagnostic file simply contributes
nothing to that table (its cells stay empty, n drops, and the note says so).

Std is the sample standard deviation over seeds (ddof=1); with one seed it is empty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import pandas as pd

from ..io import atomic_write_text
from ..runtime import ppl
from ..registry import Condition
from .runs import Run, Size, finite


# ---------------------------------------------------------------------------
# groups: one per size × condition
# ---------------------------------------------------------------------------
@dataclass
class Group:
    size: Size
    cond: Condition
    runs: list = field(default_factory=list)

    @property
    def used(self) -> list:
        """Runs that enter the means: completed ones."""
        return [r for r in self.runs if r.completed]

    @property
    def excluded(self) -> list:
        return [r for r in self.runs if not r.completed]

    @property
    def d_model(self) -> int:
        return self.size.d_model

    @property
    def K(self) -> int:
        return self.size.n_loops

    def runs_text(self) -> str:
        """'3 completed' / '2 completed; seed 7 diverged at step 40' / '0 completed; seed 1 failed: ...'."""
        return "; ".join([f"{len(self.used)} completed"] + [f"seed {r.seed} {r.note}" for r in self.excluded])


def group_runs(runs: Iterable[Run]) -> list[Group]:
    groups: dict = {}
    for r in runs:
        key = (r.size, r.condition)
        groups.setdefault(key, Group(r.size, r.condition)).runs.append(r)
    out = sorted(groups.values(), key=lambda g: (g.size.sort_key(), g.cond.sort_key()))
    for g in out:
        g.runs.sort(key=Run.seed_key)
    return out


def stats(values: Iterable) -> tuple[float, float, int]:
    """(mean, std with ddof=1, n) over the finite values; NaN where undefined."""
    v = [float(x) for x in values if finite(x)]
    n = len(v)
    if n == 0:
        return math.nan, math.nan, 0
    mean = math.fsum(v) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (n - 1)) if n > 1 else math.nan
    return mean, std, n


def stat_columns(key: str, s: tuple) -> dict:
    """A table row's columns of one quantity from its `stats`: key_mean, key_std, key_n."""
    return {f"{key}_mean": s[0], f"{key}_std": s[1], f"{key}_n": s[2]}


# ---------------------------------------------------------------------------
# per-run extraction (each returns None when the data is absent)
# ---------------------------------------------------------------------------
def exits(run: Run) -> tuple[Optional[list], str]:
    """[{k, ce, ppl, norm}] for the exits k=1..K and the source: eval/depth.json (full
    validation) or, without it, the end-of-training validation in summary.json."""
    d = run.diag("depth")
    if d and isinstance(d.get("exits"), list) and d["exits"]:
        return [dict(r) for r in d["exits"]], "depth"
    if run.diag_status("depth") in ("malformed", "unreadable"):  # never silently replaced by the summary's
        return None, "none"
    val = run.summary.get("validation") if run.completed else None
    if isinstance(val, dict) and isinstance(val.get("val_ce"), list) and val["val_ce"]:
        norms = val.get("val_norm") or [math.nan] * len(val["val_ce"])
        return [{"k": i + 1, "ce": c, "ppl": ppl(c), "norm": n} for i, (c, n) in enumerate(zip(val["val_ce"], norms))], \
            "summary"
    return None, "none"


def final_exit(run: Run) -> dict:
    ex, src = exits(run)
    if not ex:
        return {"ce": math.nan, "ppl": math.nan, "norm": math.nan, "source": src}
    last = ex[-1]
    return {"ce": last.get("ce", math.nan), "ppl": last.get("ppl", ppl(last.get("ce"))),
            "norm": last.get("norm", math.nan), "source": src}


def _field(run: Run, diag: str, key: str, kind: type):
    """`key` of eval/<diag>.json's payload where it is a `kind` (None when absent or another type)."""
    d = run.diag(diag)
    v = d.get(key) if d else None
    return v if isinstance(v, kind) else None


def depth_curve(run: Run) -> Optional[list]:
    return _field(run, "depth", "depth", list)


def throughput_curve(run: Run) -> Optional[list]:
    return _field(run, "throughput", "depth", list)


def norm_loops(run: Run) -> Optional[list]:
    """[{k, norm}] from eval/norms.json (mean per-token ‖H_k‖), else the exits' norms."""
    rows = _field(run, "norms", "loops", list)
    if rows:
        return [{"k": r.get("k"), "norm": r.get("norm")} for r in rows]
    ex, _ = exits(run)
    return [{"k": r["k"], "norm": r.get("norm")} for r in ex] if ex else None


def norm_final(run: Run) -> Optional[dict]:
    return _field(run, "norms", "final", dict)


def norm_histogram(run: Run) -> Optional[dict]:
    h = _field(run, "norms", "histogram", dict)
    return h if h and h.get("edges") and h.get("counts") else None


def radial_loops(run: Run) -> Optional[list]:
    return _field(run, "radial", "loops", list)


LEMMA_KEYS = ("scale", "radial_increment", "relative_increment", "angular_update", "angular_times_scale")


def lemma_loops(run: Run) -> Optional[list]:
    rows = _field(run, "lemma", "loops", list)
    if not rows:
        return None
    return [{"k": r.get("k"), **{key: r.get(key, math.nan) for key in LEMMA_KEYS}} for r in rows]


def clamp_modes(run: Run) -> Optional[dict]:
    return _field(run, "clamp", "modes", dict)


def scale_sweep(run: Run) -> Optional[list]:
    """[{alpha, ce, ppl, delta_ce}] from eval/scale.json (the α scale-sensitivity sweep)."""
    return _field(run, "scale", "sweep", list)


def halting_policies(run: Run) -> Optional[dict]:
    return _field(run, "halting", "policies", dict)


def training_norms(run: Run) -> list[tuple[int, float]]:
    """(step, ‖H_K‖) from the training log."""
    return [(int(r["step"]), r["norm"][-1]) for r in run.metrics
            if isinstance(r.get("norm"), list) and r["norm"] and finite(r.get("step"))]


# ---------------------------------------------------------------------------
# tables: the record every report table is, and the notes under them
# ---------------------------------------------------------------------------
@dataclass
class Table:
    name: str  # file stem
    title: str
    df: pd.DataFrame  # numeric CSV content
    md: str  # Markdown body (tables + notes), without the title


def group_ids(g: Group) -> dict:
    return {"size": g.size.label, "params": g.size.params, "d_model": g.d_model, "n_loops": g.K,
            "condition": g.cond.label, "condition_id": g.cond.slug}


def k_values(g: Group, getter: Callable[[Run], Optional[list]], key: str) -> dict:
    """k -> list of per-seed values of `key` from rows [{k, key}] of the used runs."""
    out: dict = {}
    for r in g.used:
        for row in getter(r) or []:
            k = row.get("k")
            if k is not None:
                out.setdefault(int(k), []).append(row.get(key))
    return out


def excluded_note(groups: list[Group]) -> str:
    lines = [f"{g.cond.label} [{g.size.label}] seed {r.seed}: {r.note}" for g in groups for r in g.excluded]
    if not lines:
        return ""
    return "Excluded from the means (shown, not dropped): " + "; ".join(lines) + ".\n"


def missing_note(groups: list[Group], diag: str) -> str:
    miss, statuses = [], []
    for g in groups:
        by_status: dict = {}
        for r in g.used:
            st = r.diag_status(diag)
            statuses.append(st)
            if st != "ok":
                by_status.setdefault(st, []).append(str(r.seed))
        for st, seeds in by_status.items():
            miss.append(f"{g.cond.label} [{g.size.label}] seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)} ({st})")
    if not miss:
        return ""
    if len(set(statuses)) == 1:
        return (f"eval/{diag}.json is {statuses[0]} for all {len(statuses)} completed runs: the diagnostic was not run "
                f"(cells empty).\n")
    return f"Completed runs without a usable eval/{diag}.json (cells empty, n lower): " + "; ".join(miss) + ".\n"


def unusable_note(groups: list[Group], diag: str) -> str:
    """Completed runs whose eval/<diag>.json exists but cannot be used (unreadable, malformed)."""
    bad = [f"{g.cond.label} [{g.size.label}] seed {r.seed} ({r.diag_status(diag)})" for g in groups for r in g.used
           if r.diag_status(diag) in ("malformed", "unreadable")]
    if not bad:
        return ""
    return (f"Completed runs whose eval/{diag}.json is unusable (their cells left empty, not filled from "
            f"summary.json; see runs.md): " + "; ".join(bad) + ".\n")


def join_notes(*parts: str) -> str:
    body = "".join(p for p in parts if p)
    return ("\n" + body) if body else ""


def by_size(groups: list[Group]) -> list[tuple[Size, list[Group]]]:
    out: dict = {}
    for g in groups:
        out.setdefault(g.size, []).append(g)
    return list(out.items())


def size_heading(size: Size, multi: bool) -> str:
    return f"\n**{size.label}**\n\n" if multi else ""


def rel_path(path: Path, root: Optional[Path]) -> str:
    if root is not None:
        try:
            return str(Path(path).resolve().relative_to(Path(root).resolve()))
        except ValueError:
            pass
    return str(path)


def write_tables(tables: list[Table], out_dir: Path) -> list[Path]:
    """`<name>.csv` and `<name>.md` per table (atomic); returns the paths written."""
    out_dir = Path(out_dir)
    written = []
    for t in tables:
        written.append(atomic_write_text(out_dir / f"{t.name}.csv", t.df.to_csv(index=False, float_format="%.8g",
                                                                              lineterminator="\n")))
        if t.md:
            written.append(atomic_write_text(out_dir / f"{t.name}.md", f"# {t.title}\n\n{t.md}"))
    return written
