"""Checkpoints of the paper's official training script -> loopscale run directories.

  loopscale convert-paper CHECKPOINT --out RUN_DIR [--force] [--tokenizer FILE]

Reads the official trainer's `last.pt` (`AutoregressiveLoopLM`, the same architecture, paper
§3): the settings from the official config keys (the official builder's defaults where a key
is absent), the weights one to one. What the loopscale model cannot represent is refused in
one line naming the official key; the checkpoint is untrusted input. The key and tensor
tables, the checks and the run-directory layout are in docs/artifacts.md ("The paper's
checkpoints").
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer

from .artifacts import write_run_files
from .data import _file_sha256  # streamed: never the whole checkpoint in memory
from .config import ConfigError, RunConfig, merge, parse_overrides
from .io import CheckpointError, atomic_torch_save, run_environment, write_run
from .model import LoopedLM

MAX_CHECKPOINT_BYTES = 16 * 2**30  # what a checkpoint file may hold, inflated (a zip bomb stops here)
MAX_TOKENIZER_BYTES = 256 * 2**20
_PREFIX = re.compile(r"^(module\.|_orig_mod\.)+")

# the official builder's defaults for the keys a config may leave out (build_ar_looplm_from_config)
MODEL_DEFAULTS = {"inter_loop_norm": True, "use_decode_norm": True, "decode_norm_final_only": False,
                  "block_norm_type": "rmsnorm", "loop_norm_type": "rmsnorm", "decode_norm_type": "rmsnorm",
                  "use_spectral_damping": False, "tie_weights": True, "dropout": 0.1}
READOUT_TYPES = {"rmsnorm": "rmsnorm", "alpha_readout": "alpha_readout", "tapernorm": "tapernorm"}
SUPERVISION_MODES = {"per-step": "per_loop", "terminal": "terminal", "adaptive": "adaptive"}
# official alpha_readout.* key -> (loopscale model key, default)
ALPHA_KEYS = {"init_alpha": ("alpha_init", 0.5), "fixed_alpha": ("alpha_fixed", None),
              "alpha_min": ("alpha_min", 0.0), "alpha_max": ("alpha_max", 1.0),
              "s_ref_mode": ("alpha_s_ref", "ema"), "ema_decay": ("alpha_ema_decay", 0.99),
              "init_log_s_ref": ("alpha_log_s_ref", 0.0), "per_loop_alpha": ("alpha_per_loop", False)}


# every key the official code reads in these sections (src/models/ar_looplm.py, src/train_ar_looplm.py):
# another one is an option of some other code, which the conversion cannot know, so it is refused
KNOWN_KEYS = {
    "model": ("d_model", "num_heads", "num_layers", "ff_multiplier", "dropout", "num_loops", *MODEL_DEFAULTS),
    "supervision": ("mode", "entropy_weight", "norm_penalty_weight", "scale_anchor_weight", "scale_anchor_target"),
    "alpha_readout": tuple(ALPHA_KEYS),
    "taper_norm": ("ema_decay", "gate_warmup_steps", "gate_warmup_frac", "gate_decay_steps", "gate_decay_frac"),
}


class ConversionError(CheckpointError):
    """The checkpoint cannot be converted; the message names what is missing or wrong."""


# ---------------------------------------------------------------------------
# reading the official config
# ---------------------------------------------------------------------------
def _section(config: dict, name: str) -> dict:
    v = config.get(name, {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConversionError(f"paper config: {name} is a {type(v).__name__}, not a mapping")
    return v


def _flag(sec: dict, where: str, key: str, default: bool) -> bool:
    v = sec.get(key, default)
    if not isinstance(v, bool):
        raise ConversionError(f"paper config: {where}.{key} must be true or false, got {v!r}")
    return v


def _number(sec: dict, where: str, key: str, default: Any) -> Any:
    v = sec.get(key, default)
    if v is None and default is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConversionError(f"paper config: {where}.{key} must be a finite number, got {v!r}")
    return float(v)


def _integer(sec: dict, where: str, key: str) -> int:
    if key not in sec:
        raise ConversionError(f"paper config has no {where}.{key}")
    v = sec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ConversionError(f"paper config: {where}.{key} must be an integer, got {v!r}")
    if v <= 0:
        raise ConversionError(f"paper config: {where}.{key} must be positive, got {v!r}")
    return int(v)


def _choice(sec: dict, where: str, key: str, default: str, table: dict) -> str:
    v = sec.get(key, default)
    if not isinstance(v, str) or v not in table:
        raise ConversionError(f"paper config: {where}.{key} {v!r} is not supported by loopscale "
                              f"(supported: {', '.join(table)})")
    return table[v]


def official_settings(config: Any, state: dict, total_train_steps: Any = None) -> tuple[dict, dict]:
    """loopscale (model, objective) settings from an official checkpoint's config, cross-checked
    with the weights; refuses in one line what loopscale cannot represent."""
    if not isinstance(config, dict):
        raise ConversionError(f"the checkpoint's config is a {type(config).__name__}, not a mapping")
    m, data, sup = _section(config, "model"), _section(config, "data"), _section(config, "supervision")
    alpha_cfg, taper_cfg = _section(config, "alpha_readout"), _section(config, "taper_norm")
    for name, known in KNOWN_KEYS.items():
        unknown = [k for k in _section(config, name) if k not in known]
        if unknown:
            raise ConversionError(f"paper config: {name}.{unknown[0]} is not a key of the official code "
                                  f"(commit 959dd3c), so its meaning is unknown; refused")
    flags = {k: _flag(m, "model", k, v) for k, v in MODEL_DEFAULTS.items() if isinstance(v, bool)}
    for key in ("block_norm_type", "loop_norm_type"):
        v = m.get(key, "rmsnorm")
        if v != "rmsnorm" and (key == "block_norm_type" or flags["inter_loop_norm"]):
            raise ConversionError(f"paper config: model.{key} {v!r} is not supported by loopscale "
                                  f"(its blocks and inter-loop norm are RMSNorm)")
    if not flags["tie_weights"]:
        raise ConversionError("paper config: model.tie_weights false (an untied head) is not supported by loopscale")

    # readout
    if not flags["use_decode_norm"]:
        readout = "raw"
    else:
        readout = _choice(m, "model", "decode_norm_type", "rmsnorm", READOUT_TYPES)
        if flags["decode_norm_final_only"]:
            if readout != "rmsnorm":
                raise ConversionError(f"paper config: model.decode_norm_final_only with decode_norm_type "
                                      f"{m.get('decode_norm_type')!r} is not supported by loopscale "
                                      f"(its final-only readout is RMSNorm)")
            readout = "final_norm"
    # recurrence
    if flags["inter_loop_norm"] and flags["use_spectral_damping"]:
        raise ConversionError("paper config: model.inter_loop_norm together with model.use_spectral_damping is "
                              "not supported by loopscale (one recurrence per model)")
    recurrence = "inter_loop_norm" if flags["inter_loop_norm"] else \
        "spectral_damping" if flags["use_spectral_damping"] else "residual"

    # dims, each checked against the weights
    d = _integer(m, "model", "d_model")
    model = {"d_model": d, "n_heads": _integer(m, "model", "num_heads"), "n_layers": _integer(m, "model", "num_layers"),
             "d_ff": d * _integer(m, "model", "ff_multiplier"), "n_loops": _integer(m, "model", "num_loops"),
             "seq_len": _integer(data, "data", "seq_len"), "readout": readout, "recurrence": recurrence,
             "dropout": _number(m, "model", "dropout", MODEL_DEFAULTS["dropout"])}
    emb = state.get("token_embedding.weight")
    if not isinstance(emb, torch.Tensor) or emb.dim() != 2:
        raise ConversionError("model_state has no 2-d token_embedding.weight: not a checkpoint of the paper's layout")
    model["vocab_size"] = int(emb.shape[0])
    if emb.shape[1] != d:
        raise ConversionError(f"paper config: model.d_model={m['d_model']} disagrees with the weights "
                              f"(token_embedding.weight has width {emb.shape[1]})")
    layers = {int(x.group(1)) for k in state if (x := re.match(r"layers\.(\d+)\.", k))}
    if layers != set(range(model["n_layers"])):
        raise ConversionError(f"paper config: model.num_layers={m['num_layers']} disagrees with the weights "
                              f"({len(layers)} layers in model_state)")
    if model["readout"] == "alpha_readout":
        for key, (ours, default) in ALPHA_KEYS.items():
            if key == "s_ref_mode":
                model[ours] = _choice(alpha_cfg, "alpha_readout", key, default,
                                      {"ema": "ema", "fixed": "fixed", "learned": "learned"})
            elif key == "per_loop_alpha":
                model[ours] = _flag(alpha_cfg, "alpha_readout", key, default)
            else:
                model[ours] = _number(alpha_cfg, "alpha_readout", key, default)
    if model["readout"] == "tapernorm":
        model["taper_ema_decay"] = _number(taper_cfg, "taper_norm", "ema_decay", 0.99)
        for kind in ("warmup", "decay"):
            if f"gate_{kind}_steps" in taper_cfg:  # absolute steps: as a share of the run's steps
                steps = _number(taper_cfg, "taper_norm", f"gate_{kind}_steps", 0)
                if not isinstance(total_train_steps, int) or isinstance(total_train_steps, bool) or total_train_steps < 1:
                    raise ConversionError(f"paper config: taper_norm.gate_{kind}_steps needs the checkpoint's "
                                          f"total_train_steps, which is missing")
                model[f"taper_{kind}_frac"] = min(1.0, max(0.0, steps / total_train_steps))
            elif f"gate_{kind}_frac" in taper_cfg:
                model[f"taper_{kind}_frac"] = _number(taper_cfg, "taper_norm", f"gate_{kind}_frac", 0.0)

    # objective (for the record: the loss the weights were trained with)
    loss = _choice(sup, "supervision", "mode", "per-step", SUPERVISION_MODES)
    objective = {"loss": loss, "entropy_weight": _number(sup, "supervision", "entropy_weight", 0.1)}
    penalty = _number(sup, "supervision", "norm_penalty_weight", 0.0)
    anchor = _number(sup, "supervision", "scale_anchor_weight", 0.0)
    if penalty > 0 and anchor > 0:
        raise ConversionError("paper config: supervision.norm_penalty_weight together with "
                              "supervision.scale_anchor_weight is not supported by loopscale (one regularizer)")
    if penalty > 0:
        objective.update(regularizer="norm_penalty", penalty_weight=penalty)
    elif anchor > 0:
        objective.update(regularizer="scale_anchor", anchor_weight=anchor,
                         anchor_target=_number(sup, "supervision", "scale_anchor_target", 1.0))
    model["exit_gate"] = loss == "adaptive"
    return model, objective


# ---------------------------------------------------------------------------
# the weights
# ---------------------------------------------------------------------------
def _official_names(cfg: RunConfig, model_keys) -> dict:
    """loopscale state-dict name -> the official name(s) it comes from."""
    mc = cfg.model
    names: dict = {"tok_emb.weight": "token_embedding.weight", "pos_emb.weight": "position_embedding.weight"}
    for i in range(mc.n_layers):
        p, q = f"layers.{i}.", f"blocks.{i}."
        names.update({q + "norm1.weight": p + "attn_norm.weight", q + "attn.qkv.weight": p + "attn.qkv.weight",
                      q + "attn.proj.weight": p + "attn.out_proj.weight", q + "norm2.weight": p + "ffn_norm.weight",
                      q + "mlp.gate_up.weight": (p + "ffn.w1.weight", p + "ffn.w3.weight"),
                      q + "mlp.down.weight": p + "ffn.w2.weight"})
    for k in model_keys:
        if k.startswith("readout_norm."):
            names[k] = "decode_norm." + k[len("readout_norm."):]
        elif k.startswith("loop_norm.") or k.startswith("exit_gate."):
            names[k] = k
    if mc.recurrence == "spectral_damping":
        names["damping_logit"] = "raw_alpha"
    return names


def _check_tensor(name: str, t: Any, want: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ConversionError(f"model_state's {name} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided or t.is_meta or t.is_quantized:
        raise ConversionError(f"model_state's {name} is not a plain dense tensor ({t.layout})")
    if t.is_floating_point() != want.is_floating_point() or (not want.is_floating_point() and t.dtype != want.dtype):
        raise ConversionError(f"model_state's {name} has dtype {t.dtype}, expected {want.dtype} (never cast)")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ConversionError(f"model_state's {name} holds NaN or infinite values")
    return t


def model_settings(config: Any, state: dict, overrides: Optional[dict] = None) -> tuple[dict, dict]:
    """The loopscale model settings of an official checkpoint (`official_settings`) with
    `overrides` on top; (settings, where each came from)."""
    settings, _ = official_settings(config, _strip(state))
    source = {k: "official config" for k in settings}
    for k, v in (overrides or {}).items():
        settings[k], source[k] = v, "override"
    return settings, source


def _strip(state: dict) -> dict:
    return {_PREFIX.sub("", k) if isinstance(k, str) else k: v for k, v in state.items()}


def convert_state(state: dict, cfg: RunConfig | dict) -> tuple[dict, list[str]]:
    """The official model_state as a LoopedLM state dict (shapes and dtypes checked); also the
    names that were dropped (modules of the official model that this condition does not use).
    `cfg`: the target run config, or a dict of its model settings (`model_settings`)."""
    if isinstance(cfg, dict):
        cfg = RunConfig.from_dict(merge(RunConfig().to_dict(), {"model": cfg, "data": {"vocab_size": cfg["vocab_size"]}}))
    state = _strip(state)
    with torch.device("meta"):  # shapes and dtypes only: nothing is allocated before the cross-check
        target = LoopedLM(cfg.model).state_dict()
    names = _official_names(cfg, target.keys())
    out, used = {}, set()
    for ours, want in target.items():
        theirs = names.get(ours)
        if theirs is None:
            raise ConversionError(f"loopscale's {ours} has no counterpart in the official layout")
        parts = theirs if isinstance(theirs, tuple) else (theirs,)
        for n in parts:
            if n not in state:
                raise ConversionError(f"model_state has no {n} (needed by readout {cfg.model.readout}, recurrence "
                                      f"{cfg.model.recurrence}, loss {cfg.objective.loss})")
            used.add(n)
        ts = [_check_tensor(n, state[n], want) for n in parts]
        t = torch.cat(ts, 0) if len(ts) > 1 and all(x.dim() == 2 for x in ts) else ts[0]
        if tuple(t.shape) != tuple(want.shape):
            if len(ts) > 1:
                raise ConversionError(f"model_state's {' + '.join(parts)} have shapes {[tuple(x.shape) for x in ts]}, "
                                      f"the config implies {tuple(want.shape)} together")
            raise ConversionError(f"model_state's {parts[0]} has shape {tuple(t.shape)}, the config implies "
                                  f"{tuple(want.shape)}")
        out[ours] = t.to(want.dtype).clone()
        if out[ours].is_floating_point() and not bool(torch.isfinite(out[ours]).all()):  # 1e300 in float64
            raise ConversionError(f"model_state's {parts[0]} overflows {str(want.dtype).removeprefix('torch.')} "
                                  f"(values beyond its range become inf)")
        if ours.endswith("alpha_value") and abs(float(out[ours]) - float(cfg.model.alpha_fixed)) > 1e-6:
            raise ConversionError(f"paper config: alpha_readout.fixed_alpha={cfg.model.alpha_fixed} disagrees with "
                                  f"the weights ({parts[0]} = {float(out[ours]):g})")
    head = state.get("lm_head.weight")
    if head is not None:
        used.add("lm_head.weight")
        if not isinstance(head, torch.Tensor) or head.shape != out["tok_emb.weight"].shape or \
                not torch.equal(head.to(out["tok_emb.weight"].dtype), out["tok_emb.weight"]):
            raise ConversionError("model_state's lm_head.weight differs from token_embedding.weight: an untied "
                                  "head, which loopscale's tied model cannot hold")
    # modules of the official model that the converted condition does not use at all
    mc = cfg.model
    unused = [m for m, off in (("decode_norm", mc.readout == "raw"), ("loop_norm", mc.recurrence != "inter_loop_norm"),
                               ("exit_gate", not mc.exit_gate), ("raw_alpha", mc.recurrence != "spectral_damping"))
              if off]
    for name, t in state.items():
        if name not in used and name.split(".")[0] not in unused:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConversionError(f"model_state has an unexpected entry {name} ({shape}): not the official layout")
    return out, sorted(name for name in state if name not in used)


# ---------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------
def official_tokenizer(obj: Any) -> Tokenizer:
    """A `tokenizers.Tokenizer` from the checkpoint's "tokenizer": the official regex
    tokenizer's state {kind: "regex", itos, pattern}, or a tokenizers JSON (str or dict).
    A string is never taken for a path."""
    if isinstance(obj, (bytes, bytearray)):
        try:
            obj = bytes(obj).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConversionError(f"the checkpoint's tokenizer is not UTF-8 (byte {e.start}); give --tokenizer FILE") \
                from None
    if isinstance(obj, str):
        if not obj.lstrip().startswith("{"):
            raise ConversionError(f"the checkpoint's tokenizer is a string that is not tokenizer JSON ({obj[:40]!r}; "
                                  f"a path in a checkpoint is never opened); give --tokenizer FILE")
        return _tokenizer_from_json(obj, "the checkpoint's tokenizer")
    if isinstance(obj, dict) and "kind" in obj:
        if obj.get("kind") != "regex":
            raise ConversionError(f"the checkpoint's tokenizer kind {obj.get('kind')!r} is not supported "
                                  f"(the official one is 'regex'); give --tokenizer FILE")
        itos, pattern = obj.get("itos"), obj.get("pattern")
        if not isinstance(itos, list) or not all(isinstance(w, str) for w in itos):
            raise ConversionError("the checkpoint's tokenizer: itos must be a list of strings")
        if not itos:
            raise ConversionError("the checkpoint's tokenizer has an empty vocabulary (itos)")
        if len(set(itos)) != len(itos):
            dup = next(w for i, w in enumerate(itos) if w in itos[:i])
            raise ConversionError(f"the checkpoint's tokenizer lists {dup!r} twice in itos")
        if not isinstance(pattern, str):
            raise ConversionError(f"the checkpoint's tokenizer: pattern must be a string, got {type(pattern).__name__}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConversionError(f"the checkpoint's tokenizer: pattern is not a valid regular expression ({e})") \
                from None
        from .data import DataError, paper_tokenizer
        try:
            return paper_tokenizer(itos, pattern)
        except DataError as e:
            raise ConversionError(f"the checkpoint's tokenizer cannot be rebuilt: {e}") from None
    if isinstance(obj, dict) and "model" in obj:
        return _tokenizer_from_json(json.dumps(obj), "the checkpoint's tokenizer")
    raise ConversionError(f"the checkpoint's tokenizer ({type(obj).__name__}) is not understood (expected "
                          f"{{kind: 'regex', itos, pattern}}); give --tokenizer FILE")


def _tokenizer_from_json(text: str, what: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(text)
    except Exception as e:
        raise ConversionError(f"{what} is not a valid tokenizers JSON ({(str(e).splitlines() or [''])[0][:120]})") \
            from None


def read_tokenizer_file(path: str | Path) -> Tokenizer:
    from .io import read_text_file
    what = f"--tokenizer {Path(path)}"
    return _tokenizer_from_json(read_text_file(path, what, ConversionError, MAX_TOKENIZER_BYTES), what)


def _check_tokenizer(tok: Tokenizer, vocab_size: int) -> None:
    ids = tok.get_vocab(with_added_tokens=True)
    if not ids:
        raise ConversionError("the tokenizer has an empty vocabulary")
    top = max(ids.values()) + 1  # ids run up to max id, whatever their count
    if top > vocab_size:
        raise ConversionError(f"the tokenizer's ids reach {top - 1} but the embedding has only {vocab_size} rows")


# ---------------------------------------------------------------------------
# reading the checkpoint file
# ---------------------------------------------------------------------------
def _check_size(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_CHECKPOINT_BYTES:
        raise ConversionError(f"checkpoint {path}: {size:,} bytes, over the {MAX_CHECKPOINT_BYTES:,} allowed")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                inflated = sum(i.file_size for i in z.infolist())
        except (zipfile.BadZipFile, OSError) as e:
            raise ConversionError(f"checkpoint {path} cannot be read (a broken zip archive: {e})") from None
        if inflated > MAX_CHECKPOINT_BYTES or inflated > 4 * size + (64 << 20):
            raise ConversionError(f"checkpoint {path} inflates to {inflated:,} bytes from {size:,} (a zip bomb?); "
                                  f"torch writes checkpoints uncompressed")


def _load_paper_checkpoint(path: Path, trust_pickle: bool) -> dict:
    if not path.exists():
        raise ConversionError(f"checkpoint {path} not found")
    if not path.is_file():
        raise ConversionError(f"checkpoint {path} is not a file")
    _check_size(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        pickled_objects = "Unsupported global" in str(e) or "GLOBAL" in str(e)
        if not trust_pickle and pickled_objects:
            raise ConversionError(f"checkpoint {path} holds Python objects beyond tensors/containers ({first}); "
                                  f"if you trust its source, rerun with --trust-pickle") from None
        raise ConversionError(f"checkpoint {path} is not a readable torch checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict):
        raise ConversionError(f"checkpoint {path} is a {type(ckpt).__name__}, not the paper's dict")
    for key in ("model_state", "config"):
        if key not in ckpt:
            keys = ", ".join(map(str, ckpt))[:120]
            raise ConversionError(f"checkpoint {path} has no {key!r} (keys: {keys}): not written by the paper's "
                                  f"training script")
    state = ckpt["model_state"]
    if not isinstance(state, dict):
        raise ConversionError(f"checkpoint {path}: model_state is a {type(state).__name__}, not a mapping of tensors")
    bad = next((k for k in state if not isinstance(k, str)), None)
    if bad is not None:
        raise ConversionError(f"checkpoint {path}: model_state has a non-string key {bad!r}")
    ckpt["model_state"] = _strip(state)
    return ckpt


def load_official(checkpoint: str | Path, overrides: Optional[list[str]] = None,
                  trust_pickle: bool = False) -> tuple[LoopedLM, RunConfig, dict, list[str]]:
    """An official `last.pt` as a loopscale model in memory (fp32, eval mode): (model, run
    config, the checkpoint dict, the official tensors dropped). `overrides`: `model.KEY=VALUE`."""
    ckpt = _load_paper_checkpoint(Path(checkpoint), trust_pickle)
    state = ckpt["model_state"]
    model_set, objective_set = official_settings(ckpt["config"], state, ckpt.get("total_train_steps"))
    upd = parse_overrides(overrides or [])
    if any(k != "model" for k in upd) or not isinstance(upd.get("model", {}), dict):
        raise ConfigError("convert-paper takes only --set model.KEY=VALUE")
    model_set.update(upd.get("model", {}))
    try:
        cfg = RunConfig.from_dict(merge(RunConfig().to_dict(), {
            "model": model_set, "objective": objective_set, "data": {"vocab_size": model_set["vocab_size"]}}))
    except ConfigError as e:
        raise ConversionError(f"the paper config converts to an invalid loopscale config: {e}") from None
    converted, dropped = convert_state(state, cfg)
    model = LoopedLM(cfg.model)
    model.load_state_dict(converted)
    return model.eval(), cfg, ckpt, dropped


def convert_paper(checkpoint: str | Path, out_dir: str | Path, tokenizer_file: Optional[str | Path] = None,
                  overrides: Optional[list[str]] = None, trust_pickle: bool = False, force: bool = False) -> dict:
    """Convert an official `last.pt` into a loopscale run directory; returns the conversion record.
    Everything is read and checked before the run directory is touched."""
    src = Path(checkpoint)
    model, cfg, ckpt, dropped = load_official(src, overrides, trust_pickle)

    if tokenizer_file is not None:
        tok = read_tokenizer_file(tokenizer_file)
    elif ckpt.get("tokenizer") is not None:
        tok = official_tokenizer(ckpt["tokenizer"])
    else:
        raise ConversionError(f"checkpoint {src} has no tokenizer; give --tokenizer FILE")
    _check_tokenizer(tok, cfg.model.vocab_size)
    tok_json = tok.to_str(pretty=True).encode("utf-8")

    step = ckpt.get("global_step", ckpt.get("step"))
    try:
        official_config = json.loads(json.dumps(ckpt["config"], default=str))
    except (RecursionError, ValueError) as e:
        raise ConversionError(f"the checkpoint's config cannot be recorded ({type(e).__name__})") from None
    record = {"checkpoint": str(src.resolve()), "sha256": _file_sha256(src), "official_config": official_config,
              "settings": {"model": dict(cfg.model.__dict__), "objective": dict(cfg.objective.__dict__)},
              "dropped": dropped}
    with write_run(out_dir, "loopscale convert-paper", force) as out:  # locked; --force swaps in a whole run
        atomic_torch_save(out / "model.pt", {"model": model.state_dict(), "config": cfg.to_dict(),
                                             "step": step if isinstance(step, int) and not isinstance(step, bool)
                                             else None, "status": "completed"})
        # the artifact files of a run (tokenizer, loopscale.json, model.safetensors, the Hugging
        # Face config.json last: a run with config.json is complete)
        write_run_files(out, model, {
            "config": cfg.to_dict(), "env": run_environment("cpu"),
            "data": {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
                     "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest()},
            "converted_from": record}, tok_json)
    return record
