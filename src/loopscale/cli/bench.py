"""`loopscale bench`: training/evaluation throughput, FLOP/s, MFU and step memory of a config
(loopscale.bench), or with --generate the generation speed of a trained run
(loopscale.generate.bench_generation_of_run)."""
from __future__ import annotations

import argparse
import json
import sys

from ..config import ConfigError
from .common import add_config_args, config_from_args


def bench_generation(args) -> int:
    from ..generate import bench_generation_of_run
    from ..io import atomic_write_json
    device = args.device or "cpu"
    r = bench_generation_of_run(args.generate, args.new_tokens, device, args.threads)
    print(f"generation  {r['new_tokens']} new tokens after a {r['prompt_tokens']}-token prompt, greedy, "
          f"KV cache, batch 1, {device}, {r['threads']} threads")
    for row in r["rows"]:
        tau = f" (τ={row['threshold']:.3g})" if row["threshold"] is not None else ""
        print(f"  {row['name'] + tau:28s} {row['tok_per_s']:8.1f} tok/s   mean loops/token {row['mean_loops']:.2f}")
    if args.out:
        atomic_write_json(args.out, r)
        print(f"wrote {args.out}")
    return 0


def cmd_bench(args) -> int:
    from ..bench import bench_config, run_bench, summary
    from ..config import BENCH_PRESETS, parse_overrides
    from ..io import atomic_write_json
    if args.generate:  # generation speed of a trained run (generate.py)
        return bench_generation(args)
    for flag, v, lo in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                        ("--eval-batches", args.eval_batches, 1), ("--eval-warmup", args.eval_warmup, 0)):
        if v < lo:
            raise ConfigError(f"{flag} must be >= {lo}, got {v}")
    if args.preset in BENCH_PRESETS and not args.config:
        cfg = bench_config(args.preset, parse_overrides(args.overrides) if args.overrides else None)
    else:
        cfg = config_from_args(args)
    r = run_bench(cfg, steps=args.steps, warmup=args.warmup, compile=args.compile, eval_batches=args.eval_batches,
                  eval_warmup=args.eval_warmup, memory=not args.no_memory, do_eval=not args.no_eval,
                  profile=args.profile, threads=args.threads, device=args.device, checkpoint=args.checkpoint,
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    r["command"] = "loopscale " + " ".join(sys.argv[1:]) if sys.argv and "loopscale" in sys.argv[0] else None
    print(summary(r))
    if args.out:
        atomic_write_json(args.out, r)
        print(f"wrote {args.out}")
    else:
        print(json.dumps(r, indent=1))
    return 0


def add_commands(subparsers) -> None:
    from .. import bench
    p = subparsers.add_parser("bench", help="training/eval throughput, FLOP/s, MFU and step memory",
                              description=bench.__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--steps", type=int, default=5, help="timed training steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    p.add_argument("--eval-batches", type=int, default=5, help="timed evaluation batches per depth")
    p.add_argument("--eval-warmup", type=int, default=1, help="untimed evaluation batches per depth")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing of every block call (LoopedLM.checkpoint_blocks): memory "
                        "for one more stack forward, which the model FLOP count does not credit")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: train.threads or torch's)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda (default: train.device)")
    p.add_argument("--no-memory", action="store_true", help="skip the subprocess memory measurement")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation throughput")
    p.add_argument("--profile", action="store_true", help="torch.profiler top ops of one training step")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--generate", metavar="RUN", help="instead: generation tok/s of a trained run at k = 1..K "
                                                     "and with its calibrated halting (KV cache, batch 1)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per depth with --generate")
    p.set_defaults(func=cmd_bench)
