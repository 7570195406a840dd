"""The claims matrix: every claim × every experiment (and arm), from the experiments' claims.csv.

Its cells and the README view (`--readme`, `--splice`): docs/results.md, "The claims matrix".
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from ..io import atomic_write_text
from .markdown import md_table

NOT_RUN_CELL = "–"


class MatrixError(ValueError):
    """A results directory without a readable claims.csv (one line naming it)."""


def cell(verdict) -> str:
    """The matrix cell of a claims.csv verdict string."""
    v = verdict if isinstance(verdict, str) else ""
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
        from .claims import CLAIM_SPECS, claim_id
        kinds = {claim_id(s): s.kind for s in CLAIM_SPECS}
        df["kind"] = [kinds.get(i, "evidence") for i in df["id"]]
    if "arm" not in df.columns:
        df["arm"] = df["size"] if "size" in df.columns else ""
    if "registered_verdict" not in df.columns:
        df["registered_verdict"] = ""
    return df


def _order() -> dict:
    from .claims import CLAIM_SPECS, claim_id
    from .dose import RULES
    ids = [claim_id(s) for s in CLAIM_SPECS] + [fn(pd.DataFrame(columns=["status", "lambda", "norm_K", "depth_gain",
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


README_FILE = "claims_matrix_readme.md"
BEGIN, END = "<!-- claims-matrix:begin -->", "<!-- claims-matrix:end -->"


def _key(column: str) -> str:
    return re.sub(r"\s+", "", column)


def select_columns(m: pd.DataFrame, spec: str) -> list[str]:
    """The matrix columns named by a comma-separated spec (spaces ignored: cpu_confirm:d64 is
    the column "cpu_confirm: d64"), in the spec's order."""
    cols = [c for c in m.columns if c not in ("id", "kind", "claim")]
    by_key = {_key(c): c for c in cols}
    wanted = [w for w in (_key(x) for x in spec.split(",")) if w]
    if not wanted:
        raise MatrixError("--readme: no column named (e.g. --readme cpu,cpu_confirm:d64,cpu_long)")
    unknown = [w for w in wanted if w not in by_key]
    if unknown:
        raise MatrixError(f"--readme: no column {', '.join(map(repr, unknown))} in the matrix "
                          f"(its columns: {', '.join(by_key)})")
    if len(set(wanted)) != len(wanted):
        raise MatrixError(f"--readme: a column named twice in {spec!r}")
    return [by_key[w] for w in wanted]


def summarise(cells: list[str]) -> str:
    """One cell for several columns: how many hold each verdict, and the registered verdicts
    where they differ ("✓ in 6 (registered ✗ in 5, mixed in 1)"); – where none ran."""
    ran = [c for c in cells if c != NOT_RUN_CELL]
    if not ran:
        return NOT_RUN_CELL

    def counts(marks: list[str]) -> str:
        return ", ".join(f"{k} in {n}" for k, n in pd.Series(marks).value_counts(sort=False).items())
    text = counts([c.split(" ")[0] for c in ran])  # the marks: ✓, ✗, mixed, uninformative
    reg = [re.search(r"\(registered (\S+)", c) for c in ran]
    reg = [r.group(1) for r in reg if r]
    return text + (f" (registered {counts(reg)})" if reg else "")


def readme_view(m: pd.DataFrame, spec: str, command: str) -> str:
    """The README's claims table: the spec's columns, the others summarised, evidence and
    sanity checks apart, opened by the command that made it."""
    shown = select_columns(m, spec)
    rest = [c for c in m.columns if c not in ("id", "kind", "claim") and c not in shown]
    header = shown + ([f"the {len(rest)} other columns" if len(rest) > 1 else rest[0]] if rest else [])
    parts = [f"<!-- made by: {command} -->"]
    for kind, title in (("evidence", "Claim (evidence)"), ("sanity", "Sanity check (holds by construction)")):
        sub = m[m["kind"] == kind]
        if not len(sub):
            continue
        rows = [[f"({r['id']}) {r['claim']}"] + [r[c] for c in shown]
                + ([summarise([r[c] for c in rest])] if rest else []) for _, r in sub.iterrows()]
        parts.append(f"<!-- figures: results/claims_matrix/{README_FILE} -->\n"
                     + md_table([title] + header, rows, align=["l"] * (len(header) + 1)))
    return "\n".join(parts)


def _split(target: Path) -> tuple[str, str]:
    """The text of a Markdown file before its begin marker and after its end marker."""
    text = target.read_text() if target.is_file() else ""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise MatrixError(f"{target}: needs one {BEGIN} line followed by one {END} line")
    head, _, rest = text.partition(BEGIN)
    return head, rest.partition(END)[2]


def splice(view: str, target) -> Path:
    """Put the view between the claims-matrix markers of a Markdown file (e.g. README.md)."""
    head, tail = _split(Path(target))
    return atomic_write_text(Path(target), f"{head}{BEGIN}\n{view.rstrip()}\n{END}{tail}")


def write(results_dirs: list, out_dir, readme: str | None = None, command: str = "", splice_into=None) -> list[Path]:
    """claims_matrix.{csv,md}, with `readme` claims_matrix_readme.md, with `splice_into` that view
    spliced into a Markdown file; bad input is refused before anything is written."""
    if splice_into is not None and not readme:
        raise MatrixError("--splice needs --readme COLUMNS (the view it puts there)")
    m = build(results_dirs)
    view = readme_view(m, readme, command) if readme else None
    if splice_into is not None:
        _split(Path(splice_into))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [atomic_write_text(out / "claims_matrix.csv", m.to_csv(index=False)),
               atomic_write_text(out / "claims_matrix.md", markdown(m, [str(d) for d in results_dirs]))]
    if view is not None:
        written.append(atomic_write_text(out / README_FILE, view))
    if splice_into is not None:
        written.append(splice(view, splice_into))
    return written
