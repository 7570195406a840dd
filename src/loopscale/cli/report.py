"""`loopscale report ...` (tables, figures, REPORT.md, drift law, claims; the signatures are in
loopscale.report's docstring) and `loopscale eval story` (a cross-run diagnostic)."""
from __future__ import annotations

import sys
from pathlib import Path


def _runs(args):
    from ..report.runs import load_run_dirs
    return load_run_dirs(args.runs)


def cmd_tables(args) -> int:
    from ..report.groups import write_tables
    from ..report.metrics import write_metrics
    from ..report.tables import build_tables
    from ..report.document import claims_tables
    runs = _runs(args)
    tables = build_tables(runs, root=Path.cwd()) + claims_tables(runs, args.claims, args.preregistered)
    written = write_tables(tables, Path(args.out)) + [write_metrics(tables, Path(args.out) / "metrics.json")]
    print(f"loopscale report tables: {len(runs)} runs -> {len(written)} files in {args.out}")
    return 0


def cmd_figures(args) -> int:
    from ..report.figures import write_figures
    runs = _runs(args)
    written = write_figures(runs, Path(args.out))
    if args.claims == "dose":  # the dose-response figure (report/dose.py)
        from ..report import dose
        from ..report.records import records_of_runs
        written.append(dose.fig_dose(dose.run_rows(records_of_runs(runs)), Path(args.out) / "dose.png"))
    print(f"loopscale report figures: {len(runs)} runs -> {len(written)} figures (PNG + PDF) in {args.out}")
    return 0


def cmd_write(args) -> int:
    from ..io import atomic_write_text
    from ..report.document import load_params, report_markdown
    from ..config import ConfigError
    params = load_params(args.params, args.experiment)
    if not Path(args.results).is_dir():  # the tables the report links: without them it would link nothing
        raise ConfigError(f"results directory {args.results} not found: write the tables first "
                          f"(loopscale report tables --out {args.results})")
    runs = _runs(args)
    text = report_markdown(runs, Path(args.results), Path(args.out), experiment=args.experiment or "",
                           params=params, figures_dir=Path(args.figures) if args.figures else None)
    atomic_write_text(args.out, text)
    print(f"loopscale report write: {len(runs)} runs -> {args.out}")
    return 0


def cmd_drift_law(args) -> int:
    from ..report.drift_law import DriftLawError, report
    try:
        report(args.results, args.out, holdout=args.holdout, condition_id=args.condition, studies_dir=args.studies,
               results_root=args.results_root)
    except DriftLawError as e:
        print(f"loopscale report drift-law: {e}", file=sys.stderr)
        return 2
    print(f"loopscale report drift-law: {len(args.results)} experiment(s) -> {args.out}/drift_law.{{md,csv,png}}, "
          "drift_law_configs.csv, drift_law_coverage.csv")
    return 0


def cmd_drift_law_predict(args) -> int:
    from ..io import atomic_write_text
    from ..report.drift_law import (DriftLawError, fit_drift_law, fit_records, parse_setting, predict_settings,
                            predictions_yaml, read_logs, read_settings)
    try:
        if bool(args.setting) == bool(args.settings):
            raise DriftLawError("give --setting (with --step) or --settings FILE.yaml, not both or neither")
        if args.setting and args.step is None:
            raise DriftLawError("--setting needs --step")
        settings = read_settings(args.settings) if args.settings else \
            [dict(parse_setting(s, args.step), runs=float(args.runs)) for s in args.setting]
        for s in settings:
            s.setdefault("runs", float(args.runs))
            if args.experiment:
                s.setdefault("experiment", args.experiment)
            if args.size:
                s.setdefault("size", args.size)
        law = fit_drift_law(fit_records(read_logs(args.results), args.condition))
        table = predict_settings(law, settings)
    except DriftLawError as e:
        print(f"loopscale report drift-law-predict: {e}", file=sys.stderr)
        return 2
    for r in table.itertuples():
        what = f"not predicted: {r.reason}" if r.reason else \
            f"point {r.point:,.4g}, 95% interval {r.lo:,.4g} – {r.hi:,.4g}" + (f" ({r.note})" if r.note else "")
        print(f"step {r.step:,}, d {r.d_model:g}, {r.n_layers:g} layers, lr {r.lr:g}, seq {r.seq_len:g}, "
              f"batch {r.batch_size:g}, mean of {r.runs} run(s): {what}")
    text = predictions_yaml(table)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out, table.to_csv(index=False) if out.suffix == ".csv" else text)
        print(f"loopscale report drift-law-predict: {len(table)} prediction(s) -> {out}")
    else:
        print(text, end="")
    return 0


def cmd_claims(args) -> int:
    """claims/choices (+ dose) tables rebuilt from an experiment's committed per_seed.csv and train_norms.csv."""
    from ..report.groups import write_tables
    from ..report.records import RecordsError, records_from_results
    from ..report.document import claims_tables_of_records
    try:
        records = records_from_results(args.results)
    except RecordsError as e:
        print(f"loopscale report claims: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or args.results)
    tables = claims_tables_of_records(records, args.claims, args.preregistered)
    tables[0].md = ("Rebuilt by `loopscale report claims` from the committed per_seed.csv and train_norms.csv (the "
                    "run directories were not at hand: the median-‖H_K‖ choice, which needs eval/norms.json per run, "
                    "is absent).\n\n" + tables[0].md)
    written = write_tables(tables, out)
    if args.claims == "dose" and args.figures:
        from ..report import dose
        written.append(dose.fig_dose(tables[-1].df, Path(args.figures) / "dose.png"))
    print(f"loopscale report claims: {len(records)} runs ({args.results}/per_seed.csv) -> {len(written)} files in {out}")
    return 0


def cmd_claims_matrix(args) -> int:
    from ..report import claims_matrix
    command = " ".join(["loopscale report claims-matrix --results", *map(str, args.results), "--out", str(args.out)]
                       + (["--readme", args.readme] if args.readme else []))
    try:
        written = claims_matrix.write(args.results, args.out, readme=args.readme, command=command,
                                      splice_into=args.splice)
    except claims_matrix.MatrixError as e:
        print(f"loopscale report claims-matrix: {e}", file=sys.stderr)
        return 2
    print(f"loopscale report claims-matrix: {len(args.results)} experiment(s) -> {', '.join(map(str, written))}")
    return 0


def cmd_story(args) -> int:
    from ..report.document import write_story
    from ..report.runs import find_run_dirs
    written = write_story(args.runs, Path(args.out))
    print(f"loopscale eval story: {len(find_run_dirs(args.runs))} runs -> {len(written)} files in {args.out}")
    return 0


def _runs_arg(q) -> None:
    q.add_argument("--runs", nargs="+", required=True, metavar="RUN_DIR",
                   help="run directories (or directories searched recursively for runs)")


def add_story(sub) -> None:
    """`loopscale eval story` (under `loopscale eval`: a cross-run diagnostic computed from the
    runs' eval JSONs, report/endpoint_scale.py)."""
    q = sub.add_parser("story", help="loss placement x scale visibility over a grid's runs (2x2 table, quadrant "
                                     "figure, radial-vs-norm correlations)")
    _runs_arg(q)
    q.add_argument("--out", required=True, help="output directory (story.csv, story.md, story_summary.json, "
                                                "story_quadrant.png + .pdf)")
    q.set_defaults(func=cmd_story)


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("report", help="aggregate tables, figures and REPORT.md from run directories",
                              description="Aggregate run directories into tables (CSV + Markdown), figures (PNG) "
                                          "and REPORT.md.")
    sub = p.add_subparsers(dest="report_command", required=True,
                           metavar="{tables,figures,write,drift-law,drift-law-predict,claims,claims-matrix}")

    def claims_args(q):
        q.add_argument("--claims", default="paper", choices=("paper", "factorial", "dose"),
                       help="the claims family (params.yaml experiments.<name>.claims; default: paper)")
        q.add_argument("--preregistered", default="", metavar="PATH",
                       help="the pre-registration the rules were fixed in (studies/<name>/preregistration.md): "
                            "claims.md then shows no after-results amendments")

    q = sub.add_parser("tables", help="aggregate tables as CSV + Markdown (+ claims.csv/md)")
    _runs_arg(q)
    q.add_argument("--out", required=True, help="output directory, e.g. results/<exp>")
    claims_args(q)
    q.set_defaults(func=cmd_tables)

    q = sub.add_parser("figures", help="PNG figures")
    _runs_arg(q)
    q.add_argument("--claims", default="paper", choices=("paper", "factorial", "dose"),
                   help="the claims family; dose adds the dose-response figure dose.png")
    q.add_argument("--out", required=True, help="output directory, e.g. results/<exp>/figures")
    q.set_defaults(func=cmd_figures)

    q = sub.add_parser("write", help="the generated REPORT.md")
    _runs_arg(q)
    q.add_argument("--results", required=True, help="directory of the tables (linked from the report)")
    q.add_argument("--figures", default=None, help="directory of the figures (default: RESULTS/figures)")
    q.add_argument("--params", default=None, help="params.yaml (experiment description, presets, seeds)")
    q.add_argument("--experiment", default="", help="experiment name in params.yaml")
    q.add_argument("--out", required=True, help="report file, e.g. results/<exp>/REPORT.md")
    q.set_defaults(func=cmd_write)

    q = sub.add_parser("drift-law", help="one drift law across experiments (width, depth, lr), held against the paper")
    q.add_argument("--results", nargs="+", required=True, metavar="RESULTS_DIR",
                   help="results directories holding train_norms.csv (e.g. results/cpu results/cpu_confirm)")
    q.add_argument("--holdout", default=None, metavar="EXPERIMENT",
                   help="predict this experiment's final ‖H_K‖ from the others before fitting on it")
    q.add_argument("--condition", default="rmsnorm-per_loop-none-residual", help="condition id (default: the drifting model)")
    q.add_argument("--studies", default="studies", metavar="DIR",
                   help="where studies/*/preregistration.yaml hold drift_predictions to check (default: studies)")
    q.add_argument("--results-root", default="results", metavar="DIR",
                   help="where results/<experiment>/train_norms.csv measure them (default: results)")
    q.add_argument("--out", required=True, help="output directory, e.g. results/drift_law")
    q.set_defaults(func=cmd_drift_law)

    q = sub.add_parser("drift-law-predict", help="point and 95%% interval of the drift law for settings "
                                                 "(pre-registration)")
    q.add_argument("--results", nargs="+", required=True, metavar="RESULTS_DIR",
                   help="results directories holding train_norms.csv the law is fitted on")
    q.add_argument("--setting", action="append", default=[], metavar="d=64,layers=2,lr=1e-3,seq=64,batch=16",
                   help="one setting (repeatable); names: d, layers, lr, seq, batch")
    q.add_argument("--step", type=float, default=None, help="the training step to predict (with --setting)")
    q.add_argument("--settings", default=None, metavar="FILE.yaml",
                   help="a YAML list of settings, each with d, layers, lr, seq, batch, step (optional runs, "
                        "experiment, size)")
    q.add_argument("--runs", type=int, default=3, help="the interval is for the mean of this many runs (default 3)")
    q.add_argument("--experiment", default="", help="experiment name written into the drift_predictions entries")
    q.add_argument("--size", default="", help="size name written into the drift_predictions entries")
    q.add_argument("--condition", default="rmsnorm-per_loop-none-residual", help="condition id (default: the drifting model)")
    q.add_argument("--out", default=None, metavar="FILE",
                   help="write the drift_predictions YAML (or a CSV when FILE ends in .csv); default: print it")
    q.set_defaults(func=cmd_drift_law_predict)

    q = sub.add_parser("claims", help="claims/choices tables rebuilt from an experiment's committed per_seed.csv "
                                      "(+ train_norms.csv), without its run directories")
    q.add_argument("--results", required=True, metavar="RESULTS_DIR", help="e.g. results/cpu_long")
    q.add_argument("--out", default=None, help="output directory (default: RESULTS_DIR)")
    q.add_argument("--figures", default=None, help="with --claims dose: directory of dose.png (e.g. RESULTS_DIR/figures)")
    claims_args(q)
    q.set_defaults(func=cmd_claims)

    q = sub.add_parser("claims-matrix", help="every claim × experiment (and arm) from the experiments' claims.csv")
    q.add_argument("--results", nargs="+", required=True, metavar="RESULTS_DIR",
                   help="results directories holding claims.csv (e.g. results/cpu results/cpu_confirm)")
    q.add_argument("--out", required=True, help="output directory, e.g. results/claims_matrix")
    q.add_argument("--readme", default=None, metavar="COLUMNS",
                   help="also write claims_matrix_readme.md: only these columns (comma-separated, spaces ignored, "
                        "e.g. cpu,cpu_confirm:d64,cpu_long), the others summarised in one; evidence and sanity apart")
    q.add_argument("--splice", default=None, metavar="FILE",
                   help="with --readme: put the view between FILE's <!-- claims-matrix:begin/end --> markers "
                        "(e.g. README.md)")
    q.set_defaults(func=cmd_claims_matrix)

