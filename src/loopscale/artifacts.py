"""A trained run as a self-contained artifact, and `loopscale.load(run_dir)`.

A finished run directory holds, besides the training logs:

  model.safetensors        the weights (safetensors: no pickle, byte-reproducible); the LM head
                           is tied to the token embedding, so it is stored once, as `tok_emb.weight`
  config.json              {"config": the resolved run config, "env": provenance, "data": ...}
  tokenizer.json           the run's tokenizer (a copy of its data directory's)
  tokenizer_config.json    what `transformers.PreTrainedTokenizerFast.from_pretrained(RUN)`
  special_tokens_map.json  reads: pad/bos/eos/unk tokens, model_max_length (= seq_len)
  model.pt                 the torch checkpoint (training resumes and older readers use it)

Training writes them at its end; `loopscale export RUN [--data DATA]` writes them for a run
trained before (its tokenizer from DATA, checked against the hash the run recorded).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tokenizers import Tokenizer

from .config import RunConfig
from .io import CheckpointError, atomic_write_bytes, atomic_write_json
from .model import LoopedLM

WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# special-token roles of PreTrainedTokenizerFast and the names a tokenizer may give them
# (loopscale's own: ids 0..3 = <pad> <bos> <eos> <unk>, data.SPECIAL_TOKENS)
ROLES = {"pad_token": ("<pad>", "[PAD]", "<|pad|>"),
         "bos_token": ("<bos>", "<s>", "[BOS]", "<|startoftext|>"),
         "eos_token": ("<eos>", "</s>", "[EOS]", "<|endoftext|>"),
         "unk_token": ("<unk>", "[UNK]", "<|unk|>")}


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------
def save_weights(path: str | Path, model: LoopedLM) -> Path:
    """The model's state dict as safetensors (atomic). The only metadata is {"format": "pt"}
    (a header with more keys is not byte-reproducible); step and status are in
    summary.json and model.pt."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    return atomic_write_bytes(path, st_save(tensors, metadata={"format": "pt"}))


def tokenizer_metadata(tok: Tokenizer, model_max_length: int) -> tuple[dict, dict]:
    """(tokenizer_config.json, special_tokens_map.json) for a `tokenizers.Tokenizer`."""
    vocab = tok.get_vocab(with_added_tokens=True)
    roles = {role: next((n for n in names if n in vocab), None) for role, names in ROLES.items()}
    roles = {r: n for r, n in roles.items() if n is not None}
    decoder = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                        "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
               for i, t in sorted(tok.get_added_tokens_decoder().items())}
    # the paper's tokenizer (data.tokenization=paper) keeps its specials as plain vocabulary
    # (a literal "<unk>" in text is three pieces, as in the official code): list them too
    for name in roles.values():
        decoder.setdefault(str(vocab[name]), {"content": name, "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": True})
    decoder = dict(sorted(decoder.items(), key=lambda kv: int(kv[0])))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
              **roles, "added_tokens_decoder": decoder}
    return config, dict(roles)


def write_tokenizer(run_dir: str | Path, tokenizer_json: bytes, model_max_length: int) -> None:
    """tokenizer.json plus the PreTrainedTokenizerFast metadata files."""
    run = Path(run_dir)
    tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    config, special = tokenizer_metadata(tok, model_max_length)
    atomic_write_bytes(run / "tokenizer.json", tokenizer_json)
    atomic_write_json(run / "tokenizer_config.json", config)
    atomic_write_json(run / "special_tokens_map.json", special)


def write_artifacts(run_dir: str | Path, model: LoopedLM, cfg: RunConfig, data_dir: Optional[str | Path]) -> None:
    """End of training: model.safetensors, and the tokenizer files when the data dir has one."""
    run = Path(run_dir)
    save_weights(run / WEIGHTS, model)
    tok = Path(data_dir) / "tokenizer.json" if data_dir is not None else None
    if tok is not None and tok.is_file():
        write_tokenizer(run, tok.read_bytes(), cfg.model.seq_len)


def export_run(run_dir: str | Path, data_dir: Optional[str | Path] = None) -> list[str]:
    """Write a trained run's artifact files from its model.pt; returns the files written.

    The tokenizer comes from `data_dir` (or the run's own tokenizer.json); when the run's
    config.json recorded a tokenizer hash, the file must match it."""
    run = Path(run_dir)
    model_pt = run / "model.pt"
    if not model_pt.is_file():
        raise CheckpointError(f"{model_pt} not found: {run} is not a finished loopscale run")
    from .evaluate import load_model
    model, cfg, ckpt = load_model(model_pt)
    record = _read_json(run / "config.json") or {}
    if not record.get("config"):
        atomic_write_json(run / "config.json", {"config": cfg.to_dict(), "data": {}})
    save_weights(run / WEIGHTS, model)
    written = ["config.json", WEIGHTS]
    src = Path(data_dir) / "tokenizer.json" if data_dir is not None else run / "tokenizer.json"
    if not src.is_file():
        raise FileNotFoundError(f"no tokenizer at {src}: give the run's data directory "
                                f"(loopscale export {run} --data DATA)")
    text = src.read_bytes()
    want = (record.get("data") or {}).get("tokenizer_sha256")
    if want and hashlib.sha256(text).hexdigest() != want:
        raise CheckpointError(f"{src} is not the tokenizer {run} was trained with (sha256 differs from "
                              f"config.json's data.tokenizer_sha256); give the run's own data directory")
    write_tokenizer(run, text, cfg.model.seq_len)
    return written + list(TOKENIZER_FILES)


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------
def load(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[LoopedLM, Tokenizer, RunConfig]:
    """(model, tokenizer, config) of a run directory, the model in eval mode on `device`.

    Weights from model.safetensors (else model.pt), config from config.json (else the
    checkpoint's), tokenizer from tokenizer.json (`tokenizers.Tokenizer`)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} not found")
    weights = run / WEIGHTS
    if not weights.is_file():
        from .evaluate import load_model
        model, cfg, _ = load_model(run / "model.pt", device=device)
    else:
        record = _read_json(run / "config.json")
        if not record or "config" not in record:
            raise CheckpointError(f"{run / 'config.json'} is missing or unreadable: it holds the run's config")
        try:
            cfg = RunConfig.from_checkpoint(record["config"])  # drops the `eval` of older runs
        except Exception as e:
            raise CheckpointError(f"{run / 'config.json'} carries an invalid config: {e}") from None
        try:
            state = st_load(weights.read_bytes())
        except Exception as e:
            raise CheckpointError(f"{weights} is truncated or corrupted ({type(e).__name__})") from None
        model = LoopedLM(cfg.model)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise CheckpointError(f"{weights} does not match config.json's model shape: "
                                  f"{str(e).splitlines()[0][:200]}") from None
        model = model.to(device).eval()
    tok_path = run / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"{tok_path} not found: run `loopscale export {run} --data DATA` first")
    return model, Tokenizer.from_file(str(tok_path)), cfg


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------
def cmd_export(args) -> int:
    files = export_run(args.run, args.data)
    print(f"wrote {', '.join(files)} in {args.run}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a trained run's model.safetensors and tokenizer files")
    p.add_argument("run", help="run directory (with model.pt)")
    p.add_argument("--data", help="the run's data directory (for tokenizer.json); default: the run's own copy")
    p.set_defaults(func=cmd_export)
