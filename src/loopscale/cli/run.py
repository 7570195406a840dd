"""The commands of one run's life before evaluation: `loopscale config`, `prepare-data`,
`data-stats`, `train`, `params` and `train-stream` (loopscale.config, loopscale.data,
loopscale.train, loopscale.model, loopscale.train_stream)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from .common import add_config_args, add_run_dir_args, config_from_args, train_or_record


def cmd_config(args) -> int:
    cfg = config_from_args(args)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if args.output:
        from ..io import atomic_write_text
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
    from .. import data as D
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
    from .. import data as D
    train = None
    if args.config or args.preset or args.overrides:  # a run's own step count beside the paper's
        cfg = config_from_args(args)
        t = cfg.train
        train = dict(seq_len=cfg.model.seq_len, stride=t.stride, batch_size=t.batch_size, epochs=t.epochs,
                     max_steps=t.max_steps)
    text = json.dumps(D.data_stats(args.data, train), indent=2, sort_keys=True) + "\n"
    if args.out:
        from ..io import atomic_write_text
        atomic_write_text(args.out, text)
    sys.stdout.write(text)
    return 0


def cmd_train(args) -> int:
    from ..train import train
    cfg = config_from_args(args)
    return _fit(cfg, args, lambda: train(cfg, args.data, args.out, resume=not args.no_resume,
                                         progress=not args.quiet, drop_stale_state=args.drop_stale_state),
                ("status", "steps", "wall_time_s"))


def _fit(cfg, args, fit, keys) -> int:
    """Train under the failure policy (--stop-with-parent first); rank 0 prints the summary's `keys`."""
    from ..distributed import env_world
    if args.stop_with_parent:
        from ..rundir import stop_with_parent
        stop_with_parent()
    summary = train_or_record(cfg, args, fit)
    if summary is not None and env_world()[0] == 0:
        print(json.dumps({k: summary[k] for k in keys}))
    return 0


def cmd_params(args) -> int:
    from ..model import count_params
    cfg = config_from_args(args)
    print(f"{count_params(cfg.model):,}")
    return 0


def add_commands(sub) -> None:
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


def cmd_train_stream(args) -> int:
    from ..config import parse_overrides, resolve
    from ..train_stream import stream_settings, train_stream
    run_sets = [o for o in args.overrides if not o.startswith("stream.")]
    stream_sets = parse_overrides([o for o in args.overrides if o.startswith("stream.")]).get("stream", {})
    cfg = resolve(args.config, args.preset, run_sets)
    s = stream_settings(args.stream_config, stream_sets)
    return _fit(cfg, args, lambda: train_stream(cfg, s, args.out, val_data=args.val_data, resume=not args.no_resume,
                                                progress=not args.quiet, drop_stale_state=args.drop_stale_state),
                ("status", "steps", "tokens"))


def add_train_stream(subparsers) -> None:
    p = subparsers.add_parser("train-stream", help="train one run on a streamed corpus (FineWeb, Appendix B)")
    p.add_argument("--config", "-c", help="run config (YAML/JSON); may name a `preset:`")
    p.add_argument("--preset", help="start from this preset (e.g. ouro-1.4b)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run setting (train.lr=...) or a stream setting (stream.tokenizer=DIR)")
    p.add_argument("--stream-config", help="a YAML file of stream settings (below --set stream.*)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--val-data", "--data", dest="val_data",
                   help="a prepared data directory (same tokenizer) for validation")
    add_run_dir_args(p, quiet_help="no progress bar (progress is then logged every train.log_every steps)")
    p.set_defaults(func=cmd_train_stream)
