"""`loopscale` command line: one call = one job of the pipeline.

One module per area (run, eval, report, bench, models, common: what several share); the commands
are listed in docs/usage.md ("The command line"). `python -m loopscale.cli` runs `main`.
"""
from __future__ import annotations

import argparse
import logging
import sys

from ..config import ConfigError
from ..io import watch_parent
from .common import check_common_args


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    parser = argparse.ArgumentParser(prog="loopscale", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"loopscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import bench, eval as evaluate, models, report, run
    for add in (run.add_commands, evaluate.add_commands, report.add_commands, bench.add_commands, models.add_export,
                models.add_generate, models.add_convert, run.add_train_stream, models.add_ouro):
        add(sub)  # in this order: the order `loopscale --help` lists them
    return parser


def main(argv: list[str] | None = None) -> int:
    if "--stop-with-parent" in (sys.argv[1:] if argv is None else argv):
        watch_parent()
    from ..data import DataError
    from ..io import CheckpointError, RunLocked
    from ..rundir import Preempted
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

