"""REPORT.md: what was run, how it differs from the paper, the claims with verdicts, the
tables and the figures. Deterministic: the same runs give the same bytes (no clock).
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Optional


from ..config import MODEL_PRESETS, ConfigError, RunConfig, read_yaml
from ..io import atomic_write_text
from . import claims as C
from .endpoint_scale import json_safe, story_points, story_summary, story_table
from .groups import Table, group_runs, write_tables
from .figures import FIGURES, fig_story, no_data
from .markdown import md_table
from .records import records_of_runs
from .runs import Run, find_run_dirs, finite, load_runs
from .tables import build_tables


def load_params(path: Optional[str | os.PathLike], experiment: Optional[str]) -> dict:
    """The experiment's section of params.yaml ({} without a path or that experiment). A
    missing or unreadable file is a ConfigError: the report would silently lose its setup."""
    if not path:
        return {}
    d = read_yaml(path, "params file") or {}
    exps = d.get("experiments") if isinstance(d, dict) else None
    if isinstance(exps, dict) and experiment in exps and isinstance(exps[experiment], dict):
        return exps[experiment]
    if experiment:  # a report of an experiment its params file does not describe: refused
        known = ", ".join(sorted(map(str, exps))) if isinstance(exps, dict) else "none"
        raise ConfigError(f"params file {str(path)!r} has no experiment {experiment!r} (experiments: {known})")
    return {}


def _uniq(values) -> str:
    vals = [str(v) for v in values if v not in (None, "")]
    if not vals:
        return "—"
    c = Counter(vals)
    if len(c) == 1:
        return vals[0]
    return ", ".join(f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in sorted(c.items()))


def _duration(s: float) -> str:
    if not finite(s):
        return "—"
    h, rem = divmod(int(round(s)), 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min {sec:02d} s" if h else f"{m} min {sec:02d} s"


def _precision(r: Run) -> str:
    """Training precision as used (train.precision=auto is bf16 autocast on CUDA, fp32 elsewhere)."""
    p = r.cfg("train", "precision")
    dev = str(r.summary.get("device") or r.env.get("device") or "")
    if p == "auto":
        p = "bf16 autocast" if dev.startswith("cuda") else "fp32"
    elif p == "bf16":
        p = "bf16 autocast"
    gpu = r.env.get("gpu")
    return f"{p} on {dev or '?'}" + (f" ({gpu})" if gpu else "")


def _infer_preset(run: Run) -> Optional[str]:
    m = run.config.get("model") or {}
    return next((name for name, p in MODEL_PRESETS.items()
                 if p.get("model") and all(m.get(k) == v for k, v in p["model"].items())), None)


def what_was_run(runs: list[Run], experiment: str, params: dict) -> str:
    rows = [["Experiment", experiment or "—"]]
    if params.get("description"):
        rows.append(["Description", str(params["description"])])
    sizes = params.get("sizes") if isinstance(params.get("sizes"), dict) else {}
    presets = {str(k): (v or {}).get("preset") for k, v in sizes.items() if isinstance(v, dict)}
    inferred = sorted({p for p in (_infer_preset(r) for r in runs) if p})
    if presets:
        rows.append(["Sizes (params.yaml → preset)", ", ".join(f"{k} → {v}" for k, v in presets.items())])
    rows.append(["Model presets (matched from the run configs)", ", ".join(inferred) or "none matches exactly"])
    by_size: dict = {}
    for r in runs:
        by_size.setdefault(r.size, r)
    for size, r in by_size.items():
        m = r.config.get("model") or {}
        rows.append([f"Model {size.label}",
                     f"{size.params:,} parameters; d={m.get('d_model')}, {m.get('n_layers')} layers, "
                     f"{m.get('n_heads')} heads, SwiGLU {m.get('d_ff')}, seq {m.get('seq_len')}, K={m.get('n_loops')}, "
                     f"vocab {m.get('vocab_size')}, dropout {m.get('dropout')}, init {m.get('init')}"])
    groups = group_runs(runs)
    rows.append(["Conditions", f"{len({g.cond for g in groups})}: " + "; ".join(
        dict.fromkeys(g.cond.label for g in groups))])
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    rows.append(["Seeds", ", ".join(map(str, seeds)) + (f" (params.yaml: {params['seeds']})" if params.get("seeds")
                                                        else "")])
    st = Counter(r.status for r in runs)
    rows.append(["Runs", f"{len(runs)} ({', '.join(f'{n} {s}' for s, n in sorted(st.items()))})"])
    d = [r.config.get("data") or {} for r in runs]
    rows.append(["Data", _uniq(f"{x.get('source')} ({x.get('tokenizer')} tokenizer, vocab {x.get('vocab_size')})"
                               for x in d)])
    toks = [r.data.get("tokens") for r in runs if isinstance(r.data.get("tokens"), dict)]
    if toks:
        rows.append(["Corpus tokens", _uniq(", ".join(f"{k} {v:,}" for k, v in t.items() if isinstance(v, int))
                                           for t in toks)])
    t = [r.config.get("train") or {} for r in runs]
    rows.append(["Optimiser", _uniq(f"AdamW lr {x.get('lr')} constant, wd {x.get('weight_decay')}, clip "
                                    f"{x.get('grad_clip')}, batch {x.get('batch_size')}, stride {x.get('stride')}"
                                    for x in t)])
    rows.append(["Training length", _uniq(
        f"{r.summary.get('total_steps')} steps ({r.summary.get('tokens', 0) or 0:,} tokens)"
        if r.summary.get("total_steps") else
        (f"max_steps {r.cfg('train', 'max_steps')}" if r.cfg("train", "max_steps") else
         f"{r.cfg('train', 'epochs')} epochs") for r in runs)])
    rows.append(["Precision", _uniq(_precision(r) for r in runs)])
    rows.append(["Device", _uniq(r.summary.get("device") or r.env.get("device") for r in runs)])
    gpus = [r.env.get("gpu") for r in runs if r.env.get("gpu")]
    if gpus:
        rows.append(["GPU", _uniq(gpus)])
    rows.append(["Platform", _uniq(r.env.get("platform") for r in runs)])
    rows.append(["CPU threads", _uniq(r.env.get("cpu_threads") for r in runs)])
    train_s = math.fsum(r.summary["wall_time_s"] for r in runs if finite(r.summary.get("wall_time_s")))
    eval_s = math.fsum(e["wall_time_s"] for r in runs for e in r.evals.values()
                       if isinstance(e, dict) and finite(e.get("wall_time_s")))
    rows.append(["Total wall time", f"{_duration(train_s + eval_s)} (training {_duration(train_s)}, "
                                    f"diagnostics {_duration(eval_s)}; summed over runs)"])
    rows.append(["Versions", f"loopscale {_uniq(r.env.get('loopscale') for r in runs)}, torch "
                             f"{_uniq(r.env.get('torch') for r in runs)}, python {_uniq(r.env.get('python') for r in runs)}"])
    rows.append(["Git commit", _uniq(r.env.get("git_commit") for r in runs)])
    return md_table(["Item", "Value"], rows)


def differences(runs: list[Run]) -> str:
    """The paper's experimental setup vs ours, per setting, from the run configs."""
    default = RunConfig().to_dict()
    p44, p129 = MODEL_PRESETS["paper-44m"], MODEL_PRESETS["paper-129m"]

    def ours(f) -> str:
        return _uniq(f(r) for r in runs if r.config)

    def m(key):
        return lambda r: r.cfg("model", key)
    rows = [
        ["Parameters", "44M / 129M", ours(lambda r: f"{r.size.params:,}")],
        ["Width d", f"{p44['model']['d_model']} / {p129['model']['d_model']}", ours(m("d_model"))],
        ["Layers", f"{p44['model']['n_layers']} / {p129['model']['n_layers']}", ours(m("n_layers"))],
        ["Heads", f"{p44['model']['n_heads']} / {p129['model']['n_heads']}", ours(m("n_heads"))],
        ["SwiGLU hidden", f"{p44['model']['d_ff']} / {p129['model']['d_ff']}", ours(m("d_ff"))],
        ["Context (seq_len)", str(p44["model"]["seq_len"]), ours(m("seq_len"))],
        ["Loops K", str(p44["model"]["n_loops"]), ours(m("n_loops"))],
        ["Vocabulary", f"{p44['model']['vocab_size']:,} (word-level regex)",
         ours(lambda r: f"{r.cfg('data', 'vocab_size')} ({r.cfg('data', 'tokenizer')})")],
        ["Corpus", "WikiText-103 raw", ours(lambda r: r.cfg("data", "source"))],
        ["Batch size", f"{p44['train']['batch_size']} / {p129['train']['batch_size']}", ours(lambda r: r.cfg("train", "batch_size"))],
        ["Learning rate", f"{default['train']['lr']} constant", ours(lambda r: r.cfg("train", "lr"))],
        ["Training length", f"{default['train']['epochs']:g} epochs (stride {default['train']['stride']})",
         ours(lambda r: f"{r.summary.get('total_steps') or r.cfg('train', 'max_steps')} steps (stride "
                        f"{r.cfg('train', 'stride')})")],
        ["Dropout", str(default["model"]["dropout"]), ours(m("dropout"))],
        ["Precision", "bf16 autocast (fp32 weights) on an L40S", ours(_precision)],
        ["Seeds per condition", "3 (42, 101, 202)",
         _uniq(f"{len(g.runs)} ({', '.join(str(r.seed) for r in g.runs)})" for g in group_runs(runs))],
    ]
    body = md_table(["Setting", "Paper", "Ours"], rows)
    note = ("\nWhere ours differs, so may the outcome: a smaller model trained for fewer steps on a smaller corpus "
            "has less time to drift, and PPLs over another tokenizer or corpus are not comparable with the paper's in "
            "absolute terms. The claims are therefore judged by relative rules (ratios between conditions at the "
            "same size), stated with each verdict.\n")
    return body + note


def report_markdown(runs: list[Run], results_dir: Path, out_path: Path, experiment: str = "",
                    params: Optional[dict] = None, figures_dir: Optional[Path] = None) -> str:
    params = params or {}  # the experiment's section of params.yaml (load_params)
    claims_family, preregistered = claims_settings(params)
    results_dir = Path(results_dir)
    figures_dir = Path(figures_dir) if figures_dir else results_dir / "figures"
    base = Path(out_path).parent

    def rel(p: Path) -> str:
        return Path(os.path.relpath(Path(p).resolve(), base.resolve())).as_posix()

    groups = group_runs(runs)
    tables = build_tables(runs, root=Path.cwd())
    evidence = is_evidence(params)
    out = [f"# Reproduction report: {experiment or 'loopscale'}\n"]
    if not evidence:
        out.append(f"> **Pipeline check on a toy model; not evidence.** `{experiment or 'this experiment'}` has "
                   "`evidence: false` in params.yaml: it runs every stage of the pipeline on a model far too small "
                   "and too briefly trained to test the paper. Its numbers show that the pipeline works, not what "
                   "the paper claims, so this report judges no claim and extrapolates no drift law.\n")
    out += ["Reproduction of *Dense Supervision Is Not Enough: The Readout Blind Spot in Looped Language Models* "
            "(Sharma & Vu, arXiv 2606.24898). Generated by `loopscale report write` from the run directories; "
            "every number below is computed from them.\n"]
    if evidence:
        if claims_family == "dose":
            from . import dose
            results, dose_frame = dose.evaluate(records_of_runs(runs), preregistered)
        else:
            results = C.evaluate_groups(groups, C.specs_of(claims_family), preregistered)
        verdicts = Counter(r.outcome for r in results)
        out.append(f"**Verdicts:** {verdicts.get(C.REPRODUCED, 0)} reproduced, {verdicts.get(C.NOT_REPRODUCED, 0)} "
                   f"not reproduced, {verdicts.get(C.MIXED, 0)} mixed between seeds, {verdicts.get(C.NOT_RUN, 0)} "
                   f"not run at this scale (of {len(results)}; a verdict holds on the seed means and in every seed "
                   f"unless marked mixed).\n")
    out += ["## What was run\n", what_was_run(runs, experiment, params),
            "\n## What differs from the paper\n", differences(runs),
            "\n## Claims\n"]
    if not evidence:
        out.append("Not judged: a pipeline check (`evidence: false`) gives no verdicts; an experiment at a "
                   "scale meant as evidence (`cpu`, `paper`) judges each claim of the paper here.\n")
    elif claims_family == "dose":  # the dose-response study's own rules (report/dose.py), its table and figure
        p = figures_dir / "dose.png"
        out += ["The dose-response rules (D1–D4), evaluated on the seed means of the completed runs and on every "
                "seed alone (D3 pools every run). " + (
                    f"The rules were pre-registered ({preregistered}) before any run. " if preregistered else "") +
                "Each λ's condition is its own arm; λ is read from each run's resolved config.\n",
                dose.dose_markdown(results, dose_frame)]
        if p.is_file():
            out.append(f"**Dose-response** (`dose.png`)\n\n![Dose-response]({rel(p)})\n")
    else:
        out += [
            "Each claim of the paper (its headline results and Table 1) with the paper's number, ours, and a "
            "verdict computed by the rule in the last column, on the seed means of the completed runs and on every "
            "seed alone (conditions matched at the same model size and seed): \"reproduced (3/3 seeds)\" holds on "
            "the means and in every seed, \"mixed: 2/3 seeds\" holds in 2 of 3 seeds. The rules and thresholds are "
            "fixed in `src/loopscale/report/claims.py`. Evidence (rules the models could fail) and sanity checks "
            "(rules that hold by construction) are two tables. " + (
                f"The rules were pre-registered ({preregistered}). " if preregistered else
                "For this experiment, run before the rules' pre-registration, the \"As first registered\" column "
                "keeps each rule changed after results as first registered, its verdict and the reason. ") +
            "Each claim is also re-evaluated per seed under the researcher's choices the rule does not fix "
            "(clamp, ‖H_K‖ statistic, exits, metric; choices.csv), and over a grid of its threshold.\n",
            C.claims_markdown(results),
            "\n" + C.thresholds_text() + "\n"]
    out += _figures_and_tables(runs, tables, figures_dir, results_dir, rel, evidence)
    return "\n".join(out)


# what a pipeline check (evidence: false) leaves out: the drift law's extrapolation to the paper's step count
NOT_EVIDENCE_FIGURES = ("drift",)
NOT_EVIDENCE_TABLES = ("drift",)


def is_evidence(params: Optional[dict]) -> bool:
    """An experiment's report judges claims unless its params.yaml section says `evidence: false`."""
    return (params or {}).get("evidence", True) is not False


def has_data(t: Table) -> bool:
    """A table with at least one row (the aggregate tables have a row per condition and value)."""
    return t.df is not None and not t.df.empty


def _figures_and_tables(runs, tables, figures_dir, results_dir, rel, evidence: bool) -> list[str]:
    """The figures and the tables of the report; a figure none of whose panels has data and a
    table without rows are left out, named in one line each."""
    out = ["\n## Figures\n"]
    empty, skipped = [], []
    for name, (_, caption) in FIGURES.items():
        p = figures_dir / f"{name}.png"
        if not evidence and name in NOT_EVIDENCE_FIGURES:
            skipped.append(f"`{name}.png`")
            continue
        missing = no_data(p)
        if missing:
            empty.append(f"`{name}.png` ({missing})")
            continue
        out.append(f"**{caption}** (`{name}.png`)\n\n![{caption}]({rel(p)})\n")
    if empty:
        out.append(f"Left out, no data in this experiment: {', '.join(empty)}.\n")
    if skipped:
        out.append(f"Left out, not drawn for a pipeline check: {', '.join(skipped)} (the drift law extrapolated "
                   "to the paper's step count).\n")
    shown = [t for t in tables if has_data(t) and (evidence or t.name not in NOT_EVIDENCE_TABLES)]
    out.append("\n## Tables\n")
    out.append("CSV files (all numbers, std and n per cell) beside this report: " + ", ".join(
        f"[{t.name}.csv]({rel(results_dir / f'{t.name}.csv')})" for t in shown) +
        (f", [claims.csv]({rel(results_dir / 'claims.csv')})" if evidence else "") + ".\n")
    if any(t.name == "appendix_b" for t in shown):  # an Ouro experiment: `report tables` wrote appendix_b.md
        out.append(f"Appendix B's tables (the Ouro track) on their own: "
                   f"[appendix_b.md]({rel(results_dir / 'appendix_b.md')}), "
                   f"[appendix_b.csv]({rel(results_dir / 'appendix_b.csv')}).\n")
    for t in shown:
        if t.md:
            # a table's own sub-headings (Appendix B's: "## ..." under its file's "# title") nest under "### title"
            out.append(f"\n### {t.title}\n\n{_nested(t.md, 2)}")
    empty_t = [t.title for t in tables if t.md and not has_data(t)]
    if empty_t:
        out.append(f"\nLeft out, no data in this experiment: {'; '.join(empty_t)}.\n")
    if not evidence and any(t.name in NOT_EVIDENCE_TABLES and has_data(t) for t in tables):
        out.append("Left out for a pipeline check: the drift law's extrapolation (drift.csv).\n")
    return out


def claims_settings(exp_params: dict) -> tuple[str, str]:
    """(claims family, pre-registration) of an experiment's params.yaml entry: `claims:` is a family
    name (paper | factorial | dose) or {family: ..., preregistered: studies/<name>/preregistration.md}."""
    c = exp_params.get("claims") or "paper"
    if isinstance(c, str):
        return c, ""
    return str(c.get("family", "paper")), str(c.get("preregistered", "") or "")


def _nested(md: str, levels: int) -> str:
    """`md` with every heading `levels` deeper; lines in code fences are left alone."""
    out, fenced = [], False
    for line in md.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def claims_tables(runs: list[Run], family: str = "paper", preregistered: str = "") -> list[Table]:
    """claims.{csv,md} and choices.{csv,md} of the runs (report/claims.py); the dose family
    (report/dose.py) adds dose.{csv,md}."""
    tables = claims_tables_of_records(records_of_runs(runs), family, preregistered)
    bad = [f"{r.condition.label} seed {r.seed}: {'; '.join(r.problems)}" for r in runs if r.completed and r.problems]
    if bad:  # a claim they would have decided may read "not run at this scale": say why
        tables[0].md += ("\nResult files that could not be used (their values count nowhere; a verdict that needs them "
                         "may read \"not run at this scale\"): " + "; ".join(bad) + ".\n")
    return tables


def claims_tables_of_records(records, family: str = "paper", preregistered: str = "") -> list[Table]:
    """The claims tables of run records (from run directories or an experiment's committed per_seed.csv)."""
    if family == "dose":
        from . import dose
        results, dose_df = dose.evaluate(records, preregistered)
        extra = [Table("dose", "Dose-response: the norm penalty's λ", dose_df, dose.dose_markdown(results, dose_df))]
        thresholds = dose.thresholds_text()
    else:
        results = C.evaluate_records(records, C.specs_of(family), preregistered)
        extra, thresholds = [], C.thresholds_text()
    md = C.claims_markdown(results) + "\n" + thresholds + "\n"
    return [Table("claims", "Claims and verdicts", C.claims_frame(results), md),
            Table("choices", "Claims under the researcher's choices (per seed)", C.choices_frame(results),
                  C.choices_markdown(results))] + extra



def write_story(run_dirs: list[str], out: Path) -> list[Path]:
    """story.{csv,md}, story_summary.json and story_quadrant.{png,pdf} of the runs under `run_dirs`."""
    groups = group_runs(load_runs(find_run_dirs(run_dirs)))
    out = Path(out)
    written = write_tables([story_table(groups)], out)
    summary = json_safe(story_summary(story_points(groups)))
    written.append(atomic_write_text(out / "story_summary.json",
                                     json.dumps(summary, indent=2, sort_keys=True, allow_nan=False) + "\n"))
    written.append(fig_story(groups, out / "story_quadrant.png"))
    return written
