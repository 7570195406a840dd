"""What several commands share: the config options, the options of a command that trains into
a run directory, the bounds of --threads/--seed/--device, and the trainers' failure policy."""
from __future__ import annotations

import argparse
import sys

from ..config import ConfigError, RunConfig, resolve


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="run config (YAML/JSON); may name a `preset:`")
    from ..config import MODEL_PRESETS
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


def check_common_args(args) -> None:
    """The arguments several commands share, bounded once for all of them: --threads (torch
    segfaults on 100,000), --seed (torch and numpy take a non-negative int64), --device."""
    import re

    from ..config import DEVICES, MAX_THREADS, SEED, THREADS
    threads = getattr(args, "threads", None)
    if threads is not None and threads not in THREADS:
        raise ConfigError(f"--threads must be in [0, {MAX_THREADS}] (0: torch's default), got {threads}")
    seed = getattr(args, "seed", None)
    if seed is not None and seed not in SEED:
        raise ConfigError(f"--seed must be an integer {SEED}, got {seed}")
    device = getattr(args, "device", None)
    if device is not None and not re.fullmatch(r"(auto|cpu|mps|cuda(:\d+)?)", str(device)):
        raise ConfigError(f"unknown --device {device!r}; choose {', '.join(DEVICES)} (or cuda:N)")


def train_or_record(cfg, args, fit):
    """Run `fit()` under the trainers' failure policy: a crash is recorded in
    OUT/summary.json as status "failed" with --record-failure (rank 0, exit 0); the user's
    errors, a preemption to resume and the machine's errors (disk full, file-size limit,
    read-only directory: the next attempt resumes) are never recorded. Returns the summary,
    or None where the failure was recorded."""
    from ..data import DataError
    from ..distributed import env_world
    from ..io import CheckpointError, RunLocked
    from ..rundir import Preempted, lost_peer, record_failure
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
