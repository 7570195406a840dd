"""The Ouro track's tools: import a published checkpoint as a run directory, and Appendix B's variable-depth and scale-sensitivity evaluations on any Ouro model.

  loopscale ouro-import DIR --out RUN     a Hugging Face Ouro checkpoint as a loopscale run
  loopscale ouro-depth  --model M --data DATA [--max-k 8]        PPL at K = 1..max-k
  loopscale ouro-scale  --model M --data DATA [--scales ...]     CE of r(c·H_K)
  loopscale ouro-downstream --run RUN --tasks piqa,arc_easy,... [--loops 1,2,4,8] --out FILE
                                          multiple choice through lm-eval (acc, acc_norm)

M: a Hugging Face Ouro directory, a run directory or a model.pt (see docs/ouro.md). The
commands' argument handling is loopscale.cli.models.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from .artifacts import load
from .config import ConfigError, RunConfig

from .ouro import is_hf_checkpoint, scale_sensitivity, variable_depth


# ---------------------------------------------------------------------------
# loopscale ouro-import, ouro-depth, ouro-scale
# ---------------------------------------------------------------------------
def import_hf(path: str | Path, out_dir: str | Path, seq_len: int = 2048, force: bool = False) -> Path:
    """A Hugging Face Ouro checkpoint as a loopscale run directory (model.pt, the files of
    `artifacts.write_run_files`, summary.json) that every diagnostic reads like a trained run.
    Written under the run lock (`io.write_run`): an existing run is refused unless `force`."""
    from .artifacts import write_run_files
    from .io import CheckpointError, atomic_torch_save, atomic_write_json, run_environment, weights_sha256, write_run
    if not is_hf_checkpoint(path):
        raise CheckpointError(f"{Path(path) / 'config.json'} is not a Hugging Face Ouro config (model_type ouro)")
    has_tok = (Path(path) / "tokenizer.json").is_file()
    model, tok, cfg = load(path, tokenizer=has_tok)  # every check before the run directory is touched
    settings = cfg.to_dict()
    settings["model"]["seq_len"] = seq_len
    cfg.model.seq_len = RunConfig.from_dict(settings).model.seq_len  # the evaluation window, checked
    # the tokenizer stored as loopscale stores one, so its hash is the data's
    tok_json = tok.to_str(pretty=True).encode("utf-8") if has_tok else None
    data = {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest()} if has_tok else {}
    state = model.state_dict()
    source = {"imported_from": str(Path(path).resolve()), "format": "huggingface ouro"}
    with write_run(out_dir, "loopscale ouro-import", force) as out:
        atomic_torch_save(out / "model.pt", {"config": cfg.to_dict(), "model": state, "data": data,
                                             "weights_sha256": weights_sha256(state), "step": 0,
                                             "status": "completed", "source": source})
        write_run_files(out, model, {"config": cfg.to_dict(), "arch": "ouro", "env": run_environment("cpu"),
                                     "data": data, "source": source}, tok_json)
        atomic_write_json(out / "summary.json", {"status": "completed", "steps": 0, "params": model.num_params(),
                                                 **source})
    return Path(out_dir)


def model_tokenizer_sha256(path: str | Path) -> Optional[str]:
    """The sha256 of the tokenizer a model was trained with, as prepared data records it
    (`data.prepare_data`: the tokenizer's `to_str(pretty=True)`), or None where the model
    records none: a Hugging Face directory's tokenizer.json, else a run's loopscale.json (or
    older config.json), else its model.pt's data record."""
    p = Path(path)
    run = p if p.is_dir() else p.parent
    if p.is_dir() and is_hf_checkpoint(p):
        if not (p / "tokenizer.json").is_file():
            return None
        from .artifacts import parse_tokenizer
        tok = parse_tokenizer((p / "tokenizer.json").read_bytes(), p / "tokenizer.json")
        return hashlib.sha256(tok.to_str(pretty=True).encode("utf-8")).hexdigest()
    for name in ("loopscale.json", "config.json"):
        try:
            rec = json.loads((run / name).read_text())
            h = (rec.get("data") or {}).get("tokenizer_sha256")
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        if isinstance(h, str) and h:
            return h
    pt = p if p.is_file() else run / "model.pt"
    if pt.is_file():
        try:
            ck = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
            h = (ck.get("data") or {}).get("tokenizer_sha256")
            return h if isinstance(h, str) and h else None
        except Exception:
            return None
    return None


def check_data_tokenizer(model_path: str | Path, data_dir: str | Path, model_vocab: int) -> None:
    """Refuse a data directory tokenised with another tokenizer than the model's (one line):
    the recorded hashes where the model has one, the vocabulary size always."""
    from . import data as D
    from .io import CheckpointError
    why = D.tokenizer_mismatch(D.load_meta(data_dir), model_tokenizer_sha256(model_path), model_vocab)
    if why:
        raise CheckpointError(f"{data_dir} does not fit {model_path}: it {why}; prepare the data with the model's "
                              f"tokenizer (loopscale prepare-data --tokenizer MODEL/tokenizer.json)")


def eval_windows(data_dir: str | Path, seq_len: int, max_windows: int, split: str = "validation") -> torch.Tensor:
    """Windows of seq_len+1 tokens every seq_len tokens of a prepared data directory's split."""
    from . import data as D
    tokens = D.load_split(data_dir, split)
    starts = list(range(0, len(tokens) - seq_len - 1 + 1, seq_len))[:max_windows or None]
    if not starts:
        raise D.DataError(f"{data_dir} split {split}: {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    return torch.stack([torch.from_numpy(tokens[s:s + seq_len + 1].astype("int64")) for s in starts])


def run_status(path: str | Path) -> str:
    """The status a run's summary.json records (completed | diverged | failed), "completed" for a
    model without one (a Hugging Face checkpoint, a bare model.pt)."""
    p = Path(path)
    summary = (p if p.is_dir() else p.parent) / "summary.json"
    if not summary.is_file():
        return "completed"
    try:
        return str(json.loads(summary.read_text()).get("status") or "completed")
    except (json.JSONDecodeError, OSError, AttributeError):
        return "completed"


def ouro_evaluation(model_path: str | Path, data_dir: str | Path, what: str, *, seq_len: int = 0,
                    windows: int = 16, split: str = "validation", batch_size: int = 2, device: str = "auto",
                    max_k: int = 8, scales=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
                    out: Optional[str | Path] = None) -> dict:
    """Appendix B's variable-depth (`what` "depth": CE/PPL at K = 1..max_k) or scale-sensitivity
    ("scale": CE of r(c·H_K) for each c in `scales`) evaluation of a model on a prepared data
    directory's split; a failed or diverged run gets a result that says so (the grid completes).
    Written to `out` (atomic JSON) when given."""
    from .io import atomic_write_json
    from .runtime import resolve_device
    status = run_status(model_path)
    if status != "completed":
        result = {"evaluation": f"ouro-{what}", "model": str(model_path), "data": str(data_dir),
                  "status": status, "rows": []}
    else:
        dev = resolve_device(device)
        # a Hugging Face Ouro directory, a loopscale run directory or a model.pt/state.pt file
        model, _, cfg = load(model_path, device=str(dev), tokenizer=False)
        check_data_tokenizer(model_path, data_dir, cfg.model.vocab_size)
        seq = seq_len or cfg.model.seq_len
        w = eval_windows(data_dir, seq, windows, split)
        if what == "depth":
            rows = variable_depth(model, w, range(1, max_k + 1), batch_size)
        else:
            rows = scale_sensitivity(model, w, scales, batch_size)
        result = {"evaluation": f"ouro-{what}", "model": str(model_path), "data": str(data_dir), "status": "ok",
                  "split": split, "readout": cfg.model.readout, "k_train": cfg.model.n_loops, "seq_len": seq,
                  "tokens": int(w[:, 1:].numel()), "rows": rows}
    if out:
        atomic_write_json(out, result)
    return result


# ---------------------------------------------------------------------------
# loopscale ouro-downstream: Appendix B's multiple choice through lm-evaluation-harness
# ---------------------------------------------------------------------------
def _gold(sample: dict) -> Optional[int]:
    t = sample.get("target")
    if isinstance(t, list) and len(t) == 1:
        t = t[0]
    try:
        return int(t)
    except (TypeError, ValueError):
        return None


def per_token_accuracy(samples: list[dict], encode_pair) -> Optional[float]:
    """acc_norm with the official per-token normalisation: the choice whose log-likelihood per
    continuation token (as the model type encodes the pair) is highest; None without samples."""
    hits = []
    for s in samples:
        gold = _gold(s)
        if gold is None:
            return None
        scores = [float(resp[0][0]) / max(1, len(encode_pair(args[0], args[1])[1]))
                  for args, resp in zip(s["arguments"], s["resps"])]
        hits.append(float(max(range(len(scores)), key=scores.__getitem__) == gold))
    return sum(hits) / len(hits) if hits else None


def downstream(run: str | Path, tasks: list[str], loops: Optional[list[int]] = None, limit: int = 0,
               include_path: Optional[str] = None, per_token_norm: bool = False, batch_size: int = 8,
               device: str = "cpu") -> dict:
    """Multiple-choice accuracy of a run at each depth in `loops` (default: its K) through
    lm-eval's `loopscale` model type: acc and acc_norm as lm-eval computes them (acc_norm: the
    log-likelihood divided by the choice's characters), with their standard errors, and with
    `per_token_norm` acc_norm_token (divided by its tokens, the official evaluator's rule)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .harness import LoopscaleLM
    lm = LoopscaleLM(run=str(run), device=device, batch_size=batch_size)
    manager = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval knows no task {unknown[0]!r}"
                          + (f" (include path {include_path})" if include_path else ""))
    rows = []
    for k in loops or [lm.cfg.model.n_loops]:
        lm.loops = int(k)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit or None,
                                      log_samples=True, bootstrap_iters=1000)
        for task in tasks:
            r = out["results"].get(task, {})
            row = {"task": task, "loops": int(k), "n": len((out.get("samples") or {}).get(task, [])) or None}
            for m in ("acc", "acc_norm"):
                row[m] = r.get(f"{m},none")
                se = r.get(f"{m}_stderr,none")
                row[f"{m}_stderr"] = se if isinstance(se, (int, float)) else None
            if per_token_norm:
                row["acc_norm_token"] = per_token_accuracy(out["samples"][task], lm.encode_pair)
            rows.append(row)
    return {"evaluation": "ouro-downstream", "run": str(run), "status": "ok", "tasks": list(tasks),
            "limit": limit, "k_train": lm.cfg.model.n_loops, "readout": lm.cfg.model.readout, "rows": rows}


def downstream_of_run(run: str | Path, tasks: list[str], loops: Optional[list[int]] = None, limit: int = 0,
                      include_path: Optional[str] = None, per_token_norm: bool = False, batch_size: int = 8,
                      device: str = "cpu", out: Optional[str | Path] = None) -> dict:
    """`downstream` of a completed run; a failed or diverged one gets a result that says so.
    Written to `out` (atomic JSON) when given."""
    from .io import atomic_write_json
    status = run_status(run)
    if status != "completed":
        result = {"evaluation": "ouro-downstream", "run": str(run), "status": status, "rows": []}
    else:
        result = downstream(run, tasks, loops, limit, include_path, per_token_norm, batch_size, device)
    if out:
        atomic_write_json(out, result)
    return result
