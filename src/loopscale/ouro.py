"""The Ouro architecture (ByteDance's published looped LM), in loopscale's loop.

Appendix B of the paper trains this architecture from scratch and swaps its per-step norm for
readout variants. The network is `loopscale.model.LoopedLM` with model.arch=ouro; its state
dicts carry the published parameter names, so a Hugging Face Ouro checkpoint loads by name,
without remote code. This module holds the Hugging Face I/O and the evaluations of the Ouro
track; the architecture, its readouts and the one deliberate difference from the official
wrappers (the last step is an argument, not a call counter) are in docs/ouro.md.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import LIMITS, ConfigError, RunConfig, preset_dict
from .io import CheckpointError
from .model import LoopedLM
from .runfiles import FLOAT_DTYPES, INT_DTYPES, read_json, read_safetensors_header


# ---------------------------------------------------------------------------
# Hugging Face checkpoints (config.json + model.safetensors [+ index], as published)
# ---------------------------------------------------------------------------
HF_INDEX = "model.safetensors.index.json"


def is_hf_checkpoint(path: str | Path) -> bool:
    """A directory holding a Hugging Face Ouro checkpoint (config.json with model_type ouro)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "ouro"
    except (ValueError, OSError, AttributeError, RecursionError):  # not JSON, not UTF-8, not a mapping, too deep
        return False


_REQUIRED = object()
# config.json keys of an Ouro checkpoint that are sizes, and the row of config.LIMITS bounding each
_HF_SIZES = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_key_value_heads": "n_heads",
             "head_dim": "d_model", "intermediate_size": "d_ff", "vocab_size": "vocab_size",
             "num_hidden_layers": "n_layers", "total_ut_steps": "n_loops"}


def _hf_int(hf: dict, key: str, default=_REQUIRED) -> int:
    """A size of config.json: a whole number in [1, config.LIMITS[...]] (a string, a bool, 32.7
    or 2^31 is one CheckpointError line, before anything is allocated)."""
    v = hf.get(key)
    if v is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json has no {key!r}: not an Ouro config")
        return default
    hi = LIMITS[_HF_SIZES[key]]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not float(v).is_integer() \
            or not 1 <= v <= hi:
        raise CheckpointError(f"config.json: {key} must be a whole number in [1, {hi}], got {v!r}")
    return int(v)


def _hf_float(hf: dict, key: str, default: float) -> float:
    v = hf.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"config.json: {key} must be a positive number, got {v!r}")
    return float(v)


def config_from_hf(hf: dict, seq_len: int = 2048, readout: str = "rmsnorm") -> RunConfig:
    """The RunConfig of a published Ouro config.json (what it cannot express is refused; a
    wrong-typed or out-of-range value is one CheckpointError line)."""
    if not isinstance(hf, dict):
        raise CheckpointError("config.json must hold a JSON object")
    d, heads = _hf_int(hf, "hidden_size"), _hf_int(hf, "num_attention_heads")
    if _hf_int(hf, "head_dim", d // heads or 1) * heads != d:
        raise CheckpointError(f"config.json: head_dim {hf['head_dim']} x {heads} heads != hidden_size {d} "
                              f"(not supported)")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    rope_cfg = hf.get("rope_scaling") or {}
    if not isinstance(rope_cfg, dict):
        raise CheckpointError(f"config.json: rope_scaling must be an object or null, got {rope_cfg!r}")
    rope_type = rope_cfg.get("rope_type", rope_cfg.get("type", "default"))
    factor = rope_cfg.get("factor", 1)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise CheckpointError(f"config.json: rope_scaling.factor must be a number, got {factor!r}")
    if rope_type not in ("default",) and not (rope_type == "linear" and float(factor) == 1.0):
        raise CheckpointError(f"config.json: rope_scaling {rope_cfg!r} is not supported (only plain RoPE)")
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope_parameters must be an object, got {params!r}")
    theta = _hf_float(hf, "rope_theta", _hf_float(params, "rope_theta", 10000.0))
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise CheckpointError(f"config.json: layer_types must be a list of names, got {layer_types!r}"[:200])
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise CheckpointError("config.json: sliding-window attention is not supported")
    vocab = _hf_int(hf, "vocab_size")
    base = preset_dict("ouro-1.4b")
    base["model"].update(vocab_size=vocab, d_model=d, n_layers=_hf_int(hf, "num_hidden_layers"), n_heads=heads,
                         n_kv_heads=_hf_int(hf, "num_key_value_heads", heads), d_ff=_hf_int(hf, "intermediate_size"),
                         seq_len=int(seq_len), n_loops=_hf_int(hf, "total_ut_steps", 4),
                         norm_eps=_hf_float(hf, "rms_norm_eps", 1e-6), rope_theta=theta, readout=readout,
                         dropout=0.0)
    # the data section only describes the vocabulary (the checkpoint's tokenizer is tokenizer.json)
    base["data"].update(vocab_size=min(vocab, 65535), tokenizer="bpe" if vocab >= 260 else "word",
                        tokenization="joined")
    try:
        return RunConfig.from_dict(base)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from None


def hf_weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint directory: model.safetensors, or the
    shards its index json names, each a plain relative name inside the directory (an absolute
    path or one through `..` is refused: a checkpoint never reads files outside itself)."""
    run = Path(path)
    index = run / HF_INDEX
    if index.is_file():
        doc = read_json(index, "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()):
            raise CheckpointError(f"{index} is not a safetensors index (a weight_map of tensor names to file names)")
        files = []
        for f in sorted(set(weight_map.values())):
            rel = Path(f)
            if rel.is_absolute() or ".." in rel.parts or f.startswith(("/", "\\")) or ":" in rel.parts[0]:
                raise CheckpointError(f"{index} names the shard {f!r}, outside the checkpoint directory {run}")
            files.append(run / rel)
        return files
    if (run / "model.safetensors").is_file():
        return [run / "model.safetensors"]
    raise CheckpointError(f"{run} has neither model.safetensors nor {HF_INDEX}")


def hf_headers(path: str | Path) -> dict[str, tuple[Path, dict]]:
    """{tensor name: (its file, its header entry)} of every weight file, read without the
    tensors; a tensor that two files hold is refused (which one counts would be arbitrary)."""
    out: dict[str, tuple[Path, dict]] = {}
    for f in hf_weight_files(path):
        if not f.is_file():
            raise CheckpointError(f"{f} (named by {HF_INDEX}) is missing")
        for k, info in read_safetensors_header(f).items():
            if k == "__metadata__":
                continue
            if k in out:
                raise CheckpointError(f"{k} is held twice, by {out[k][0].name} and {f.name}: "
                                      f"an ambiguous checkpoint (each tensor must be in one file)")
            out[k] = (f, info)
    return out


def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards an index json names (confined to the
    directory, each tensor in one file)."""
    from safetensors import safe_open
    state = {}
    headers = hf_headers(path)
    for f in sorted({f for f, _ in headers.values()}):
        try:
            with safe_open(str(f), framework="pt") as h:
                state.update({k: h.get_tensor(k) for k in h.keys()})
        except Exception as e:
            raise CheckpointError(f"{f} is truncated or corrupted ({type(e).__name__})") from None
    return state


# tensors of published checkpoints that loopscale's Ouro does not use (other gate kinds)
_UNUSED = ("model.lookahead_exit_gate.", "model.preloop_exit_gate.", "model.rotary_emb.")


def load_state(model: LoopedLM, state: dict[str, torch.Tensor], where: str, tied: bool = False) -> None:
    """Load published (or official-trainer) tensors by name, strictly: a missing or extra
    tensor is a one-line CheckpointError."""
    state = {_official_name(k): v for k, v in state.items() if not k.startswith(_UNUSED)}
    if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    own = model.state_dict()
    # the official AlphaReadout keeps no EMA counter (loopscale's, unused with a learned s_ref)
    state.update({k: v for k, v in own.items() if k.endswith(".ema_count") and k not in state})
    _check_names(own, state, where, model.cfg.readout)
    for k, v in state.items():
        check_tensor(k, tuple(v.shape), v.dtype, own[k], where)
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{where}: {k} holds non-finite values (NaN or inf): corrupted weights")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


def _check_names(own: dict, state: dict, where: str, readout: str) -> None:
    """A tensor the model has and `state` lacks, or the other way round: one CheckpointError line."""
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        what = f"misses {missing[0]}" if missing else f"has {extra[0]}, unknown to model.readout={readout}"
        raise CheckpointError(f"{where} {what} ({len(missing)} missing, {len(extra)} unexpected tensors)")


def check_tensor(k: str, shape: tuple, dtype: torch.dtype, own: torch.Tensor, where: str) -> None:
    """A checkpoint tensor against the model's own: the same shape, and a float tensor where the
    model holds a float one (a bool or integer weight would be cast silently), an integer
    buffer of the model's dtype otherwise."""
    if tuple(shape) != tuple(own.shape):
        raise CheckpointError(f"{where}: {k} has shape {tuple(shape)}, the config needs {tuple(own.shape)}")
    if own.dtype.is_floating_point and not dtype.is_floating_point:
        raise CheckpointError(f"{where}: {k} is {str(dtype).removeprefix('torch.')}, not a float tensor "
                              f"(a weight must be float)")
    if not own.dtype.is_floating_point and dtype != own.dtype:
        raise CheckpointError(f"{where}: {k} is {str(dtype).removeprefix('torch.')}, but the model holds it "
                              f"as {str(own.dtype).removeprefix('torch.')}")


def _official_name(k: str) -> str:
    """The official trainer's wrapped-norm names (ConditionalNorm & co. hold the published norm
    as `.norm`) -> loopscale's; torch.compile's prefix dropped."""
    k = k.removeprefix("_orig_mod.")
    for old, new in (("model.norm.norm.", "model.norm."), ("model.norm.alpha_readout.", "model.alpha_readout."),
                     ("model.norm.alpha_readouts.", "model.alpha_readouts.")):
        if k.startswith(old):
            return new + k[len(old):]
    return k


def from_pretrained(path: str | Path, *, seq_len: int = 2048,
                    device: str | torch.device = "cpu") -> tuple[LoopedLM, RunConfig]:
    """(model in eval mode, its RunConfig) of a Hugging Face Ouro checkpoint directory
    (ByteDance/Ouro-1.4B, Ouro-2.6B once downloaded), loaded by the published parameter names."""
    run = Path(path)
    if not run.is_dir():
        raise CheckpointError(f"checkpoint directory {run} not found")
    if not (run / "config.json").is_file():
        raise CheckpointError(f"{run / 'config.json'} is missing")
    hf = read_json(run / "config.json", "Ouro config")
    if not isinstance(hf, dict) or hf.get("model_type") != "ouro":
        raise CheckpointError(f"{run / 'config.json'}: model_type is {hf.get('model_type') if isinstance(hf, dict) else None!r}, "
                              f"not 'ouro'")
    cfg = config_from_hf(hf, seq_len=seq_len)
    tied = bool(hf.get("tie_word_embeddings", False))
    with torch.device("meta"):
        model = LoopedLM(cfg.model)
    # every tensor's name, shape and dtype from the files' headers before anything is allocated
    dtypes = {**FLOAT_DTYPES, **INT_DTYPES}
    meta_state = {_official_name(k): (tuple(info["shape"]), dtypes[info["dtype"]])
                  for k, (_, info) in hf_headers(run).items() if not k.startswith(_UNUSED)}
    own = model.state_dict()
    if tied and "lm_head.weight" not in meta_state and "model.embed_tokens.weight" in meta_state:
        meta_state["lm_head.weight"] = meta_state["model.embed_tokens.weight"]
    for k, (shape, dtype) in meta_state.items():
        if k in own:
            check_tensor(k, shape, dtype, own[k], str(run))
    _check_names(own, {**{k: None for k in own if k.endswith(".ema_count")}, **meta_state}, str(run), cfg.model.readout)
    model = model.to_empty(device="cpu")
    load_state(model, read_hf_state(run), str(run), tied=tied)
    return model.to(device).eval(), cfg


def save_pretrained(model: LoopedLM, path: str | Path, shard_tensors: int = 0) -> Path:
    """Write the model as a Hugging Face Ouro checkpoint directory: config.json (published keys)
    and model.safetensors, or with `shard_tensors` > 0 shards of that many tensors plus the
    index json. The published model has the plain per-step norm only."""
    from safetensors.torch import save_file
    if model.cfg.readout != "rmsnorm":
        raise ValueError(f"only the published readout (rmsnorm) has a Hugging Face layout, got {model.cfg.readout!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    m = model.cfg
    hf = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_size": m.d_model,
          "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
          "num_key_value_heads": m.n_kv_heads or m.n_heads, "head_dim": m.d_model // m.n_heads,
          "intermediate_size": m.d_ff, "vocab_size": m.vocab_size, "max_position_embeddings": max(m.seq_len, 2048),
          "rope_theta": m.rope_theta, "rope_scaling": None, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
          "tie_word_embeddings": False, "total_ut_steps": m.n_loops, "use_sliding_window": False,
          "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if shard_tensors <= 0:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    names = sorted(tensors)
    groups = [names[i:i + shard_tensors] for i in range(0, len(names), shard_tensors)]
    weight_map = {}
    for i, g in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in g}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in g})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out


# ---------------------------------------------------------------------------
# evaluations of the Ouro track
# ---------------------------------------------------------------------------
def _ce_sums(model, windows: torch.Tensor, batch_size: int, readouts) -> tuple[torch.Tensor, int]:
    """The summed next-token CE (float64) of each logits tensor `readouts(x)` yields, over
    `windows` [N, T+1] in batches, and the number of tokens scored."""
    sums, n = None, 0
    for s in range(0, len(windows), batch_size):
        b = windows[s:s + batch_size].to(model.head_weight.device)
        x, y = b[:, :-1], b[:, 1:]
        ce = [F.cross_entropy(z.float().reshape(-1, z.shape[-1]), y.reshape(-1), reduction="sum").double().cpu()
              for z in readouts(x)]
        sums = torch.stack(ce) if sums is None else sums + torch.stack(ce)
        n += y.numel()
    return sums, n


@torch.inference_mode()
def variable_depth(model, windows: torch.Tensor, depths, batch_size: int = 2) -> list[dict]:
    """CE/PPL of next-token prediction at each depth K' (official `src/eval/ouro_variable_depth.py`),
    K' steps read with the *final* readout at step K' (the official wrappers would read step K).
    `windows` [N, T+1] token ids."""
    depths = sorted(set(int(k) for k in depths))
    ce_sum, n = _ce_sums(model, windows, batch_size,
                         lambda x: (model.logits(model(x, n_loops=K)[-1], final=True, k=K) for K in depths))
    return [{"K": K, "ce": float(ce_sum[i] / n), "ppl": float(math.exp(min(ce_sum[i] / n, 50)))}
            for i, K in enumerate(depths)]


@torch.inference_mode()
def scale_sensitivity(model, windows: torch.Tensor, scales, batch_size: int = 2) -> list[dict]:
    """CE when the *pre*-readout state of the last step is scaled, r(c·H_K) (the paper's
    scale-sensitivity figure on Ouro, made by its notebook; the deprecated
    `src/eval/ouro_scale_sensitivity.py` scaled after the norm). A scale-invariant readout
    gives the same CE at every c."""
    scales = [float(c) for c in scales]

    def readouts(x):
        h = model(x)[-1]
        return (model.logits(c * h, final=True, k=model.cfg.n_loops) for c in scales)
    ce_sum, n = _ce_sums(model, windows, batch_size, readouts)
    return [{"scale": c, "ce": float(ce_sum[i] / n)} for i, c in enumerate(scales)]
