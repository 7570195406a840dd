"""The claims matrix: every claim × every experiment (and arm), from the experiments' claims.csv.

Rows are the claims (evidence first, then the sanity checks apart); columns are the results
directories given (one column per arm where an experiment has several). A cell is

  ✓ 3/3            reproduced on the seed means and in every seed (3 of 3)
  ✗ 0/3            not reproduced on the seed means and in any seed
  mixed 2/3        the seeds disagree: the rule holds in 2 of 3
  uninformative    (g-ctrl) the control's clamp barely changes its scale
  –                not run (the experiment has no such claim, or lacks a condition it needs)

and, where the rule in force was changed after that experiment's results, the verdict of the
rule as first registered follows when it differs: "✓ 2/2 (registered ✗ 0/2)".
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from ..io import atomic_write_text
from .fmt import md_table

NOT_RUN_CELL = "–"


class MatrixError(ValueError):
    """A results directory without a readable claims.csv (one line naming it)."""


def cell(verdict) -> str:
    """The matrix cell of a claims.csv verdict string."""
    v = str(verdict) if isinstance(verdict, str) else ""
    if not v or v.startswith("not run"):
        return NOT_RUN_CELL
    if v.startswith("control uninformative"):
        return "uninformative"
    m = re.match(r"mixed: (\d+)/(\d+)", v)
    if m:
        return f"mixed {m.group(1)}/{m.group(2)}"
    mark = "✗" if v.startswith("not reproduced") else "✓" if v.startswith("reproduced") else v
    m = re.search(r"\((\d+)/(\d+) seeds?\)", v)
    if m:
        return f"{mark} {m.group(1)}/{m.group(2)}"
    m = re.search(r"pooled over (\d+) runs", v)
    if m:
        return f"{mark} (pooled, {m.group(1)} runs)"
    if "seed means only" in v:
        return f"{mark} (seed means only)"
    return mark


def _read(results_dir: Path) -> pd.DataFrame:
    f = Path(results_dir) / "claims.csv"
    if not f.is_file():
        raise MatrixError(f"{f}: not found (write it with `loopscale report tables` or `loopscale report claims`)")
    try:
        df = pd.read_csv(f, dtype=str, keep_default_na=False)
    except (OSError, ValueError) as e:
        raise MatrixError(f"{f}: unreadable ({e})") from None
    missing = [c for c in ("id", "claim", "verdict") if c not in df.columns]
    if missing:
        raise MatrixError(f"{f}: missing column(s) {', '.join(missing)}")
    if "kind" not in df.columns:  # a claims.csv written before claims had kinds
        from .claims import CLAIM_SPECS, _id_of
        kinds = {_id_of(s): s.kind for s in CLAIM_SPECS}
        df["kind"] = [kinds.get(i, "evidence") for i in df["id"]]
    if "arm" not in df.columns:
        df["arm"] = df["size"] if "size" in df.columns else ""
    for c in ("registered_verdict",):
        if c not in df.columns:
            df[c] = ""
    return df


def _order() -> dict:
    from .claims import CLAIM_SPECS, _id_of
    from .dose import RULES
    ids = [_id_of(s) for s in CLAIM_SPECS] + [fn(pd.DataFrame(columns=["status", "lambda", "norm_K", "depth_gain",
                                                                       "ppl_K", "seed"])).id for fn in RULES]
    return {i: n for n, i in enumerate(ids)}


def build(results_dirs: list) -> pd.DataFrame:
    """The matrix as a frame: id, kind, claim, then one column per experiment (and arm)."""
    if not results_dirs:
        raise MatrixError("no results directories given")
    rows: dict = {}
    columns: list = []
    for d in results_dirs:
        df = _read(Path(d))
        exp = Path(d).name
        arms = list(dict.fromkeys(df["arm"]))
        for arm in arms:
            col = exp if len(arms) == 1 else f"{exp}: {arm}"
            if col in columns:
                raise MatrixError(f"{d}: column {col!r} given twice")
            columns.append(col)
            for _, r in df[df["arm"] == arm].iterrows():
                row = rows.setdefault(r["id"], {"id": r["id"], "kind": r["kind"], "claim": r["claim"]})
                text = cell(r["verdict"])
                reg = cell(r["registered_verdict"]) if r["registered_verdict"] else ""
                if reg and reg != text:
                    text += f" (registered {reg})"
                row[col] = text
    order = _order()
    out = pd.DataFrame(list(rows.values()), columns=["id", "kind", "claim"] + columns).fillna(NOT_RUN_CELL)
    out["_k"] = (out["kind"] != "evidence").astype(int)
    out["_o"] = [order.get(i, len(order)) for i in out["id"]]
    return out.sort_values(["_k", "_o", "id"], kind="stable").drop(columns=["_k", "_o"]).reset_index(drop=True)


def markdown(m: pd.DataFrame, sources: list) -> str:
    cols = [c for c in m.columns if c not in ("id", "kind", "claim")]
    parts = ["# Claims matrix\n",
             "Every claim (rows) in every experiment (columns; one per arm where an experiment has several), from "
             "the experiments' claims.csv (" + ", ".join(f"`{s}`" for s in sources) + "). ✓ k/n: reproduced on the "
             "seed means and in k of n seeds (all); ✗: not reproduced; mixed k/n: the seeds disagree; "
             "uninformative: the control could not decide; –: not run. \"(registered …)\" gives the verdict of the "
             "rule as first registered where the rule was changed after that experiment's results and the verdict "
             "differs.\n"]
    for kind, title in (("evidence", "Evidence"), ("sanity", "Sanity checks (hold by construction)")):
        sub = m[m["kind"] == kind]
        if len(sub):
            parts.append(f"\n## {title}\n\n" + md_table(["Claim"] + cols, [
                [f"({r['id']}) {r['claim']}"] + [r[c] for c in cols] for _, r in sub.iterrows()],
                align=["l"] + ["l"] * len(cols)))
    return "\n".join(parts)


def write(results_dirs: list, out_dir) -> list[Path]:
    m = build(results_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [atomic_write_text(out / "claims_matrix.csv", m.to_csv(index=False)),
            atomic_write_text(out / "claims_matrix.md", markdown(m, [str(d) for d in results_dirs]))]
