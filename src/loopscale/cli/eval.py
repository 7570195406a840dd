"""`loopscale eval <diagnostic>` and `loopscale eval all`: the diagnostics of one trained run
(loopscale.diagnostics), and `loopscale eval story` across runs (cli/report.py)."""
from __future__ import annotations

import json

from ..config import EvalConfig, load_eval_config
from ..registry import DIAGNOSTICS as REGISTRY


def _common(p) -> None:
    p.add_argument("--model", required=True, help="trained model file (RUN/model.pt)")
    p.add_argument("--data", required=True, help="the run's prepared data directory")
    p.add_argument("--eval-config", default=None, metavar="FILE",
                   help="evaluation settings (YAML mapping of eval keys, e.g. RUN/eval.yaml); default: the defaults")
    p.add_argument("--preset", default=None, help="start from this preset's evaluation settings (e.g. cpu, smoke)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="eval.KEY=VALUE",
                   help="override an eval setting, e.g. --set eval.max_tokens=65536 (repeatable)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default=None,
                   help="device (default: eval.device)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default); small models on busy CPUs run faster with 1")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def _summary_line(result: dict) -> str:
    return json.dumps({k: result.get(k) for k in ("diagnostic", "status", "tokens", "wall_time_s")})


def _setup(args) -> EvalConfig:
    """Set --threads (already bounded by check_common_args), then the evaluation settings:
    --preset <- --eval-config FILE <- --set eval.KEY=VALUE, validated before any model is loaded."""
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    return load_eval_config(args.eval_config, args.overrides, args.preset)


def cmd_eval(args) -> int:
    from ..diagnostics import run_diagnostic
    result = run_diagnostic(args.diagnostic, args.model, args.data, args.out, device=args.device,
                            progress=not args.quiet, eval_config=_setup(args))
    print(_summary_line(result))
    return 0


def cmd_eval_all(args) -> int:
    from ..diagnostics import DIAGNOSTICS, run_all
    eval_config = _setup(args)
    names = tuple(n.strip() for n in args.only.split(",")) if args.only else DIAGNOSTICS
    results = run_all(args.model, args.data, args.outdir, device=args.device, progress=not args.quiet,
                      names=names, eval_config=eval_config)
    for r in results.values():
        print(_summary_line(r))
    return 0


def add_commands(subparsers) -> None:
    from .report import add_story
    DIAGNOSTICS = tuple(REGISTRY)  # loopscale.diagnostics.DIAGNOSTICS, without importing torch
    p = subparsers.add_parser("eval", help="evaluate a trained run (depth, throughput, norms, radial, lemma, "
                                           "clamp, halting, scale, all; story: across runs)")
    sub = p.add_subparsers(dest="diagnostic", required=True, metavar="DIAGNOSTIC")
    for name in DIAGNOSTICS:
        q = sub.add_parser(name, help=REGISTRY[name].description)
        _common(q)
        q.add_argument("--out", required=True, help="result JSON file to write")
        q.set_defaults(func=cmd_eval)
    add_story(sub)  # cross-run: reads the runs' eval JSONs (report/endpoint_scale.py)
    q = sub.add_parser("all", help="every diagnostic (or those of --only), one JSON per diagnostic in --outdir")
    _common(q)
    q.add_argument("--outdir", required=True, help="directory for <diagnostic>.json files")
    q.add_argument("--only", metavar="D1,D2,...", help=f"these diagnostics only (default: all of {','.join(DIAGNOSTICS)})")
    q.set_defaults(func=cmd_eval_all)
