"""Commands on trained models: `loopscale export` (loopscale.artifacts), `loopscale generate`
(loopscale.generate), `loopscale convert-paper` (loopscale.convert) and the Ouro track's
`ouro-downstream`, `ouro-import`, `ouro-depth`, `ouro-scale` (loopscale.ouro_tools)."""
from __future__ import annotations

import json
import sys

from ..config import ConfigError


def cmd_export(args) -> int:
    from ..artifacts import export_run
    files = export_run(args.run, args.data)
    print(f"wrote {', '.join(files)} in {args.run}")
    return 0


def cmd_generate(args) -> int:
    from ..generate import generate_from_run
    text, note = generate_from_run(args.run, args.prompt, args.max_new_tokens, loops=args.loops,
                                   temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                   halt_policy=args.halt, threshold=args.threshold, device=args.device,
                                   threads=args.threads)
    print(text)
    print(note, file=sys.stderr)
    return 0


def cmd_convert_paper(args) -> int:
    from ..convert import convert_paper
    rec = convert_paper(args.checkpoint, args.out, args.tokenizer, args.overrides, args.trust_pickle, args.force)
    m, o = rec["settings"]["model"], rec["settings"]["objective"]
    print(f"converted {args.checkpoint} -> {args.out} (readout {m['readout']}, recurrence {m['recurrence']}, "
          f"loss {o['loss']}, regularizer {o.get('regularizer', 'none')}; dropped: {', '.join(rec['dropped']) or 'nothing'})")
    return 0


def add_export(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a trained run's model.safetensors, Hugging Face config "
                                             "and tokenizer files")
    p.add_argument("run", help="run directory (with model.pt)")
    p.add_argument("--data", help="the run's data directory (for tokenizer.json); default: the run's own copy")
    p.set_defaults(func=cmd_export)


def add_generate(subparsers) -> None:
    from ..exits import POLICIES
    p = subparsers.add_parser("generate", help="sample text from a trained run (any depth, KV cache, halting)")
    p.add_argument("--run", required=True, help="run directory (model.safetensors or model.pt, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--loops", type=int, default=None, help="loops per token (default: K of training; any k >= 1)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--halt", choices=POLICIES, default=None,
                   help="per-token halting with this policy's calibrated threshold (RUN/eval/halting.json)")
    p.add_argument("--threshold", type=float, default=None, help="override the calibrated halting threshold")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.set_defaults(func=cmd_generate)


def add_convert(subparsers) -> None:
    p = subparsers.add_parser("convert-paper", help="convert a checkpoint of the paper's official training script "
                                                   "(last.pt) into a loopscale run directory")
    p.add_argument("checkpoint", help="the official trainer's last.pt (keys model_state, config, tokenizer)")
    p.add_argument("--out", required=True, help="run directory to write (refused if it holds a run, unless --force)")
    p.add_argument("--force", action="store_true", help="replace the run in --out (every file of it)")
    p.add_argument("--tokenizer", help="tokenizers JSON file (default: the checkpoint's own tokenizer)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="model.KEY=VALUE",
                   help="override a converted model setting, e.g. --set model.dropout=0 (repeatable)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="load a checkpoint holding Python objects (unsafe: only for files you trust)")
    p.set_defaults(func=cmd_convert_paper)


def _check_ouro_eval_args(args, what: str) -> None:
    """ouro-depth / ouro-scale arguments against config.LIMITS, before a model is read."""
    from ..config import LIMITS, NON_NEGATIVE, Range, bounded, check_arg
    check_arg("--batch-size", args.batch_size, bounded("batch_size"))
    check_arg("--windows", args.windows, NON_NEGATIVE)
    check_arg("--seq-len", args.seq_len, Range(0, LIMITS["seq_len"]))
    if what == "depth":
        check_arg("--max-k", args.max_k, bounded("eval_loops"))
    else:
        for c in args.scales:
            check_arg("--scales", c, Range(), integer=False)


def cmd_ouro_eval(args, what: str) -> int:
    from ..ouro_tools import ouro_evaluation
    _check_ouro_eval_args(args, what)
    result = ouro_evaluation(args.model, args.data, what, seq_len=args.seq_len, windows=args.windows,
                             split=args.split, batch_size=args.batch_size, device=args.device,
                             max_k=getattr(args, "max_k", 8), scales=getattr(args, "scales", ()), out=args.out)
    print(json.dumps(result))
    return 0


def cmd_downstream(args) -> int:
    from ..ouro_tools import downstream_of_run
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ConfigError("--tasks: give one or more lm-eval task names, comma-separated")
    try:
        loops = [int(k) for k in args.loops.split(",") if k] if args.loops else None
    except ValueError:
        raise ConfigError(f"--loops must be comma-separated integers, got {args.loops!r}") from None
    if loops and min(loops) < 1:
        raise ConfigError(f"--loops must be >= 1, got {args.loops!r}")
    if args.limit < 0:
        raise ConfigError(f"--limit must be >= 0, got {args.limit}")
    result = downstream_of_run(args.run, tasks, loops, args.limit, args.include_path, args.per_token_norm,
                               args.batch_size, args.device, out=args.out)
    print(json.dumps(result))
    return 0


def cmd_ouro_import(args) -> int:
    from ..ouro_tools import import_hf
    out = import_hf(args.checkpoint, args.out, seq_len=args.seq_len, force=args.force)
    print(f"wrote the run directory {out} (loopscale eval ... --model {out / 'model.pt'})")
    return 0


def add_ouro(subparsers) -> None:
    p = subparsers.add_parser("ouro-downstream", help="multiple-choice accuracy (acc, acc_norm) of a run through "
                                                      "lm-evaluation-harness (Appendix B's downstream table)")
    p.add_argument("--run", required=True, help="a run directory (or an imported Hugging Face Ouro checkpoint)")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (piqa,arc_easy,...)")
    p.add_argument("--loops", default="", help="depths to score at, comma-separated (default: the run's K)")
    p.add_argument("--limit", type=int, default=0, help="documents per task (0: all)")
    p.add_argument("--include-path", help="a folder of local lm-eval task YAML files")
    p.add_argument("--per-token-norm", action="store_true",
                   help="also acc_norm_token (log-likelihood per continuation token, the official evaluator)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="write the result JSON here")
    p.set_defaults(func=cmd_downstream)
    p = subparsers.add_parser("ouro-import", help="a Hugging Face Ouro checkpoint (ByteDance/Ouro-1.4B, ...) as a "
                                                   "loopscale run directory")
    p.add_argument("checkpoint", help="the downloaded checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--out", required=True, help="the run directory to write")
    p.add_argument("--seq-len", type=int, default=2048, help="evaluation window length (default 2048)")
    p.add_argument("--force", action="store_true", help="replace the run in --out (the new run is written beside "
                                                        "it and swapped in whole)")
    p.set_defaults(func=cmd_ouro_import)
    for name, what, help_ in (("ouro-depth", "depth", "CE/PPL at depth K = 1..max-k, the final readout on step K "
                                                      "(Appendix B's variable-depth table)"),
                              ("ouro-scale", "scale", "CE when the pre-readout state is scaled by c "
                                                      "(Appendix B's scale-sensitivity sweep)")):
        p = subparsers.add_parser(name, help=help_)
        p.add_argument("--model", required=True, help="a Hugging Face Ouro directory, a run directory or model.pt")
        p.add_argument("--data", required=True, help="a prepared data directory tokenised with the model's tokenizer")
        p.add_argument("--seq-len", type=int, default=0, help="window length (default: the model's seq_len)")
        p.add_argument("--windows", type=int, default=16, help="evaluation windows (0: all)")
        p.add_argument("--split", default="validation", choices=("validation", "test"),
                       help="the split of the data directory (default validation)")
        p.add_argument("--batch-size", type=int, default=2)
        p.add_argument("--device", default="auto")
        p.add_argument("--out", help="write the result JSON here")
        if what == "depth":
            p.add_argument("--max-k", type=int, default=8)
        else:
            p.add_argument("--scales", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
        p.set_defaults(func=lambda a, w=what: cmd_ouro_eval(a, w))
