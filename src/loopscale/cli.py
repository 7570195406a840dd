"""`loopscale` command line: one call = one job of the pipeline.

  loopscale config        resolve a preset + config file + overrides into one config file
  loopscale prepare-data  fetch/read the corpus, fit the tokenizer, write uint16 splits
  loopscale data-stats    words, tokens, <unk> shares and training steps of prepared data
  loopscale train         train one run (resumes from its state.pt)
  loopscale params        print the parameter count of a config

Evaluation, diagnostics, reports and benchmarks register their own sub-commands through
`add_cli(subparsers)` in their modules (see `_COMMAND_MODULES`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

import yaml

from .config import ConfigError, RunConfig, resolve
from .io import watch_parent

# modules that contribute sub-commands via add_cli(subparsers); missing ones are skipped
_COMMAND_MODULES = ["loopscale.diagnostics", "loopscale.report", "loopscale.bench", "loopscale.artifacts",
                    "loopscale.generate", "loopscale.convert", "loopscale.train_stream", "loopscale.ouro_tools"]


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="run config (YAML/JSON); may name a `preset:`")
    from .config import MODEL_PRESETS
    p.add_argument("--preset", metavar="PRESET", help=f"start from this preset: {', '.join(MODEL_PRESETS)}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set model.readout=raw (repeatable)")


def add_run_dir_args(p: argparse.ArgumentParser, quiet_help: str) -> None:
    """The options of a command that trains into a run directory (`train`, `train-stream`)."""
    p.add_argument("--no-resume", action="store_true", help="ignore an existing state.pt")
    p.add_argument("--quiet", "-q", action="store_true", help=quiet_help)
    p.add_argument("--record-failure", action="store_true",
                   help="on a crash, write summary.json with status 'failed' and exit 0 (pipeline use)")
    p.add_argument("--drop-stale-state", action="store_true",
                   help="delete a state.pt written with other training settings instead of refusing it (pipeline use)")
    p.add_argument("--stop-with-parent", action="store_true",
                   help="stop as on SIGTERM (checkpoint, exit 143) when the parent process dies (pipeline use)")


def config_from_args(args) -> RunConfig:
    return resolve(args.config, args.preset, args.overrides)


def cmd_config(args) -> int:
    cfg = config_from_args(args)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if args.output:
        from .io import atomic_write_text
        atomic_write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def model_given(args) -> bool:
    """Whether the command line names a model: --preset, a model.* override, or a config
    file with a `model:` or `preset:` (a data-only config, as the pipeline's, names none)."""
    if args.preset or any(o.strip().startswith("model.") for o in args.overrides):
        return True
    if args.config:
        try:
            raw = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return False  # resolve() has already read it; a file that changed since names no model
        return isinstance(raw, dict) and ("model" in raw or "preset" in raw)
    return False


def cmd_prepare_data(args) -> int:
    from . import data as D
    cfg = config_from_args(args)
    tok = None
    if args.tokenizer:  # e.g. a converted model's RUN/tokenizer.json
        if not Path(args.tokenizer).is_file():
            raise FileNotFoundError(f"tokenizer file {args.tokenizer} not found")
        from tokenizers import Tokenizer
        raw = Path(args.tokenizer).read_bytes()  # unreadable: the file system's one line
        try:
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # not UTF-8, not JSON, not a tokenizers schema
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise D.DataError(f"tokenizer file {args.tokenizer} is not a tokenizers JSON file ({first})") from None
    # a model given (a preset, a config with a model or preset, --set model.*): every split
    # must hold one window of its model.seq_len+1 tokens, checked before the directory is touched
    seq_len = cfg.model.seq_len if model_given(args) else None
    meta = D.prepare_data(cfg.data, args.out, tokenizer=tok, seq_len=seq_len)
    print(json.dumps({k: meta.get(k) for k in ("vocab_size", "tokens")}))
    return 0


def cmd_data_stats(args) -> int:
    from . import data as D
    train = None
    if args.config or args.preset or args.overrides:  # a run's own step count beside the paper's
        cfg = config_from_args(args)
        t = cfg.train
        train = dict(seq_len=cfg.model.seq_len, stride=t.stride, batch_size=t.batch_size, epochs=t.epochs,
                     max_steps=t.max_steps)
    text = json.dumps(D.data_stats(args.data, train), indent=2, sort_keys=True) + "\n"
    if args.out:
        from .io import atomic_write_text
        atomic_write_text(args.out, text)
    sys.stdout.write(text)
    return 0


def train_or_record(cfg, args, fit):
    """Run `fit()` under the trainers' failure policy: a crash is recorded in
    OUT/summary.json as status "failed" with --record-failure (rank 0, exit 0); the user's
    errors, a preemption to resume and the machine's errors (disk full, file-size limit,
    read-only directory: the next attempt resumes) are never recorded. Returns the summary,
    or None where the failure was recorded."""
    from .data import DataError
    from .distributed import env_world
    from .io import CheckpointError, RunLocked
    from .rundir import Preempted, lost_peer, record_failure
    try:
        return fit()
    except (ConfigError, DataError, CheckpointError, RunLocked, Preempted, KeyboardInterrupt, OSError):
        raise
    except Exception as e:
        if not args.record_failure:
            raise
        rank, world = env_world()[:2]
        if rank != 0:  # under torchrun only rank 0 records a failure; another rank's
            raise      # crash fails the job (torchrun stops the others; a retry resumes)
        if lost_peer(e, world):  # ... also where rank 0 sees it first, as a broken collective
            raise
        summary = record_failure(cfg, args.out, e)
        print(f"loopscale: run failed and was recorded as failed in {args.out}/summary.json: "
              f"{summary['error']}", file=sys.stderr)
        return None


def cmd_train(args) -> int:
    from .distributed import env_world
    from .train import train
    cfg = config_from_args(args)
    if args.stop_with_parent:
        from .rundir import stop_with_parent
        stop_with_parent()
    summary = train_or_record(cfg, args, lambda: train(cfg, args.data, args.out, resume=not args.no_resume,
                                                       progress=not args.quiet,
                                                       drop_stale_state=args.drop_stale_state))
    if summary is not None and env_world()[0] == 0:
        print(json.dumps({k: summary[k] for k in ("status", "steps", "wall_time_s")}))
    return 0


def cmd_params(args) -> int:
    from .model import count_params
    cfg = config_from_args(args)
    print(f"{count_params(cfg.model):,}")
    return 0


def check_common_args(args) -> None:
    """The arguments several commands share, bounded once for all of them: --threads (torch
    segfaults on 100,000), --seed (torch and numpy take a non-negative int64), --device."""
    import re

    from .config import DEVICES, MAX_THREADS, SEED, THREADS
    threads = getattr(args, "threads", None)
    if threads is not None and threads not in THREADS:
        raise ConfigError(f"--threads must be in [0, {MAX_THREADS}] (0: torch's default), got {threads}")
    seed = getattr(args, "seed", None)
    if seed is not None and seed not in SEED:
        raise ConfigError(f"--seed must be an integer {SEED}, got {seed}")
    device = getattr(args, "device", None)
    if device is not None and not re.fullmatch(r"(auto|cpu|mps|cuda(:\d+)?)", str(device)):
        raise ConfigError(f"unknown --device {device!r}; choose {', '.join(DEVICES)} (or cuda:N)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(prog="loopscale", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"loopscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="resolve a config and print or write it")
    add_config_args(p)
    p.add_argument("--output", "-o", help="write the resolved config here (atomic)")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("prepare-data", help="tokenise the corpus into uint16 splits")
    add_config_args(p)
    p.add_argument("--out", required=True, help="data directory to write")
    p.add_argument("--tokenizer", help="encode with this tokenizers JSON instead of fitting one "
                                       "(e.g. RUN/tokenizer.json of a converted model)")
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("data-stats", help="words, tokens, <unk> shares and training steps of prepared data")
    p.add_argument("--data", required=True, help="prepared data directory (loopscale prepare-data)")
    add_config_args(p)
    p.add_argument("--out", help="also write the JSON here (atomic)")
    p.set_defaults(func=cmd_data_stats)

    p = sub.add_parser("train", help="train one run")
    add_config_args(p)
    p.add_argument("--data", required=True, help="prepared data directory")
    p.add_argument("--out", required=True, help="run directory")
    add_run_dir_args(p, quiet_help="no progress bar (progress is then logged every train.log_every steps)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("params", help="print the parameter count")
    add_config_args(p)
    p.set_defaults(func=cmd_params)

    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if "--stop-with-parent" in (sys.argv[1:] if argv is None else argv):
        watch_parent()
    from .data import DataError
    from .io import CheckpointError, RunLocked
    from .rundir import Preempted
    args = build_parser().parse_args(argv)
    # progress and notices of every command: one timestamped line each, on stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr)
    try:
        check_common_args(args)
        return args.func(args) or 0
    except (ConfigError, DataError, CheckpointError, RunLocked) as e:
        print(f"loopscale: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system's answer, one line: disk full, read-only, not a directory...
        where = f"{e.filename}: " if e.filename else ""
        print(f"loopscale: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"loopscale: {e}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("loopscale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
