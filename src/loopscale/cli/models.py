"""Commands on trained models: `loopscale export` (loopscale.artifacts), `loopscale generate`
(loopscale.generate) and `loopscale convert-paper` (loopscale.convert)."""
from __future__ import annotations

import sys


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
