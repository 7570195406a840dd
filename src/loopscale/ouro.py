"""The Ouro architecture (ByteDance's published looped LM), in loopscale's loop.

Appendix B of the paper trains this architecture from scratch (official
`src/train_ouro_from_scratch_ddp.py`) and swaps its per-step norm for readout variants.
As published (config `model_type: ouro`, class `OuroForCausalLM`):

  x_1   = embed_tokens(ids)                                no position embedding: RoPE in attention
  loop  = the shared stack of `n_layers` decoder layers, each a sandwich-norm block
            a = x + input_layernorm_2(attn(input_layernorm(x)))
            y = a + post_attention_layernorm_2(mlp(post_attention_layernorm(a)))
          attention: q/k/v/o projections, no biases, RoPE (rotate-half), grouped key/value heads;
          mlp: down(silu(gate(x)) * up(x)) (SwiGLU)
  H_k   = loop(x_k)                                        the state before any norm (diagnostics measure it)
  x_k+1 = model.norm(H_k)                                  the same RMSNorm is the inter-step norm ...
  logits_k = lm_head(model.norm(H_k))                      ... and the readout; lm_head is untied
  gate  λ_k = σ(early_exit_gate(model.norm(H_k)))          per-token exit hazard (Linear d -> 1)

So Ouro's recurrence is loopscale's `inter_loop_norm` and its readout `rmsnorm`, with one norm
module for both. The readout variants of the official trainer replace that norm
(loopscale.registry.OURO_READOUTS):

  rmsnorm         the published per-step norm
  final_raw       model.norm at steps k < K, the raw state at step K (official ConditionalNorm)
  final_alpha     model.norm at steps k < K, an AlphaReadout at step K (official ConditionalAlphaReadout)
  per_loop_alpha  an AlphaReadout of its own per step, fed forward too (official PerLoopAlphaReadout)

The official wrappers pick the "last" step by counting calls modulo the training K, so at an
evaluation depth K' != K the raw/alpha readout falls on step K (and 2K, ...), not on K'. Here
the last step of the pass is always step K' ("final" is an argument, not a counter).

Module names follow the published parameter names (`model.layers.0.self_attn.q_proj.weight`,
`model.norm.weight`, `model.early_exit_gate.bias`, `lm_head.weight`, ...), so a Hugging Face
Ouro checkpoint loads by name (`from_pretrained`), without remote code.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import LIMITS, ConfigError, ModelConfig, RunConfig, preset_dict
from .io import CheckpointError
from .runfiles import FLOAT_DTYPES, INT_DTYPES, read_json, read_safetensors_header
from .readouts import AlphaReadout
from .registry import GATED_LOSSES, readout_spec


class RMSNorm(nn.Module):
    """RMSNorm as Ouro computes it: in fp32, cast back to the input dtype, then the gain."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Rotary position embedding (the rotate-half form) of x [B, heads, T, head_dim] at
    positions start..start+T-1; the angles are computed in fp32."""
    T, hd = x.shape[2], x.shape[3]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(start, start + T, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class OuroAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.head_dim, self.theta, self.dropout = cfg.d_model // cfg.n_heads, cfg.rope_theta, cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:  # cache: a loopscale.model.KVCache
        B, T, _ = x.shape
        past = 0 if cache is None else len(cache)
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rope(q, past, self.theta), rope(k, past, self.theta)
        mask = None
        if cache is not None:
            k, v = cache.append(k, v)
            if past and T > 1:
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        if self.n_kv != self.n_heads:  # each key/value head serves n_heads / n_kv query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class OuroMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    """The sandwich-norm block: a norm before and after attention, and before and after the MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = OuroAttention(cfg)
        self.mlp = OuroMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.input_layernorm_2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), cache))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroBackbone(nn.Module):
    """`model.*` of the published checkpoint: embedding, layers, step norm, exit gate (and the
    alpha readouts of the Ouro track's variants, which the published model lacks)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.n_layers))
        spec = readout_spec(cfg.readout)
        alpha = dict(init_alpha=cfg.alpha_init, fixed_alpha=cfg.alpha_fixed, s_ref="learned", eps=cfg.norm_eps)
        self.norm = None if getattr(spec, "per_loop", False) else RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.readout == "final_alpha":
            self.alpha_readout = AlphaReadout(cfg.d_model, **alpha)
        if cfg.readout == "per_loop_alpha":
            self.alpha_readouts = nn.ModuleList(AlphaReadout(cfg.d_model, **alpha) for _ in range(cfg.n_loops))
        self.early_exit_gate = nn.Linear(cfg.d_model, 1)


class OuroLM(nn.Module):
    """Ouro with loopscale's loop interface (`embed` / `loop` / `feed` / `readout` / `logits`),
    so training, the diagnostics, halting and generation drive it as they drive LoopedLM."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.arch != "ouro":
            raise ConfigError(f"OuroLM needs model.arch=ouro, got {cfg.arch!r}")
        self.cfg = cfg
        self.readout_spec = readout_spec(cfg.readout)
        self.model = OuroBackbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied
        self.checkpoint_blocks = False
        if cfg.init == "gpt2":  # Hugging Face's init of Ouro: N(0, 0.02) weights, zero biases
            self.apply(_init_weights)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- the loop -------------------------------------------------------------------------
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The input of step 1: the token embedding (positions enter through RoPE)."""
        return self.model.embed_tokens(idx)

    def loop(self, x: torch.Tensor, caches: Optional[list] = None) -> torch.Tensor:
        """One recurrent step: the shared layers once. Returns H_k before any norm.

        `caches` (generation): this step's loopscale.model.KVCache of every layer, extended in place."""
        for i, layer in enumerate(self.model.layers):
            if caches is not None:
                x = layer(x, caches[i])
            elif self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x

    def _step_norm(self, h: torch.Tensor, k: Optional[int]) -> torch.Tensor:
        """The norm of a step k < K: model.norm, or step k's own alpha readout (per-loop)."""
        if self.model.norm is not None:
            return self.model.norm(h)
        if k is None:
            raise ValueError("the per_loop_alpha readout needs the step k (model.feed(h, k=...))")
        return self.model.alpha_readouts[min(k, self.cfg.n_loops) - 1](h)

    def feed(self, h: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
        """What step k+1 receives from H_k: the step norm (Ouro always normalises between steps)."""
        return self._step_norm(h, k)

    def readout(self, h: torch.Tensor, final: bool = True, k: Optional[int] = None) -> torch.Tensor:
        """r(H_k): what the head reads; `final` marks the last step of the pass."""
        name = self.cfg.readout
        if not final or name == "rmsnorm":
            return self._step_norm(h, k)
        if name == "final_raw":
            return h
        if name == "final_alpha":
            return self.model.alpha_readout(h)
        return self.model.alpha_readouts[-1](h)  # per_loop_alpha: the last step's readout

    def logits(self, h: torch.Tensor, final: bool = True, k: Optional[int] = None) -> torch.Tensor:
        return self.lm_head(self.readout(h, final, k))

    def forward(self, idx: torch.Tensor, n_loops: int | None = None, state_fn=None) -> list[torch.Tensor]:
        """[H_1, ..., H_n] of `n_loops` steps (default K), each before any norm; `state_fn(k, x_in, h)`
        (diagnostics) may replace step k's output."""
        n_loops = self.cfg.n_loops if n_loops is None else n_loops
        x = self.embed(idx)
        states = []
        for k in range(1, n_loops + 1):
            h = self.loop(x)
            if state_fn is not None:
                h = state_fn(k, x, h)
            states.append(h)
            x = self.feed(h, k)
        return states

    def set_objective(self, objective) -> None:
        """Training calls this before wrapping the model for data parallelism: the exit gate
        learns only under a loss that reads it (registry.GATED_LOSSES: adaptive); otherwise it
        is frozen, as DDP refuses parameters that get no gradient."""
        self.model.early_exit_gate.requires_grad_(getattr(objective, "loss", None) in GATED_LOSSES)

    def schedule(self, step: int, total_steps: int) -> None:
        """Settings that follow the training step: none in Ouro (the trainer's hook)."""

    # -- the exit gate ----------------------------------------------------------------------
    def exit_distribution(self, states: list[torch.Tensor]) -> torch.Tensor:
        """p(exit at step k) per token, [..., K]: hazards λ_k = σ(gate(r(H_k))) for k < K,
        p_k = λ_k Π_{j<k}(1 − λ_j), and the last step takes the remaining mass (computed in fp32)."""
        K = len(states)
        remaining = torch.ones(states[0].shape[:-1], dtype=torch.float32, device=states[0].device)
        pdf = []
        for k, h in enumerate(states, start=1):
            if k == K:
                pdf.append(remaining)
                break
            lam = torch.sigmoid(self.model.early_exit_gate(self.readout(h, False, k)).squeeze(-1).float())
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        return torch.stack(pdf, dim=-1)


    def exit_pdf(self, states: list[torch.Tensor]) -> torch.Tensor:
        """`exit_distribution` with the steps first, [K, ...] (the layout of an adaptive loss
        that weighs each exit's per-token CE by p_k)."""
        return self.exit_distribution(states).movedim(-1, 0)


def exit_loss(ce: torch.Tensor, pdf: torch.Tensor, beta: float) -> torch.Tensor:
    """Ouro's entropy-regularised expected loss over exit steps: mean over tokens of
    Σ_k p_k·CE_k − β·H(p), H(p) = −Σ_k p_k log p_k. `ce` and `pdf` are [..., K]."""
    ent = -(pdf * pdf.clamp_min(1e-12).log()).sum(-1)
    return ((pdf * ce).sum(-1) - beta * ent).mean()


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


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
                for k in h.keys():
                    state[k] = h.get_tensor(k)
        except Exception as e:
            raise CheckpointError(f"{f} is truncated or corrupted ({type(e).__name__})") from None
    return state


# tensors of published checkpoints that loopscale's Ouro does not use (other gate kinds)
_UNUSED = ("model.lookahead_exit_gate.", "model.preloop_exit_gate.", "model.rotary_emb.")


def load_state(model: OuroLM, state: dict[str, torch.Tensor], where: str, tied: bool = False) -> None:
    """Load published (or official-trainer) tensors by name, strictly: a missing or extra
    tensor is a one-line CheckpointError."""
    state = {_official_name(k): v for k, v in state.items() if not k.startswith(_UNUSED)}
    if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    own = model.state_dict()
    for k in own:  # the official AlphaReadout keeps no EMA counter (loopscale's, unused with a learned s_ref)
        if k.endswith(".ema_count") and k not in state:
            state[k] = own[k]
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        what = f"misses {missing[0]}" if missing else f"has {extra[0]}, unknown to model.readout={model.cfg.readout}"
        raise CheckpointError(f"{where} {what} ({len(missing)} missing, {len(extra)} unexpected tensors)")
    for k, v in state.items():
        check_tensor(k, tuple(v.shape), v.dtype, own[k], where)
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{where}: {k} holds non-finite values (NaN or inf): corrupted weights")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


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


def from_pretrained(path: str | Path, *, seq_len: int = 2048, n_loops: Optional[int] = None,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> tuple[OuroLM, RunConfig]:
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
    if n_loops is not None:
        if isinstance(n_loops, bool) or not isinstance(n_loops, int) or not 1 <= n_loops <= LIMITS["n_loops"]:
            raise CheckpointError(f"n_loops must be an integer in [1, {LIMITS['n_loops']}], got {n_loops!r}")
        cfg.model.n_loops = int(n_loops)
    tied = bool(hf.get("tie_word_embeddings", False))
    with torch.device("meta"):
        model = OuroLM(cfg.model)
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
    missing, extra = sorted(set(own) - set(meta_state)), sorted(set(meta_state) - set(own))
    missing = [k for k in missing if not k.endswith(".ema_count")]
    if missing or extra:
        what = f"misses {missing[0]}" if missing else f"has {extra[0]}, unknown to model.readout={cfg.model.readout}"
        raise CheckpointError(f"{run} {what} ({len(missing)} missing, {len(extra)} unexpected tensors)")
    model = model.to_empty(device="cpu")
    load_state(model, read_hf_state(run), str(run), tied=tied)
    return model.to(device=device, dtype=dtype).eval(), cfg


def save_pretrained(model: OuroLM, path: str | Path, shard_tensors: int = 0) -> Path:
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


def count_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return OuroLM(cfg).num_params()


def flops_per_token(cfg: ModelConfig, n_loops: Optional[int] = None, seq_len: Optional[int] = None) -> int:
    """Forward matmul FLOPs per token (2 per multiply-add): the layers once per step, the
    untied head once (the published model reads only the last step), causal attention."""
    K = cfg.n_loops if n_loops is None else n_loops
    T = cfg.seq_len if seq_len is None else seq_len
    d, f, kv = cfg.d_model, cfg.d_ff, (cfg.n_kv_heads or cfg.n_heads) * (cfg.d_model // cfg.n_heads)
    per_layer = 2 * (2 * d * d + 2 * d * kv + 3 * d * f) + 2 * 2 * T * d / 2
    return int(K * cfg.n_layers * per_layer + 2 * d * cfg.vocab_size)


# ---------------------------------------------------------------------------
# evaluations of the Ouro track
# ---------------------------------------------------------------------------
@torch.inference_mode()
def variable_depth(model, windows: torch.Tensor, depths, batch_size: int = 2) -> list[dict]:
    """CE/PPL of next-token prediction at each depth K' (official `src/eval/ouro_variable_depth.py`),
    K' steps read with the *final* readout at step K' (the official wrappers would read step K).
    `windows` [N, T+1] token ids; one pass of max(depths) steps serves every depth."""
    depths = sorted(set(int(k) for k in depths))
    ce_sum, n = torch.zeros(len(depths), dtype=torch.float64), 0
    dev = model.head_weight.device
    for s in range(0, len(windows), batch_size):
        b = windows[s:s + batch_size].to(dev)
        x, y = b[:, :-1], b[:, 1:]
        for i, K in enumerate(depths):
            h = model(x, n_loops=K)[-1]
            z = model.logits(h, final=True, k=K).float()
            ce_sum[i] += F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="sum").double().cpu()
        n += y.numel()
    return [{"K": K, "ce": float(ce_sum[i] / n), "ppl": float(math.exp(min(ce_sum[i] / n, 50)))}
            for i, K in enumerate(depths)]


@torch.inference_mode()
def scale_sensitivity(model, windows: torch.Tensor, scales, batch_size: int = 2) -> list[dict]:
    """CE when the *pre*-readout state of the last step is scaled, r(c·H_K) (the paper's
    scale-sensitivity figure on Ouro, made by its notebook; the deprecated
    `src/eval/ouro_scale_sensitivity.py` scaled after the norm). A scale-invariant readout
    gives the same CE at every c."""
    scales = [float(c) for c in scales]
    ce_sum, n = torch.zeros(len(scales), dtype=torch.float64), 0
    dev = model.head_weight.device
    for s in range(0, len(windows), batch_size):
        b = windows[s:s + batch_size].to(dev)
        x, y = b[:, :-1], b[:, 1:]
        h = model(x)[-1]
        for i, c in enumerate(scales):
            z = model.logits(c * h, final=True, k=model.cfg.n_loops).float()
            ce_sum[i] += F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="sum").double().cpu()
        n += y.numel()
    return [{"scale": c, "ce": float(ce_sum[i] / n)} for i, c in enumerate(scales)]
