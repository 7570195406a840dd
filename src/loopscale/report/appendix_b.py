"""Appendix B's tables on the Ouro track: variable-depth perplexity (K = 1..8) per readout variant
and evaluation corpus, and downstream multiple-choice accuracy per task (acc, acc_norm), each a
mean ± std over seeds, beside the paper's value.

loopscale holds no Appendix-B number of the paper (report/paper.py has Table 1's and the
abstract's only), so the paper column reads "not reported" in every cell; a number is never
filled in from anywhere else. Inputs: RUN/eval/ouro_depth-<corpus>.json (`loopscale ouro-depth`)
and RUN/eval/downstream.json (`loopscale ouro-downstream`) of the completed runs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from .groups import Table, stats
from .markdown import md_table, pm
from .runs import finite

PAPER = "not reported"
DEPTH_PREFIX = "ouro_depth-"
COLUMNS = ["table", "size", "condition", "readout", "data", "K", "metric", "mean", "std", "n_seeds", "paper"]


def appendix_b_frame(entries: Iterable[dict]) -> pd.DataFrame:
    """The long table of Appendix B from one entry per run:
    {"size", "condition", "readout", "seed", "depth": {corpus: [{"K", "ppl"}, ...]},
     "downstream": [{"task", "loops", "acc", "acc_norm", ["acc_norm_token"]}, ...]}.
    One row per (size, condition, corpus or task, K or loops, metric): the mean and std
    (ddof 1) over the runs that have the value, their count, and the paper's value."""
    cells: dict[tuple, list] = {}  # in first-seen order

    def add(key: tuple, value) -> None:
        values = cells.setdefault(key, [])
        if finite(value):
            values.append(float(value))

    for e in entries:
        head = (e["size"], e["condition"], e.get("readout", ""))
        for corpus, rows in sorted((e.get("depth") or {}).items()):
            for r in sorted(rows, key=lambda r: r["K"]):
                add(("variable_depth", *head, corpus, int(r["K"]), "ppl"), r.get("ppl"))
        for r in e.get("downstream") or []:
            for m in ("acc", "acc_norm", "acc_norm_token"):
                if m in r:
                    add(("downstream", *head, r["task"], int(r["loops"]), m), r.get(m))
    rows = [dict(zip(COLUMNS, [*key, *stats(values), PAPER])) for key, values in cells.items()]
    df = pd.DataFrame(rows, columns=COLUMNS)
    if not df.empty:
        df = df.sort_values(["table", "size", "data", "condition", "K", "metric"], kind="stable",
                            ascending=[False, True, True, True, True, True]).reset_index(drop=True)
    return df


def appendix_b_markdown(df: pd.DataFrame) -> str:
    """Markdown of the long table: per size and corpus PPL at K = 1..8 (one row per readout
    variant), per size the accuracy at each depth and task."""
    if df.empty:
        return ("No Appendix-B results: no completed Ouro run has RUN/eval/ouro_depth-*.json or "
                "RUN/eval/downstream.json.\n")
    out = []
    depth = df[df.table == "variable_depth"]
    for (size, corpus), g in depth.groupby(["size", "data"], sort=False):
        ks = sorted(g.K.unique())
        body = []
        for cond, c in g.groupby("condition", sort=False):
            by_k = {int(r.K): r for r in c.itertuples()}
            body.append([cond] + [pm(by_k[k].mean, by_k[k].std, by_k[k].n_seeds) if k in by_k else "—" for k in ks]
                        + [f"{int(c.n_seeds.max())}", PAPER])
        out.append(f"## Variable depth: perplexity on {corpus}, {size}\n\n"
                   + md_table(["Condition"] + [f"K={k}" for k in ks] + ["Seeds", "Paper"], body,
                              ["l"] + ["r"] * (len(ks) + 1) + ["l"]))
    down = df[df.table == "downstream"]
    for size, g in down.groupby("size", sort=False):
        cols = list(dict.fromkeys(zip(g.data, g.metric)))
        body = []
        for (cond, k), c in g.groupby(["condition", "K"], sort=False):
            by = {(r.data, r.metric): r for r in c.itertuples()}
            body.append([cond, f"{int(k)}"] + [pm(by[x].mean, by[x].std, by[x].n_seeds, kind="pct") if x in by
                                               else "—" for x in cols] + [PAPER])
        out.append(f"## Downstream multiple choice, {size}\n\n"
                   + md_table(["Condition", "Loops"] + [f"{t} {m}" for t, m in cols] + ["Paper"], body,
                              ["l", "r"] + ["r"] * len(cols) + ["l"]))
    out.append("Mean ± std over seeds (std with ddof 1; none for one seed). Variable depth: the final readout "
               "on step K for every K (`loopscale ouro-depth`). Downstream: lm-evaluation-harness through the "
               "`loopscale` model type; acc and acc_norm as lm-eval defines them (acc_norm: log-likelihood per "
               "character of the choice), acc_norm_token per continuation token (the official evaluator's "
               f"rule). Paper: \"{PAPER}\" wherever Appendix B gives no number this project holds; it holds none "
               "of Appendix B's numbers, so every cell says so.\n")
    return "\n".join(out)


def _read(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) and d.get("status", "ok") == "ok" else None


def run_entry(run) -> Optional[dict]:
    """The Appendix-B entry of one report Run (None: not a completed Ouro run with results)."""
    if not run.completed or run.cfg("model", "arch") != "ouro":
        return None
    ev = Path(run.path) / "eval"
    depth = {}
    for p in sorted(ev.glob(f"{DEPTH_PREFIX}*.json")):
        d = _read(p)
        if d is not None and isinstance(d.get("rows"), list):
            depth[p.stem[len(DEPTH_PREFIX):]] = [r for r in d["rows"] if isinstance(r, dict) and "K" in r]
    down = _read(ev / "downstream.json")
    rows = [r for r in (down or {}).get("rows") or [] if isinstance(r, dict) and "task" in r and "loops" in r]
    if not depth and not rows:
        return None
    return {"size": run.size.label, "condition": run.condition.label, "readout": run.cfg("model", "readout"),
            "seed": run.seed, "depth": depth, "downstream": rows}


def is_ouro(runs) -> bool:
    return any(r.cfg("model", "arch") == "ouro" for r in runs)


def appendix_b_table(runs) -> Table:
    entries = [e for e in (run_entry(r) for r in runs) if e is not None]
    df = appendix_b_frame(entries)
    return Table("appendix_b", "Appendix B: the Ouro track (variable depth, downstream accuracy)", df,
                 appendix_b_markdown(df))
