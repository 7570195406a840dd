"""Command-line tools of the Ouro track: import a published checkpoint as a run directory,
and Appendix B's variable-depth and scale-sensitivity evaluations on any Ouro model.

  loopscale ouro-import DIR --out RUN     a Hugging Face Ouro checkpoint as a loopscale run
  loopscale ouro-depth  --model M --data DATA [--max-k 8]        PPL at K = 1..max-k
  loopscale ouro-scale  --model M --data DATA [--scales ...]     CE of r(c·H_K)

M: a Hugging Face Ouro directory, a run directory or a model.pt (see docs/ouro.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .ouro import from_pretrained, is_hf_checkpoint, scale_sensitivity, variable_depth


# ---------------------------------------------------------------------------
# command line: loopscale ouro-depth / ouro-scale
# ---------------------------------------------------------------------------
def open_model(path: str | Path, device: str = "cpu"):
    """(model, RunConfig) of a Hugging Face Ouro directory, a loopscale run directory or a
    model.pt/state.pt file."""
    p = Path(path)
    if p.is_dir() and is_hf_checkpoint(p):
        return from_pretrained(p, device=device)
    if p.is_dir():
        if (p / "model.pt").is_file() and not (p / "model.safetensors").is_file():
            p = p / "model.pt"
        else:
            from .artifacts import load
            model, _, cfg = load(p, device=device)
            return model, cfg
    from .evaluate import load_model
    model, cfg, _ = load_model(p, device=device)
    return model, cfg


def import_hf(path: str | Path, out_dir: str | Path, seq_len: int = 2048) -> Path:
    """A Hugging Face Ouro checkpoint as a loopscale run directory (model.pt, model.safetensors,
    config.json, summary.json and its tokenizer files), so every `loopscale eval` diagnostic,
    `loopscale generate` and the lm-eval model type read it like a trained run."""
    import shutil

    from .artifacts import save_weights
    from .io import atomic_torch_save, atomic_write_json, run_environment, weights_sha256
    model, cfg = from_pretrained(path, seq_len=seq_len)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    source = {"imported_from": str(Path(path).resolve()), "format": "huggingface ouro"}
    atomic_torch_save(out / "model.pt", {"config": cfg.to_dict(), "model": state, "weights_sha256": weights_sha256(state),
                                         "step": 0, "status": "completed", "source": source})
    save_weights(out / "model.safetensors", model)
    atomic_write_json(out / "config.json", {"config": cfg.to_dict(), "env": run_environment("cpu"), "source": source})
    atomic_write_json(out / "summary.json", {"status": "completed", "steps": 0, "params": model.num_params(), **source})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(path) / f).is_file():
            shutil.copyfile(Path(path) / f, out / f)
    return out


def eval_windows(data_dir: str | Path, seq_len: int, max_windows: int, split: str = "validation") -> torch.Tensor:
    """Windows of seq_len+1 tokens every seq_len tokens of a prepared data directory's split."""
    from . import data as D
    tokens = D.load_split(data_dir, split)
    starts = list(range(0, len(tokens) - seq_len - 1 + 1, seq_len))[:max_windows or None]
    if not starts:
        raise D.DataError(f"{data_dir} split {split}: {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    return torch.stack([torch.from_numpy(tokens[s:s + seq_len + 1].astype("int64")) for s in starts])


def _cmd(args, what: str) -> int:
    from .io import atomic_write_json
    from .runtime import resolve_device
    device = resolve_device(args.device)
    model, cfg = open_model(args.model, device=str(device))
    seq = args.seq_len or cfg.model.seq_len
    windows = eval_windows(args.data, seq, args.windows)
    if what == "depth":
        rows = variable_depth(model, windows, range(1, args.max_k + 1), args.batch_size)
    else:
        rows = scale_sensitivity(model, windows, args.scales, args.batch_size)
    result = {"evaluation": f"ouro-{what}", "model": str(args.model), "data": str(args.data),
              "readout": cfg.model.readout, "k_train": cfg.model.n_loops, "seq_len": seq,
              "tokens": int(windows[:, 1:].numel()), "rows": rows}
    if args.out:
        atomic_write_json(args.out, result)
    print(json.dumps(result))
    return 0


def cmd_import(args) -> int:
    out = import_hf(args.checkpoint, args.out, seq_len=args.seq_len)
    print(f"wrote the run directory {out} (loopscale eval ... --model {out / 'model.pt'})")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("ouro-import", help="a Hugging Face Ouro checkpoint (ByteDance/Ouro-1.4B, ...) as a "
                                                   "loopscale run directory")
    p.add_argument("checkpoint", help="the downloaded checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--out", required=True, help="the run directory to write")
    p.add_argument("--seq-len", type=int, default=2048, help="evaluation window length (default 2048)")
    p.set_defaults(func=cmd_import)
    for name, what, help_ in (("ouro-depth", "depth", "CE/PPL at depth K = 1..max-k, the final readout on step K "
                                                      "(Appendix B's variable-depth table)"),
                              ("ouro-scale", "scale", "CE when the pre-readout state is scaled by c "
                                                      "(Appendix B's scale-sensitivity sweep)")):
        p = subparsers.add_parser(name, help=help_)
        p.add_argument("--model", required=True, help="a Hugging Face Ouro directory, a run directory or model.pt")
        p.add_argument("--data", required=True, help="a prepared data directory tokenised with the model's tokenizer")
        p.add_argument("--seq-len", type=int, default=0, help="window length (default: the model's seq_len)")
        p.add_argument("--windows", type=int, default=16, help="validation windows (0: all)")
        p.add_argument("--batch-size", type=int, default=2)
        p.add_argument("--device", default="auto")
        p.add_argument("--out", help="write the result JSON here")
        if what == "depth":
            p.add_argument("--max-k", type=int, default=8)
        else:
            p.add_argument("--scales", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
        p.set_defaults(func=lambda a, w=what: _cmd(a, w))
