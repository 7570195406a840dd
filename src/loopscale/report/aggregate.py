"""Aggregate tables: mean ± std over seeds, one row per size × condition.

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
from . import paper
from .fmt import EMPTY, md_table, num, pm
from ..registry import Condition, condition
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
        parts = [f"{len(self.used)} completed"]
        for r in self.excluded:
            parts.append(f"seed {r.seed} {r.note}")
        return "; ".join(parts)


def group_runs(runs: Iterable[Run]) -> list[Group]:
    groups: dict = {}
    for r in runs:
        key = (r.size, r.condition)
        groups.setdefault(key, Group(r.size, r.condition)).runs.append(r)
    out = list(groups.values())
    out.sort(key=lambda g: (g.size.sort_key(), g.cond.sort_key()))
    for g in out:
        g.runs.sort(key=lambda r: (r.seed if r.seed is not None else -1, str(r.path)))
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


def depth_curve(run: Run) -> Optional[list]:
    d = run.diag("depth")
    return d.get("depth") if d and isinstance(d.get("depth"), list) else None


def throughput_curve(run: Run) -> Optional[list]:
    d = run.diag("throughput")
    return d.get("depth") if d and isinstance(d.get("depth"), list) else None


def _loops(d: Optional[dict]) -> Optional[list]:
    if not d:
        return None
    rows = d.get("loops")
    return rows if isinstance(rows, list) else None


def norm_loops(run: Run) -> Optional[list]:
    """[{k, norm}] from eval/norms.json (mean per-token ‖H_k‖), else the exits' norms."""
    rows = _loops(run.diag("norms"))
    if rows:
        return [{"k": r.get("k"), "norm": r.get("norm")} for r in rows]
    ex, _ = exits(run)
    return [{"k": r["k"], "norm": r.get("norm")} for r in ex] if ex else None


def norm_final(run: Run) -> Optional[dict]:
    d = run.diag("norms")
    return d.get("final") if d and isinstance(d.get("final"), dict) else None


def norm_histogram(run: Run) -> Optional[dict]:
    d = run.diag("norms")
    h = d.get("histogram") if d else None
    return h if isinstance(h, dict) and h.get("edges") and h.get("counts") else None


def radial_loops(run: Run) -> Optional[list]:
    return _loops(run.diag("radial"))


_LEMMA_KEYS = ("scale", "radial_increment", "relative_increment", "angular_update", "angular_times_scale")


def lemma_loops(run: Run) -> Optional[list]:
    rows = _loops(run.diag("lemma"))
    if not rows:
        return None
    out = []
    for r in rows:
        row = {"k": r.get("k")}
        for key in _LEMMA_KEYS:
            row[key] = r.get(key, math.nan)
        out.append(row)
    return out


def clamp_modes(run: Run) -> Optional[dict]:
    d = run.diag("clamp")
    m = d.get("modes") if d else None
    return m if isinstance(m, dict) else None


def scale_sweep(run: Run) -> Optional[list]:
    """[{alpha, ce, ppl, delta_ce}] from eval/scale.json (the α scale-sensitivity sweep)."""
    d = run.diag("scale")
    rows = d.get("sweep") if d else None
    return rows if isinstance(rows, list) else None


def halting_policies(run: Run) -> Optional[dict]:
    d = run.diag("halting")
    p = d.get("policies") if d else None
    return p if isinstance(p, dict) else None


def training_norms(run: Run) -> list[tuple[int, float]]:
    """(step, ‖H_K‖) from the training log."""
    out = []
    for r in run.metrics:
        n = r.get("norm")
        if isinstance(n, list) and n and finite(r.get("step")):
            out.append((int(r["step"]), n[-1]))
    return out


# ---------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------
@dataclass
class Table:
    name: str  # file stem
    title: str
    df: pd.DataFrame  # numeric CSV content
    md: str  # Markdown body (tables + notes), without the title


def _ids(g: Group) -> dict:
    return {"size": g.size.label, "params": g.size.params, "d_model": g.d_model, "n_loops": g.K,
            "condition": g.cond.label, "condition_id": g.cond.slug}


def _k_values(g: Group, getter: Callable[[Run], Optional[list]], key: str) -> dict:
    """k -> list of per-seed values of `key` from rows [{k, key}] of the used runs."""
    out: dict = {}
    for r in g.used:
        for row in getter(r) or []:
            k = row.get("k")
            if k is not None:
                out.setdefault(int(k), []).append(row.get(key))
    return out


def _excluded_note(groups: list[Group]) -> str:
    lines = [f"{g.cond.label} [{g.size.label}] seed {r.seed}: {r.note}" for g in groups for r in g.excluded]
    if not lines:
        return ""
    return "Excluded from the means (shown, not dropped): " + "; ".join(lines) + ".\n"


def _missing_note(groups: list[Group], diag: str) -> str:
    miss, n_used, n_miss = [], 0, 0
    for g in groups:
        by_status: dict = {}
        for r in g.used:
            n_used += 1
            st = r.diag_status(diag)
            if st != "ok":
                n_miss += 1
                by_status.setdefault(st, []).append(str(r.seed))
        for st, seeds in by_status.items():
            miss.append(f"{g.cond.label} [{g.size.label}] seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)} ({st})")
    if not miss:
        return ""
    if n_miss == n_used and len({m.rsplit('(', 1)[1] for m in miss}) == 1:
        st = miss[0].rsplit("(", 1)[1].rstrip(")")
        return f"eval/{diag}.json is {st} for all {n_used} completed runs: the diagnostic was not run (cells empty).\n"
    return f"Completed runs without a usable eval/{diag}.json (cells empty, n lower): " + "; ".join(miss) + ".\n"


def _unusable_note(groups: list[Group], diag: str) -> str:
    """Completed runs whose eval/<diag>.json exists but cannot be used (unreadable, malformed)."""
    bad = [f"{g.cond.label} [{g.size.label}] seed {r.seed} ({r.diag_status(diag)})" for g in groups for r in g.used
           if r.diag_status(diag) in ("malformed", "unreadable")]
    if not bad:
        return ""
    return (f"Completed runs whose eval/{diag}.json is unusable (their cells left empty, not filled from "
            f"summary.json; see runs.md): " + "; ".join(bad) + ".\n")


def _notes(*parts: str) -> str:
    body = "".join(p for p in parts if p)
    return ("\n" + body) if body else ""


def _by_size(groups: list[Group]) -> list[tuple[Size, list[Group]]]:
    out: dict = {}
    for g in groups:
        out.setdefault(g.size, []).append(g)
    return list(out.items())


def _size_heading(size: Size, multi: bool) -> str:
    return f"\n**{size.label}**\n\n" if multi else ""


def main_table(groups: list[Group]) -> Table:
    rows, md_rows = [], []
    for g in groups:
        fe = [final_exit(r) for r in g.used]
        ppl = stats(f["ppl"] for f in fe)
        ce = stats(f["ce"] for f in fe)
        nk = stats(f["norm"] for f in fe)
        sq = math.sqrt(g.d_model) if g.d_model else math.nan
        nks = stats(f["norm"] / sq for f in fe if finite(f["norm"]))
        srcs = sorted({f["source"] for f in fe if f["source"] != "none"})
        ref = paper.reference(g.cond)
        rows.append({**_ids(g), "runs": g.runs_text(), "n_runs": len(g.runs), "n": ppl[2] if ppl[2] else nk[2],
                     "ppl_K_mean": ppl[0], "ppl_K_std": ppl[1], "ppl_K_n": ppl[2],
                     "ce_K_mean": ce[0], "ce_K_std": ce[1],
                     "norm_K_mean": nk[0], "norm_K_std": nk[1], "norm_K_n": nk[2],
                     "norm_K_over_sqrt_d_mean": nks[0], "norm_K_over_sqrt_d_std": nks[1],
                     "ppl_source": "+".join(srcs),
                     "paper_ppl_K_129M": ref["ppl_K_129M"], "paper_norm_K": ref["norm_text"]})
        n_row = len(g.used)
        md_rows.append([g.size.label, g.cond.label, g.runs_text(), f"{len(g.used)}/{len(g.runs)}",
                        pm(ppl[0], ppl[1], ppl[2], n_row=n_row), pm(nk[0], nk[1], nk[2], n_row=n_row),
                        pm(nks[0], nks[1], nks[2], n_row=n_row),
                        num(ref["ppl_K_129M"]) if ref["ppl_K_129M"] is not None else EMPTY,
                        ref["norm_text"] or EMPTY])
    df = pd.DataFrame(rows)
    md = md_table(["Size", "Condition", "Runs", "n", "PPL (exit K)", "‖H_K‖", "‖H_K‖/√d",
                   "Paper PPL exit K=4 (129M)", "Paper ‖H_K‖"], md_rows)
    srcs = sorted({s for row in rows for s in row["ppl_source"].split("+") if s})
    src_note = ""
    if srcs:
        src_note = ("PPL and ‖H_K‖ at the final exit K: " +
                    {"depth": "from eval/depth.json (full validation evaluation).",
                     "summary": "from the end-of-training validation in summary.json (train.eval_tokens tokens).",
                     }.get(srcs[0], "") if len(srcs) == 1 else
                    "PPL and ‖H_K‖ at the final exit K: from eval/depth.json where present, otherwise from the "
                    "end-of-training validation in summary.json (see ppl_source in main.csv).") + "\n"
    md += _notes("\nmean ± std over seeds (std ddof=1); n = completed seeds / runs. ‖H_k‖ = mean over tokens of the "
                 "per-token L2 norm before any normalisation; √d is the norm of an N(0,1) embedding row (the "
                 "paper's init). Paper columns: the paper's 129M per-loop results and headline norms (PPL over the paper's regex tokens, 3 seeds).\n",
                 src_note, _unusable_note(groups, "depth"), _excluded_note(groups))
    return Table("main", "Main table: final-exit PPL and ‖H_K‖ per condition (Table 1 analog)", df, md)


def depth_table(groups: list[Group]) -> Table:
    rows = []
    md = ""
    multi = len({g.size for g in groups}) > 1
    for size, gs in _by_size(groups):
        K = size.n_loops
        kmax_depth = max([max(_k_values(g, depth_curve, "ppl") or {0: 0}) for g in gs] + [0])
        kmax_tp = max([max(_k_values(g, throughput_curve, "tokens_per_s") or {0: 0}) for g in gs] + [0])
        ex_rows, dp_rows, tp_rows = [], [], []
        for g in gs:
            n_row = len(g.used)
            ex_ppl = {}
            for r in g.used:
                for row in exits(r)[0] or []:
                    ex_ppl.setdefault(int(row["k"]), []).append(row.get("ppl"))
            ex_norm = _k_values(g, lambda r: exits(r)[0], "norm")
            dp_ppl = _k_values(g, depth_curve, "ppl")
            dp_norm = _k_values(g, depth_curve, "norm")
            tps = _k_values(g, throughput_curve, "tokens_per_s")
            for k in range(1, K + 1):
                s, sn = stats(ex_ppl.get(k, [])), stats(ex_norm.get(k, []))
                rows.append({**_ids(g), "kind": "exit", "k": k, "ppl_mean": s[0], "ppl_std": s[1], "ppl_n": s[2],
                             "norm_mean": sn[0], "norm_std": sn[1], "tokens_per_s_mean": math.nan,
                             "tokens_per_s_std": math.nan, "tokens_per_s_n": 0})
            for k in range(1, max(kmax_depth, kmax_tp) + 1):
                s, sn, st = stats(dp_ppl.get(k, [])), stats(dp_norm.get(k, [])), stats(tps.get(k, []))
                rows.append({**_ids(g), "kind": "depth", "k": k, "ppl_mean": s[0], "ppl_std": s[1], "ppl_n": s[2],
                             "norm_mean": sn[0], "norm_std": sn[1], "tokens_per_s_mean": st[0],
                             "tokens_per_s_std": st[1], "tokens_per_s_n": st[2]})
            ex_rows.append([g.cond.label, f"{len(g.used)}/{len(g.runs)}"] +
                           [pm(*stats(ex_ppl.get(k, [])), n_row=n_row) for k in range(1, K + 1)])
            dp_rows.append([g.cond.label, f"{len(g.used)}/{len(g.runs)}"] +
                           [pm(*stats(dp_ppl.get(k, [])), n_row=n_row) for k in range(1, kmax_depth + 1)])
            tp_rows.append([g.cond.label, f"{len(g.used)}/{len(g.runs)}"] +
                           [pm(*stats(tps.get(k, [])), kind="int", n_row=n_row) for k in range(1, kmax_tp + 1)])
        md += _size_heading(size, multi)
        md += "PPL at each exit k of one K-loop pass (each exit's own readout):\n\n"
        md += md_table(["Condition", "n"] + [f"k={k}" for k in range(1, K + 1)], ex_rows)
        if kmax_depth:
            md += (f"\nPPL at depth k with the final readout (the loop truncated or extended; k > K={K} is "
                   f"extrapolated beyond training depth):\n\n")
            md += md_table(["Condition", "n"] + [f"k={k}" + (" (K)" if k == K else "") for k in range(1, kmax_depth + 1)],
                           dp_rows)
        if kmax_tp:
            md += "\nThroughput of teacher-forced evaluation at depth k (tokens/s; k loops + one readout):\n\n"
            md += md_table(["Condition", "n"] + [f"k={k}" + (" (K)" if k == K else "") for k in range(1, kmax_tp + 1)],
                           tp_rows)
    md += "\nPaper reference (the paper's 129M results; K=4, three-seed means, PPL over the paper's regex tokens):\n\n"
    md += md_table(["Condition", "k=1", "k=2", "k=3", "k=4"],
                   [[condition(*base).label, *(f"{v:.2f}" for v in ppl)] for base, ppl in paper.PPL_129M.items()] +
                   [["throughput (tokens/s, L40S)", *(f"{v:,}" for v in paper.THROUGHPUT_129M)]])
    md += _notes("\nmean ± std over seeds.\n",
                 _missing_note(groups, "depth"), _missing_note(groups, "throughput"), _excluded_note(groups))
    return Table("depth", "Depth: PPL per exit, under extrapolated depth, and throughput", pd.DataFrame(rows), md)


def norms_table(groups: list[Group]) -> Table:
    keys = ("mean", "median", "p99", "max", "std", "min", "p99_over_median")
    rows, md_rows, loop_rows, loop_md = [], [], [], ""
    multi = len({g.size for g in groups}) > 1
    for g in groups:
        n_row = len(g.used)
        finals = [norm_final(r) for r in g.used]
        finals = [f for f in finals if f]
        row = {**_ids(g)}
        cells = [g.size.label, g.cond.label, f"{len(finals)}/{len(g.runs)}"]
        for key in keys:
            s = stats(f.get(key) for f in finals)
            row.update({f"{key}_mean": s[0], f"{key}_std": s[1], f"{key}_n": s[2]})
            cells.append(pm(s[0], s[1], s[2], n_row=len(finals)))
        rows.append(row)
        md_rows.append(cells)
    for size, gs in _by_size(groups):
        K = size.n_loops
        lrows = []
        for g in gs:
            nl = _k_values(g, norm_loops, "norm")
            for k in range(1, K + 1):
                s = stats(nl.get(k, []))
                loop_rows.append({**_ids(g), "k": k, "norm_mean": s[0], "norm_std": s[1], "norm_n": s[2]})
            lrows.append([g.cond.label, f"{len(g.used)}/{len(g.runs)}"] +
                         [pm(*stats(nl.get(k, [])), n_row=len(g.used)) for k in range(1, K + 1)])
        loop_md += _size_heading(size, multi) + md_table(["Condition", "n"] + [f"‖H_{k}‖" for k in range(1, K + 1)],
                                                         lrows)
    df = pd.DataFrame(rows)
    md = "Per-token distribution of ‖H_K‖ on validation tokens (per-seed statistics, then mean ± std over seeds):\n\n"
    md += md_table(["Size", "Condition", "n", "mean", "median", "p99", "max", "std", "min", "p99/median"], md_rows)
    md += "\nMean ‖H_k‖ per loop k (eval/norms.json, else the exits of the final validation):\n\n" + loop_md
    md += _notes("\n", _missing_note(groups, "norms"), _excluded_note(groups))
    return Table("norms", "Hidden-state norms: per loop and per-token distribution of ‖H_K‖", df, md), \
        Table("norm_loops", "‖H_k‖ per loop", pd.DataFrame(loop_rows), "")


def radial_table(groups: list[Group]) -> Table:
    rows, md = [], ""
    multi = len({g.size for g in groups}) > 1
    for size, gs in _by_size(groups):
        K = size.n_loops
        mrows = []
        for g in gs:
            rf = _k_values(g, radial_loops, "radial_fraction")
            mc = _k_values(g, radial_loops, "mean_cos")
            n = max([len([v for v in x if finite(v)]) for x in rf.values()] + [0])
            readouts = {}
            for r in g.used:
                for row in radial_loops(r) or []:
                    readouts.setdefault(int(row["k"]), row.get("readout"))
            for k in range(1, K + 1):
                s, c = stats(rf.get(k, [])), stats(mc.get(k, []))
                rows.append({**_ids(g), "k": k, "exit_readout": readouts.get(k), "radial_fraction_mean": s[0],
                             "radial_fraction_std": s[1], "radial_fraction_n": s[2], "mean_cos_mean": c[0],
                             "mean_cos_std": c[1]})
            mrows.append([g.cond.label, f"{n}/{len(g.runs)}"] +
                         [pm(*stats(rf.get(k, [])), kind="sci", n_row=n) for k in range(1, K + 1)])
        md += _size_heading(size, multi) + md_table(["Condition", "n"] + [f"k={k}" for k in range(1, K + 1)], mrows)
    md += _notes("\nRadial gradient fraction mean_t cos²(∂CE_k/∂H_k, H_k) of each exit's immediate loss. Paper: ~1e-9 "
                 "with the RMSNorm readout, ~1e-2 with the raw readout.\n",
                 _missing_note(groups, "radial"), _excluded_note(groups))
    return Table("radial", "Radial gradient fraction per loop (visibility lemma)", pd.DataFrame(rows), md)


def lemma_table(groups: list[Group]) -> Table:
    rows, md_rows = [], []
    for g in groups:
        cols = {key: _k_values(g, lemma_loops, key) for key in _LEMMA_KEYS}
        ks = sorted(cols["scale"])
        for k in ks:
            row = {**_ids(g), "k": k}
            for key in _LEMMA_KEYS:
                s = stats(cols[key].get(k, []))
                row.update({f"{key}_mean": s[0], f"{key}_std": s[1], f"{key}_n": s[2]})
            rows.append(row)
        n = max([len(v) for v in cols["scale"].values()] + [0])
        if not ks:
            md_rows.append([g.size.label, g.cond.label, f"0/{len(g.runs)}"] + [EMPTY] * 7)
            continue
        L = ks[-1]
        trans = [k for k in ks if stats(cols["angular_update"].get(k, []))[2]]
        first, last = (trans[0], trans[-1]) if trans else (None, None)
        prod = [stats(cols["angular_times_scale"].get(k, []))[0] for k in trans[1:]] if len(trans) > 1 else []
        ps = stats(prod)
        cv = ps[1] * math.sqrt((ps[2] - 1) / ps[2]) / ps[0] if ps[2] > 1 and ps[0] else math.nan  # population CV

        def m(key, k):
            return pm(*stats(cols[key].get(k, [])), n_row=n) if k is not None else EMPTY
        md_rows.append([g.size.label, g.cond.label, f"{n}/{len(g.runs)}", m("scale", 1), m("scale", L),
                        m("angular_update", first), m("angular_update", last),
                        m("angular_times_scale", first), m("angular_times_scale", last), num(cv)])
    md = md_table(["Size", "Condition", "n", "s_1", "s_L", "‖Δu‖ 1→2", "‖Δu‖ last", "‖Δu‖·s 1→2", "‖Δu‖·s last",
                   "CV of ‖Δu‖·s (k≥2)"], md_rows)
    md += _notes("\nActivity lemma over L = eval.lemma_loops loops: s_k = ‖H_k‖ per token, u_k = H_k/s_k; ‖Δu‖ = "
                 "‖u_{k+1} − u_k‖, ‖Δu‖·s = ‖u_{k+1} − u_k‖·s_k (mean ± std over seeds; the CV is over the seed "
                 "means). The lemma predicts ‖Δu‖ ∝ 1/s, i.e. "
                 "‖Δu‖·s roughly constant (small CV over the transitions k ≥ 2) while s grows. Per-loop values in "
                 "lemma.csv and the Lemma-2 figure.\n", _missing_note(groups, "lemma"), _excluded_note(groups))
    return Table("lemma", "Lemma-2 check (activity lemma)", pd.DataFrame(rows), md)


def clamp_table(groups: list[Group]) -> Table:
    rows, md_rows = [], []
    for g in groups:
        modes: dict = {}
        for r in g.used:
            for mode, mrows in (clamp_modes(r) or {}).items():
                for row in mrows:
                    modes.setdefault(mode, {}).setdefault(int(row["k"]), []).append(row)
        n = max([len(v) for m in modes.values() for v in m.values()] + [0])
        for mode in sorted(modes, key=lambda m: (m != "none", m)):
            for k in sorted(modes[mode]):
                vals = modes[mode][k]
                row = {**_ids(g), "mode": mode, "k": k}
                for key in ("ce", "ppl", "norm", "delta_ce", "rel_ppl", "radial_update", "update_norm"):
                    s = stats(v.get(key) for v in vals)
                    row.update({f"{key}_mean": s[0], f"{key}_std": s[1], f"{key}_n": s[2]})
                rows.append(row)
            if mode == "none":
                continue
            K = max(modes[mode])
            dce = [pm(*stats(v.get("delta_ce") for v in modes[mode].get(k, [])), n_row=n) for k in range(1, K + 1)]
            rel = stats(v.get("rel_ppl") for v in modes[mode].get(K, []))
            nrm = stats(v.get("norm") for v in modes[mode].get(K, []))
            base = stats(v.get("norm") for v in modes.get("none", {}).get(K, []))
            md_rows.append([g.size.label, g.cond.label, mode, f"{n}/{len(g.runs)}", " / ".join(dce),
                            pm(rel[0], rel[1], rel[2], n_row=n), pm(base[0], base[1], base[2], n_row=n),
                            pm(nrm[0], nrm[1], nrm[2], n_row=n)])
        if not modes:
            md_rows.append([g.size.label, g.cond.label, EMPTY, f"0/{len(g.runs)}", EMPTY, EMPTY, EMPTY, EMPTY])
    md = md_table(["Size", "Condition", "Clamp", "n", "ΔCE (nats) at k=1..K", "PPL ratio at K", "‖H_K‖ unclamped",
                   "‖H_K‖ clamped"], md_rows)
    md += _notes("\nInference-time interventions on the trained model: remove_radial drops each loop's update "
                 "component along the previous state's direction; freeze_loop1 rescales every state to its loop-1 "
                 "per-token RMS. ΔCE = CE(clamped) − CE(unclamped) per exit. Paper: clamping the scale changes CE "
                 "very little.\n", _missing_note(groups, "clamp"), _excluded_note(groups))
    return Table("clamp", "Scale-clamp interventions", pd.DataFrame(rows), md)


SCALE_MD_ALPHAS = (0.1, 0.5, 2.0, 10.0)  # the α columns of scale.md (scale.csv has every α)


def scale_table(groups: list[Group]) -> Table:
    """The α scale-sensitivity sweep: CE of the final readout of α·H_K, mean ± std over seeds."""
    rows, md_rows = [], []
    for g in groups:
        per: dict = {}
        for r in g.used:
            for row in scale_sweep(r) or []:
                if finite(row.get("alpha")):
                    per.setdefault(float(row["alpha"]), []).append(row)
        n = max([len(v) for v in per.values()] + [0])
        for a in sorted(per):
            row = {**_ids(g), "alpha": a}
            for key in ("ce", "ppl", "delta_ce"):
                st = stats(v.get(key) for v in per[a])
                row.update({f"{key}_mean": st[0], f"{key}_std": st[1], f"{key}_n": st[2]})
            rows.append(row)
        if not per:
            md_rows.append([g.size.label, g.cond.label, f"0/{len(g.runs)}"] + [EMPTY] * (len(SCALE_MD_ALPHAS) + 2))
            continue
        worst = []
        for r in g.used:
            d = [abs(v.get("delta_ce")) for v in scale_sweep(r) or [] if finite(v.get("delta_ce"))]
            if d:
                worst.append(max(d))
        ce1 = pm(*stats(v.get("ce") for v in per.get(1.0, [])), n_row=n)
        dce = [pm(*stats(v.get("delta_ce") for v in per.get(a, [])), n_row=n) for a in SCALE_MD_ALPHAS]
        md_rows.append([g.size.label, g.cond.label, f"{n}/{len(g.runs)}", ce1, *dce, pm(*stats(worst), n_row=n)])
    md = md_table(["Size", "Condition", "n", "CE at α=1"] + [f"ΔCE α={a:g}" for a in SCALE_MD_ALPHAS]
                  + ["max |ΔCE|"], md_rows)
    md += _notes("\nScale sensitivity (the official scale_sensitivity.py): CE of the final readout of α·H_K, "
                 "ΔCE = CE(α) − CE(1), α = 0.1 … 10 (every α in scale.csv and the scale figure). A scale-invariant "
                 "readout is flat in α (ΔCE = 0: the loss cannot see ‖H_K‖); a raw readout is not.\n",
                 _missing_note(groups, "scale"), _excluded_note(groups))
    return Table("scale", "Scale sensitivity: CE of the readout of α·H_K", pd.DataFrame(rows), md)


def halting_table(groups: list[Group]) -> Table:
    rows, md_rows = [], []
    for g in groups:
        pols: dict = {}
        dyn: dict = {}
        for r in g.used:
            for name, p in (halting_policies(r) or {}).items():
                pols.setdefault(name, []).append(p)
            d = r.diag("halting")
            for name, v in ((d or {}).get("dynamic") or {}).items():
                if isinstance(v, dict):
                    dyn.setdefault(name, []).append(v)
        n = max([len(v) for v in pols.values()] + [0])
        for name in sorted(pols):
            ps = pols[name]
            policy, gran = ps[0].get("policy", name), ps[0].get("granularity", "")
            row = {**_ids(g), "policy": policy, "granularity": gran}
            cells = {}
            for part in ("calib", "test"):
                for key in ("mean_loops", "ppl", "ppl_full", "ppl_ratio"):
                    s = stats((p.get(part) or {}).get(key) for p in ps)
                    row.update({f"{part}_{key}_mean": s[0], f"{part}_{key}_std": s[1], f"{part}_{key}_n": s[2]})
                    cells[(part, key)] = s
            meets = [(p.get("test") or {}).get("meets_target") for p in ps]
            row["test_meets_target_frac"] = (sum(bool(m) for m in meets) / len(meets)) if meets else math.nan
            row["early_exit_frac"] = sum(bool(p.get("early_exit")) for p in ps) / len(ps)
            sp = stats(v.get("speedup") for v in dyn.get(policy, [])) if gran == "sequence" else (math.nan, math.nan, 0)
            dl = stats(v.get("mean_loops") for v in dyn.get(policy, [])) if gran == "sequence" else (math.nan, math.nan, 0)
            row.update({"dynamic_speedup_mean": sp[0], "dynamic_speedup_std": sp[1], "dynamic_speedup_n": sp[2],
                        "dynamic_mean_loops_mean": dl[0]})
            rows.append(row)
            md_rows.append([g.size.label, g.cond.label, f"{policy}/{gran}", f"{len(ps)}/{len(g.runs)}",
                            pm(*cells[("calib", "mean_loops")], n_row=len(ps)),
                            pm(*cells[("calib", "ppl_ratio")], n_row=len(ps)),
                            pm(*cells[("test", "mean_loops")], n_row=len(ps)),
                            pm(*cells[("test", "ppl")], n_row=len(ps)),
                            pm(*cells[("test", "ppl_ratio")], n_row=len(ps)),
                            f"{sum(bool(m) for m in meets)}/{len(meets)}",
                            pm(sp[0], sp[1], sp[2], kind="ratio", n_row=len(ps)) if gran == "sequence" else EMPTY])
        if not pols:
            md_rows.append([g.size.label, g.cond.label, EMPTY, f"0/{len(g.runs)}"] + [EMPTY] * 7)
    md = md_table(["Size", "Condition", "Policy/granularity", "n", "calib mean loops", "calib PPL ratio",
                   "test mean loops", "test PPL", "test PPL ratio", "test meets target", "real speed-up"], md_rows)
    md += _notes("\nPost-hoc exit policies with the threshold calibrated on the first half of the halting windows "
                 "(PPL ≤ (1+ε)·full-depth PPL with the fewest mean loops), reported on the second half. PPL ratio = "
                 "PPL / full-depth PPL. Real speed-up: wall-clock of dynamic-depth execution (sequence policy) vs "
                 "full depth on the test half.\n", _missing_note(groups, "halting"), _excluded_note(groups))
    return Table("halting", "Calibrated halting", pd.DataFrame(rows), md)


def runs_table(runs: list[Run], root: Optional[Path] = None) -> Table:
    from ..registry import DIAGNOSTICS
    rows, md_rows = [], []
    for r in runs:
        fe = final_exit(r) if r.completed else {"ppl": math.nan, "norm": math.nan, "source": "none"}
        diags = {d: r.diag_status(d) for d in DIAGNOSTICS}
        path = _rel(r.path, root)
        rows.append({"size": r.size.label, "condition": r.condition.label, "condition_id": r.condition.slug,
                     "seed": r.seed, "status": r.status, "note": r.note, "steps": r.summary.get("steps"),
                     "total_steps": r.summary.get("total_steps"), "tokens": r.summary.get("tokens"),
                     "wall_time_s": r.summary.get("wall_time_s"), "device": r.summary.get("device") or r.env.get("device"),
                     "ppl_K": fe["ppl"], "norm_K": fe["norm"], "ppl_source": fe["source"],
                     **{f"eval_{d}": s for d, s in diags.items()}, "path": path})
        missing = [d for d, s in diags.items() if s != "ok"]
        steps = r.summary.get("steps")
        tot = r.summary.get("total_steps")
        md_rows.append([r.size.label, r.condition.label, str(r.seed), r.note,
                        f"{steps}/{tot}" if steps is not None else EMPTY,
                        num(r.summary.get("wall_time_s")), num(fe["ppl"]), num(fe["norm"]),
                        "all" if not missing else ("none" if all(diags[d] == "missing" for d in diags) else
                                                   _diag_text(diags)), path])
    md = md_table(["Size", "Condition", "Seed", "Status", "Steps", "Wall time (s)", "PPL (exit K)", "‖H_K‖",
                   "Diagnostics", "Run directory"], md_rows)
    return Table("runs", "Every run", pd.DataFrame(rows), md)


def _diag_text(diags: dict) -> str:
    """'missing: a, b; malformed: c' for the diagnostics that are not ok."""
    by: dict = {}
    for d, st in diags.items():
        if st != "ok":
            by.setdefault(st, []).append(d)
    return "; ".join(f"{st}: {', '.join(ds)}" for st, ds in by.items())


def _rel(path: Path, root: Optional[Path]) -> str:
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
