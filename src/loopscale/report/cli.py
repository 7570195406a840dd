"""`loopscale report {tables,figures,write}` (see the package docstring for the signatures)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_RUN_FILES = ("config.json", "config.yaml", "summary.json", "metrics.jsonl")


def find_run_dirs(paths: list[str]) -> list[Path]:
    """Run directories among `paths`: a path holding a run file is a run; any other
    directory is searched recursively for runs (so `--runs runs/cpu` works). Sorted, unique."""
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"run directory {p} does not exist")
        if any((p / f).exists() for f in _RUN_FILES):
            found.add(p)
            continue
        for f in sorted(p.rglob("*")):
            if f.name in _RUN_FILES and f.is_file() and "eval" not in f.parent.name:
                found.add(f.parent)
    if not found:
        raise FileNotFoundError(f"no run directories (holding {' or '.join(_RUN_FILES)}) under {' '.join(paths)}")
    return sorted(found)


def _runs(args):
    from .runs import check_runs, load_runs
    runs = load_runs(find_run_dirs(args.runs))
    check_runs(runs)  # never average copies of one run, or runs of two experiments
    return runs


def cmd_tables(args) -> int:
    from .aggregate import write_tables
    from .metrics import write_metrics
    from .tables import build_tables
    from .write import claims_table
    runs = _runs(args)
    tables = build_tables(runs, root=Path.cwd()) + [claims_table(runs)]
    written = write_tables(tables, Path(args.out)) + [write_metrics(tables, Path(args.out) / "metrics.json")]
    print(f"loopscale report tables: {len(runs)} runs -> {len(written)} files in {args.out}")
    return 0


def cmd_figures(args) -> int:
    from .figures import write_figures
    runs = _runs(args)
    written = write_figures(runs, Path(args.out))
    print(f"loopscale report figures: {len(runs)} runs -> {len(written)} figures (PNG + PDF) in {args.out}")
    return 0


def cmd_write(args) -> int:
    from ..io import atomic_write_text
    from .write import load_params, report_markdown
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


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("report", help="aggregate tables, figures and REPORT.md from run directories",
                              description="Aggregate run directories into tables (CSV + Markdown), figures (PNG) "
                                          "and REPORT.md.")
    sub = p.add_subparsers(dest="report_command", required=True, metavar="{tables,figures,write}")

    def runs_arg(q):
        q.add_argument("--runs", nargs="+", required=True, metavar="RUN_DIR",
                       help="run directories (or directories searched recursively for runs)")

    q = sub.add_parser("tables", help="aggregate tables as CSV + Markdown (+ claims.csv/md)")
    runs_arg(q)
    q.add_argument("--out", required=True, help="output directory, e.g. results/<exp>")
    q.set_defaults(func=cmd_tables)

    q = sub.add_parser("figures", help="PNG figures")
    runs_arg(q)
    q.add_argument("--out", required=True, help="output directory, e.g. results/<exp>/figures")
    q.set_defaults(func=cmd_figures)

    q = sub.add_parser("write", help="the generated REPORT.md")
    runs_arg(q)
    q.add_argument("--results", required=True, help="directory of the tables (linked from the report)")
    q.add_argument("--figures", default=None, help="directory of the figures (default: RESULTS/figures)")
    q.add_argument("--params", default=None, help="params.yaml (experiment description, presets, seeds)")
    q.add_argument("--experiment", default="", help="experiment name in params.yaml")
    q.add_argument("--out", required=True, help="report file, e.g. results/<exp>/REPORT.md")
    q.set_defaults(func=cmd_write)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="loopscale")
    add_cli(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args()
    sys.exit(a.func(a))
