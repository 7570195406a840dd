"""Checkpoints of the paper's own training script -> loopscale run directories.

  loopscale convert-paper CHECKPOINT --out RUN_DIR [--tokenizer FILE] [--set model.KEY=VALUE ...]

The paper's script saves `last.pt` = {"model_state": ..., "config": ..., "tokenizer": ...}.
Its modules map onto loopscale's one to one (the same architecture, paper §3):

  token_embedding, position_embedding        tok_emb, pos_emb (the LM head is tied)
  layers.N.attn_norm, layers.N.ffn_norm      blocks.N.norm1, blocks.N.norm2 (RMSNorm)
  layers.N.attn.qkv (q, k, v stacked)        blocks.N.attn.qkv (same row order)
  layers.N.attn.out_proj                     blocks.N.attn.proj
  layers.N.ffn.w1 (gate), ffn.w3 (up)        blocks.N.mlp.gate_up = [w1; w3]
  layers.N.ffn.w2 (down)                     blocks.N.mlp.down
  decode_norm                                readout_norm (unused by the raw readout)
  loop_norm                                  loop_norm (unused by the residual recurrence)
  exit_gate.*, raw_alpha                     not used by any condition: dropped (recorded)

The config's key names are not documented, so each setting is looked up under its common
names (`CONFIG_KEYS`), also inside nested dicts; widths, vocabulary, context and depth of the
stack are read off the weights and cross-checked. The number of heads, of loops, the readout
(decode) mode and the recurrence must be in the config or given with --set, else the
conversion stops with one line naming the missing setting. The tokenizer is taken from the
checkpoint (a tokenizers JSON, a vocabulary dict or a list of words; a vocabulary becomes a
word-level tokenizer with loopscale's word pre-tokenizer) or from --tokenizer FILE.

The run directory gets model.pt (what `loopscale eval` reads), model.safetensors,
config.json (with a `converted_from` record) and the tokenizer files (artifacts.py).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer, decoders, models

from .artifacts import ROLES, save_weights, write_tokenizer
from .config import ConfigError, RunConfig, merge, parse_overrides
from .registry import READOUTS, RECURRENCES
from .io import CheckpointError, atomic_torch_save, atomic_write_json, run_environment
from .model import LoopedLM

# loopscale setting -> names the paper's config may use for it
CONFIG_KEYS = {
    "vocab_size": ("vocab_size", "n_vocab", "vocab"),
    "d_model": ("d_model", "dim", "hidden_size", "n_embd", "embed_dim", "d_embed"),
    "n_layers": ("n_layers", "num_layers", "n_layer", "layers", "depth"),
    "n_heads": ("n_heads", "num_heads", "n_head", "heads", "num_attention_heads"),
    "d_ff": ("d_ff", "ffn_hidden", "ffn_hidden_dim", "ffn_dim", "hidden_dim", "d_hidden", "mlp_hidden",
             "intermediate_size", "ffn_hidden_size"),
    "seq_len": ("seq_len", "max_seq_len", "block_size", "context_length", "max_len", "n_ctx",
                "max_position_embeddings"),
    "n_loops": ("n_loops", "num_loops", "loops", "K", "max_loops", "n_iterations", "num_iterations",
                "n_recurrences", "recurrence_steps"),
    "readout": ("readout", "readout_mode", "decode_mode", "decode", "readout_type", "decode_norm"),
    "recurrence": ("recurrence", "recurrence_mode", "loop_mode", "loop_norm", "inter_loop_norm",
                   "use_loop_norm"),
    "norm_eps": ("norm_eps", "eps", "rms_norm_eps", "layer_norm_eps", "norm_epsilon"),
    "dropout": ("dropout", "dropout_rate", "p_dropout"),
}
REQUIRED = ("n_heads", "n_loops", "readout", "recurrence")  # not visible in the weights
_READOUT_VALUES = {"rmsnorm": "rmsnorm", "rms": "rmsnorm", "rms_norm": "rmsnorm", "norm": "rmsnorm",
                   "normed": "rmsnorm", "layernorm": "layernorm", "layer_norm": "layernorm", "ln": "layernorm",
                   "raw": "raw", "none": "raw", "identity": "raw", "linear": "raw",
                   "final_norm": "final_norm", "final": "final_norm", "final_only": "final_norm",
                   "final_rmsnorm": "final_norm"}
_RECURRENCE_VALUES = {"residual": "residual", "none": "residual", "plain": "residual",
                      "inter_loop_norm": "inter_loop_norm", "loop_norm": "inter_loop_norm",
                      "norm": "inter_loop_norm", "rmsnorm": "inter_loop_norm", "inter_loop": "inter_loop_norm"}
_IGNORED = re.compile(r"^(exit_gate(\..*)?|raw_alpha)$")
_HEAD_NAMES = ("lm_head.weight", "head.weight", "output.weight")


class ConversionError(CheckpointError):
    """The checkpoint cannot be converted; the message names what is missing or wrong."""


def _flatten(config: Any) -> dict:
    """Scalar settings of a (possibly nested) config; top-level names win over nested ones."""
    if not isinstance(config, dict):
        if hasattr(config, "__dict__"):
            config = vars(config)
        else:
            raise ConversionError(f"the checkpoint's config is a {type(config).__name__}, not a dict")
    flat: dict = {}
    for v in config.values():
        if isinstance(v, dict):
            flat.update(_flatten(v))
    flat.update({k: v for k, v in config.items() if not isinstance(v, dict)})
    return flat


def _lookup(flat: dict, setting: str) -> tuple[Optional[str], Any]:
    for name in CONFIG_KEYS[setting]:
        if name in flat and flat[name] is not None:
            return name, flat[name]
    return None, None


def _mode(setting: str, value: Any, table: dict, valid: tuple) -> str:
    if isinstance(value, bool):  # e.g. decode_norm: true / loop_norm: false
        if setting == "readout":
            return "rmsnorm" if value else "raw"
        return "inter_loop_norm" if value else "residual"
    v = str(value).strip().lower()
    if v in table:
        return table[v]
    raise ConversionError(f"paper config: {setting} value {value!r} is not understood; give --set model.{setting}="
                          f"{'|'.join(valid)}")


def model_settings(config: Any, state: dict, overrides: Optional[dict] = None) -> tuple[dict, dict]:
    """loopscale model settings from the paper config + weight shapes; (settings, where each came from)."""
    flat = _flatten(config)
    over = dict(overrides or {})
    emb = state.get("token_embedding.weight")
    pos = state.get("position_embedding.weight")
    w1 = state.get("layers.0.ffn.w1.weight")
    if emb is None or pos is None or w1 is None:
        missing = [n for n, t in (("token_embedding.weight", emb), ("position_embedding.weight", pos),
                                  ("layers.0.ffn.w1.weight", w1)) if t is None][0]
        raise ConversionError(f"model_state has no {missing}: not a checkpoint of the paper's layout")
    layer_ids = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    shapes = {"vocab_size": emb.shape[0], "d_model": emb.shape[1], "seq_len": pos.shape[0],
              "n_layers": len(layer_ids), "d_ff": w1.shape[0]}
    settings, source = {}, {}
    for setting in CONFIG_KEYS:
        if setting in over:
            settings[setting], source[setting] = over.pop(setting), "--set"
            continue
        name, value = _lookup(flat, setting)
        if setting in shapes:
            if isinstance(value, (int, float, str)) and str(value).isdigit() and int(value) != shapes[setting]:
                raise ConversionError(f"paper config: {name}={value} disagrees with the weights ({setting} "
                                      f"{shapes[setting]})")
            settings[setting], source[setting] = int(shapes[setting]), name or "weights"
        elif value is not None:
            if setting == "readout":
                value = _mode(setting, value, _READOUT_VALUES, READOUTS)
            elif setting == "recurrence":
                value = _mode(setting, value, _RECURRENCE_VALUES, RECURRENCES)
            settings[setting], source[setting] = value, name
        elif setting in REQUIRED:
            raise ConversionError(f"paper config has no {setting} (looked for {', '.join(CONFIG_KEYS[setting])}); "
                                  f"give it with --set model.{setting}=VALUE")
    if over:
        settings.update(over)
        source.update({k: "--set" for k in over})
    return settings, source


def convert_state(state: dict, settings: dict) -> tuple[dict, list[str]]:
    """The paper's model_state as a LoopedLM state dict; also the names that were dropped."""
    state = {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state.items()}
    out, dropped, used = {}, [], set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ConversionError(f"model_state has no {name}")
        used.add(name)
        return state[name]

    out["tok_emb.weight"] = take("token_embedding.weight")
    out["pos_emb.weight"] = take("position_embedding.weight")
    for i in range(settings["n_layers"]):
        p, q = f"layers.{i}.", f"blocks.{i}."
        out[q + "norm1.weight"] = take(p + "attn_norm.weight")
        out[q + "attn.qkv.weight"] = take(p + "attn.qkv.weight")
        out[q + "attn.proj.weight"] = take(p + "attn.out_proj.weight")
        out[q + "norm2.weight"] = take(p + "ffn_norm.weight")
        out[q + "mlp.gate_up.weight"] = torch.cat([take(p + "ffn.w1.weight"), take(p + "ffn.w3.weight")], 0)
        out[q + "mlp.down.weight"] = take(p + "ffn.w2.weight")
    if settings["readout"] != "raw":
        out["readout_norm.weight"] = take("decode_norm.weight")
    if settings["recurrence"] == "inter_loop_norm":
        out["loop_norm.weight"] = take("loop_norm.weight")
    for name in _HEAD_NAMES:  # a head saved beside the embedding must be the tied one
        if name in state:
            used.add(name)
            if not torch.equal(state[name], out["tok_emb.weight"]):
                raise ConversionError(f"model_state's {name} differs from token_embedding.weight: an untied "
                                      f"head, which loopscale's tied model cannot hold")
    for name, t in state.items():
        if name in used:
            continue
        if _IGNORED.match(name) or name in ("decode_norm.weight", "loop_norm.weight"):
            dropped.append(name)  # modules of the paper's script that this condition does not use
        elif name.endswith(".bias"):
            if torch.count_nonzero(t):
                raise ConversionError(f"model_state has a nonzero {name}: loopscale's model has no biases")
            dropped.append(name)
        else:
            raise ConversionError(f"model_state has an unexpected tensor {name} (shape {tuple(t.shape)})")
    return out, sorted(dropped)


def paper_tokenizer(obj: Any) -> Tokenizer:
    """A `tokenizers.Tokenizer` from what the paper's checkpoint stores under "tokenizer"."""
    from .data import word_pre_tokenizer
    if isinstance(obj, (bytes, bytearray)):
        obj = obj.decode("utf-8")
    if isinstance(obj, str):
        if obj.lstrip().startswith("{"):
            return Tokenizer.from_str(obj)
        if Path(obj).is_file():
            return Tokenizer.from_file(obj)
        raise ConversionError(f"the checkpoint's tokenizer is a string that is neither tokenizer JSON nor a file "
                              f"({obj[:60]!r}); give --tokenizer FILE")
    if isinstance(obj, dict) and "model" in obj and "added_tokens" in obj:  # tokenizers JSON as a dict
        return Tokenizer.from_str(json.dumps(obj))
    vocab = None
    if isinstance(obj, dict):
        for key in ("vocab", "word2id", "stoi", "token_to_id", "word_to_id"):
            if isinstance(obj.get(key), (dict, list)):
                obj = obj[key]
                break
    if isinstance(obj, (list, tuple)) and all(isinstance(w, str) for w in obj):
        vocab = {w: i for i, w in enumerate(obj)}
    elif isinstance(obj, dict) and obj and all(isinstance(v, int) for v in obj.values()):
        vocab = {str(w): int(i) for w, i in obj.items()}
    if vocab is None:
        raise ConversionError(f"the checkpoint's tokenizer ({type(obj).__name__}) is not understood; "
                              f"give --tokenizer FILE (a tokenizers JSON)")
    unk = next((n for n in ROLES["unk_token"] if n in vocab), None)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk) if unk else models.WordLevel(vocab=vocab))
    tok.pre_tokenizer = word_pre_tokenizer()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([n for names in ROLES.values() for n in names if n in vocab])
    return tok


def _load_paper_checkpoint(path: Path, trust_pickle: bool) -> dict:
    if not path.is_file():
        raise ConversionError(f"checkpoint {path} not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if not trust_pickle and ("weights_only" in str(e) or "Unsupported global" in str(e)):
            raise ConversionError(f"checkpoint {path} holds Python objects beyond tensors/containers ({first}); "
                                  f"if you trust its source, rerun with --trust-pickle") from None
        raise ConversionError(f"checkpoint {path} cannot be read ({type(e).__name__}: {first})") from None
    if not isinstance(ckpt, dict):
        raise ConversionError(f"checkpoint {path} is a {type(ckpt).__name__}, not the paper's dict")
    for key in ("model_state", "config"):
        if key not in ckpt:
            raise ConversionError(f"checkpoint {path} has no {key!r} (keys: {', '.join(map(str, ckpt))[:120]}): "
                                  f"not written by the paper's training script")
    return ckpt


def convert_paper(checkpoint: str | Path, out_dir: str | Path, tokenizer_file: Optional[str | Path] = None,
                  overrides: Optional[list[str]] = None, trust_pickle: bool = False) -> dict:
    """Convert a paper `last.pt` into a loopscale run directory; returns the conversion record."""
    src, out = Path(checkpoint), Path(out_dir)
    ckpt = _load_paper_checkpoint(src, trust_pickle)
    upd = parse_overrides(overrides or [])
    if any(k != "model" for k in upd):
        raise ConfigError("convert-paper takes only --set model.KEY=VALUE")
    state = {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in ckpt["model_state"].items()}
    settings, source = model_settings(ckpt["config"], state, upd.get("model"))
    cfg = RunConfig.from_dict(merge(RunConfig().to_dict(), {
        "model": settings, "data": {"vocab_size": settings["vocab_size"]}}))
    converted, dropped = convert_state(state, settings)
    model = LoopedLM(cfg.model)
    model.load_state_dict({k: v.float() for k, v in converted.items()})

    if tokenizer_file is not None:
        tok = Tokenizer.from_file(str(tokenizer_file))
    elif ckpt.get("tokenizer") is not None:
        tok = paper_tokenizer(ckpt["tokenizer"])
    else:
        raise ConversionError(f"checkpoint {src} has no tokenizer; give --tokenizer FILE")
    if tok.get_vocab_size(with_added_tokens=True) > cfg.model.vocab_size:
        raise ConversionError(f"the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids but the "
                              f"embedding only {cfg.model.vocab_size}")
    tok_json = tok.to_str(pretty=True).encode("utf-8")

    step = ckpt.get("step", ckpt.get("global_step"))
    record = {"checkpoint": str(src.resolve()), "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
              "settings_from": source, "dropped": dropped}
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, tok_json, cfg.model.seq_len)
    save_weights(out / "model.safetensors", model)
    atomic_torch_save(out / "model.pt", {"model": model.state_dict(), "config": cfg.to_dict(),
                                         "step": step if isinstance(step, int) else None, "status": "completed"})
    atomic_write_json(out / "config.json", {
        "config": cfg.to_dict(), "env": run_environment("cpu"),
        "data": {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
                 "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest()},
        "converted_from": record})
    return record


def cmd_convert_paper(args) -> int:
    rec = convert_paper(args.checkpoint, args.out, args.tokenizer, args.overrides, args.trust_pickle)
    src = ", ".join(f"{k}<-{v}" for k, v in rec["settings_from"].items())
    print(f"converted {args.checkpoint} -> {args.out} ({src}; dropped: {', '.join(rec['dropped']) or 'nothing'})")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("convert-paper", help="convert a checkpoint of the paper's training script "
                                                   "(last.pt) into a loopscale run directory")
    p.add_argument("checkpoint", help="the paper script's last.pt (keys model_state, config, tokenizer)")
    p.add_argument("--out", required=True, help="run directory to write")
    p.add_argument("--tokenizer", help="tokenizers JSON file (default: the checkpoint's own tokenizer)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="model.KEY=VALUE",
                   help="a model setting the paper config lacks, e.g. --set model.n_heads=8 (repeatable)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="load a checkpoint holding Python objects (unsafe: only for files you trust)")
    p.set_defaults(func=cmd_convert_paper)
