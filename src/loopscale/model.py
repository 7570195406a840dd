"""The looped language model, in one file: one `LoopedLM` whose architecture is settings.

One shared stack of decoder blocks is applied K times; after loop k the state H_k is both read
out (logits_k = head(r(H_k)); the readouts: loopscale.registry.READOUTS) and fed back through
the recurrence. The rest of the network is an `Architecture` of `ARCHITECTURES` (`looped`, the
paper's Section 3 setup; `ouro`, Appendix B). The readout and architecture tables:
docs/architecture.md, "Inside the core modules".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .readouts import build_norm, drive_tapers
from .registry import GATED_LOSSES, READOUTS


@dataclass(frozen=True)
class Architecture:
    """What distinguishes a family of looped decoders (the run settings are ModelConfig's)."""
    name: str
    positions: str  # "learned": a position table added to the embedding | "rope": rotary, in attention
    sandwich: bool  # a norm after attention and after the MLP too (else pre-norm only)
    fp32_norm: bool  # RMSNorm computed in fp32, cast back, then the gain (else nn.RMSNorm)
    tied_head: bool  # the head is the token embedding (else a Linear of its own, lm_head)
    shared_step_norm: bool  # the inter-loop norm is also the readout of the exits k < K (model.recurrence unread)
    gate_on_readout: bool  # the exit gate reads r(H_k) at exit k, in fp32 (else H_k)
    always_gated: bool  # the model holds an exit gate whatever model.exit_gate says
    residual_dropout: bool  # dropout on the embedding sum and the MLP output (attention's always)
    zero_bias_init: bool  # init=gpt2 zeroes the biases too (Hugging Face's init)
    official_alpha: bool  # alpha readouts as the official Ouro trainer builds them (s_ref learned)
    published_names: bool  # state dicts use the published Ouro parameter names


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("looped", positions="learned", sandwich=False, fp32_norm=False, tied_head=True,
                 shared_step_norm=False, gate_on_readout=False, always_gated=False, residual_dropout=True,
                 zero_bias_init=False, official_alpha=False, published_names=False),
    Architecture("ouro", positions="rope", sandwich=True, fp32_norm=True, tied_head=False,
                 shared_step_norm=True, gate_on_readout=True, always_gated=True, residual_dropout=False,
                 zero_bias_init=True, official_alpha=True, published_names=True),
)}


def architecture(cfg: ModelConfig) -> Architecture:
    return ARCHITECTURES[getattr(cfg, "arch", "looped")]


def rms_norm(cfg: ModelConfig) -> nn.Module:
    """The architecture's RMSNorm (blocks, inter-loop norm)."""
    return build_norm("rmsnorm", cfg, fp32=architecture(cfg).fp32_norm)


def rope(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Rotary position embedding (the rotate-half form) of x [B, heads, T, head_dim] at
    positions start..start+T-1; the angles are computed in fp32."""
    T, hd = x.shape[2], x.shape[3]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(start, start + T, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class KVCache:
    """Keys and values of the positions seen so far, for one (loop, layer) in generation."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' k, v ([B, kv heads, T, head_dim]); return all of them."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Attention(nn.Module):
    """Causal self-attention, q/k/v from one fused projection; n_kv_heads < n_heads groups the
    key/value heads (each serves n_heads / n_kv_heads query heads); RoPE where the
    architecture says so."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.theta = cfg.rope_theta if architecture(cfg).positions == "rope" else None
        self.sizes = _qkv_sizes(cfg)
        self.qkv = nn.Linear(cfg.d_model, sum(self.sizes), bias=False)  # rows: q, then k, then v
        self.proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, n, self.head_dim).transpose(1, 2)  # [B, heads, T, head_dim]
                   for t, n in zip(self.qkv(x).split(self.sizes, dim=-1), (self.n_heads, self.n_kv, self.n_kv)))
        past = 0 if cache is None else len(cache)
        if self.theta is not None:
            q, k = rope(q, past, self.theta), rope(k, past, self.theta)
        mask = None
        if cache is not None:  # generation: attend to the cached positions too
            k, v = cache.append(k, v)
            if past and T > 1:  # query i sits at position past + i
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        if self.n_kv != self.n_heads:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # fused gate and up
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """A pre-norm block, or a sandwich-norm one (the branch outputs normalised too)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        arch = architecture(cfg)
        self.norm1 = rms_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = rms_norm(cfg)
        self.mlp = SwiGLU(cfg)
        self.attn_out_norm = rms_norm(cfg) if arch.sandwich else None
        self.mlp_out_norm = rms_norm(cfg) if arch.sandwich else None
        self.drop = nn.Dropout(cfg.dropout) if arch.residual_dropout else None  # on the SwiGLU output

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        # the paper drops at three sites: the embedding sum, the attention probabilities
        # (inside Attention) and the SwiGLU output; the attention branch's output is not dropped
        a = self.attn(self.norm1(x), cache)
        x = x + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        m = self.mlp(self.norm2(x))
        if self.mlp_out_norm is not None:
            m = self.mlp_out_norm(m)
        return x + (m if self.drop is None else self.drop(m))


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.arch = arch = architecture(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if arch.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout) if arch.residual_dropout else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))  # the shared stack
        # the readout: the norm of the exits (one shared by every loop, or one per exit), and a
        # module of its own at exit K where its kind differs from the exits' (Ouro's final_alpha)
        self.readout_spec = spec = READOUTS[cfg.readout]
        exit_kind, final_kind, norm = spec.exit_norm, spec.final_norm, spec.norm
        self.per_loop_readout = spec.per_loop or (norm == "alpha" and cfg.alpha_per_loop and not arch.shared_step_norm)

        def make_norm(kind: str) -> nn.Module:
            return build_norm(kind, cfg, fp32=arch.fp32_norm, official=arch.official_alpha)
        self.readout_norm = None if norm is None else \
            nn.ModuleList(make_norm(norm) for _ in range(cfg.n_loops)) if self.per_loop_readout else make_norm(norm)
        self.final_readout = make_norm(final_kind) \
            if None not in (exit_kind, final_kind) and exit_kind != final_kind else None
        # the recurrence (with a shared step norm, the exits' readout is the inter-loop norm and
        # model.recurrence is not read)
        recurrence = None if arch.shared_step_norm else cfg.recurrence
        self.loop_norm = rms_norm(cfg) if recurrence == "inter_loop_norm" else None
        # spectral damping: loop k+1 receives σ(damping_logit)·H_k (σ(2) ≈ 0.88 at the start)
        self.damping_logit = nn.Parameter(torch.tensor(2.0)) if recurrence == "spectral_damping" else None
        gated = cfg.exit_gate or arch.always_gated
        self.exit_gate = nn.Linear(cfg.d_model, 1) if gated else None  # logit of exiting at loop k
        self.lm_head = None if arch.tied_head else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # opt-in activation checkpointing: keep only each block call's input for backward and
        # recompute the block there (one more stack forward; dropout masks replay exactly)
        self.checkpoint_blocks = False
        if cfg.init == "gpt2":
            self.apply(_gpt2_init_zero_bias if arch.zero_bias_init else _gpt2_init)
        if arch.published_names:
            self._register_state_dict_hook(_published_state_dict)
            self._register_load_state_dict_pre_hook(_load_published, with_module=True)

    # -- the loop, in parts (forward, halting and the diagnostics all use these) ----
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The input of loop 1: the token embedding (+ the position embedding, added once, and
        dropout, where the architecture has them; RoPE positions enter in attention).

        `start` is the position of idx's first token (generation with a KV cache)."""
        if self.pos_emb is None:
            x = self.tok_emb(idx)
        else:
            T = start + idx.shape[1]
            if T > self.cfg.seq_len:
                raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(start, T, device=idx.device))
        return x if self.drop is None else self.drop(x)

    def loop(self, x: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """One loop: the shared stack applied once. Returns H_k, before any normalisation.

        `caches` (generation): this loop's KVCache of every layer, extended in place."""
        for i, block in enumerate(self.blocks):
            if caches is not None:
                x = block(x, caches[i])
            elif self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def feed(self, h: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """The recurrence: what loop k+1 receives from H_k (`k`: the loop, needed where each
        loop has its own step norm)."""
        if self.arch.shared_step_norm:
            return self.readout(h, final=False, k=k)  # the step norm, also the exits' readout
        if self.loop_norm is not None:  # inter-loop norm: the scale leaves the loop
            return self.loop_norm(h)
        if self.damping_logit is not None:  # spectral damping: a learned contraction
            return h * torch.sigmoid(self.damping_logit)
        return h

    def forward(self, idx: torch.Tensor, n_loops: int | None = None, state_fn=None) -> list[torch.Tensor]:
        """Run the shared stack `n_loops` times (default K) and return [H_1, ..., H_n].

        Each H_k is the state after loop k, before any normalisation. `state_fn(k, x_in, h)`
        (diagnostics only) may replace loop k's output h, given the loop's input x_in."""
        n_loops = self.cfg.n_loops if n_loops is None else n_loops
        x = self.embed(idx)
        states = []
        for k in range(1, n_loops + 1):
            h = self.loop(x)
            if state_fn is not None:
                h = state_fn(k, x, h)             # inference-time interventions (diagnostics)
            states.append(h)                      # H_k: read out from here
            x = self.feed(h, k)
        return states

    # -- the readout -----------------------------------------------------------
    def readout(self, h: torch.Tensor, final: bool = True, k: int | None = None) -> torch.Tensor:
        """r(H): the normalised (or raw) state that the head reads.

        `final` marks the last exit of the pass (the final-only norm reads the others raw);
        `k` (the exit's loop, 1-based) picks that exit's readout where each exit has its own
        (exits past K use exit K's). Such a model needs `k` at exits k < K."""
        spec = self.readout_spec
        if (spec.final_norm if final else spec.exit_norm) is None:
            return h
        if final and self.final_readout is not None:
            return self.final_readout(h)
        if not self.per_loop_readout:
            return self.readout_norm(h)
        if final and (k is None or spec.per_loop):
            k = self.cfg.n_loops  # Ouro's per-step readouts: the last one at the last step, whatever K'
        if k is None:
            raise ValueError(f"this model has one readout per exit ({self.cfg.readout}): it needs the step k "
                             f"(give the exit's k)")
        return self.readout_norm[min(k, self.cfg.n_loops) - 1](h)

    def logits(self, h: torch.Tensor, final: bool = True, k: int | None = None) -> torch.Tensor:
        return F.linear(self.readout(h, final, k), self.head_weight)

    # -- the exit gate (adaptive loss) ---------------------------------------
    def gate_logits(self, h: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """The exit gate's logit at every position of H_k: [B, T]."""
        if self.exit_gate is None:
            raise ValueError("this model has no exit gate (model.exit_gate)")
        if self.arch.gate_on_readout:
            return self.exit_gate(self.readout(h, False, k)).squeeze(-1).float()
        return self.exit_gate(h).squeeze(-1)

    def exit_pdf(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The exit distribution [K, B, T] of a pass: p_k = λ_k·Π_{j<k}(1-λ_j), λ_k =
        σ(gate(H_k)); the last loop takes the mass left (a survival chain)."""
        return exit_distribution(torch.stack([self.gate_logits(h, k) for k, h in enumerate(states, start=1)]))

    def exit_distribution(self, states: list[torch.Tensor]) -> torch.Tensor:
        """`exit_pdf` with the loops last, [B, T, K]."""
        return self.exit_pdf(states).movedim(0, -1)

    # -- training ---------------------------------------------------------------
    def set_objective(self, objective) -> None:
        """Training calls this before wrapping the model for data parallelism: an always-present
        exit gate (Ouro's) is trained only under a loss that reads it (registry.GATED_LOSSES);
        otherwise its weights become buffers of the same names, as DDP refuses parameters that
        get no gradient."""
        if self.exit_gate is None or not self.arch.always_gated or getattr(objective, "loss", None) in GATED_LOSSES:
            return
        for name, p in list(self.exit_gate.named_parameters(recurse=False)):
            delattr(self.exit_gate, name)
            self.exit_gate.register_buffer(name, p.detach())

    def schedule(self, step: int, total_steps: int) -> None:
        """Settings that follow the training step (TaperNorm's gate); the trainer calls it
        before every step and before validation. A no-op for the other models."""
        drive_tapers(self, step, total_steps, self.cfg.taper_warmup_frac, self.cfg.taper_decay_frac)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    @property
    def model(self) -> "_PublishedView":
        """The published Ouro module names (model.embed_tokens, model.layers, model.norm,
        model.early_exit_gate, model.alpha_readout(s)) as a view of this model's modules."""
        return _PublishedView(self)

    def num_params(self) -> int:
        """Every weight, the exit gate's included where set_objective made it constant."""
        gate = [] if self.exit_gate is None else [b for n, b in self.exit_gate.named_buffers() if n in ("weight", "bias")]
        return sum(p.numel() for p in self.parameters()) + sum(b.numel() for b in gate)


class _PublishedView:
    def __init__(self, m: LoopedLM):
        shared = m.readout_norm if not m.per_loop_readout else None
        self.embed_tokens, self.layers, self.early_exit_gate = m.tok_emb, m.blocks, m.exit_gate
        self.norm = shared if m.arch.shared_step_norm else m.loop_norm
        self.alpha_readout = m.final_readout
        self.alpha_readouts = m.readout_norm if m.per_loop_readout else None


def build_model(cfg: ModelConfig) -> LoopedLM:
    """The model of a config: LoopedLM, whatever `model.arch` (an entry of ARCHITECTURES)."""
    return LoopedLM(cfg)


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """[K, ...] gate logits -> the exit probabilities p_k (they sum to 1 over k)."""
    lam = torch.sigmoid(gate_logits)
    left = torch.cumprod(1.0 - lam, dim=0)  # mass that has not exited after loop k
    survive = torch.cat([torch.ones_like(left[:1]), left[:-1]])  # ... before loop k
    return torch.cat([(lam * survive)[:-1], survive[-1:]])


def _gpt2_init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)


def _gpt2_init_zero_bias(m: nn.Module) -> None:  # Hugging Face's init of Ouro
    _gpt2_init(m)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


# ---------------------------------------------------------------------------
# published parameter names (the Ouro architecture) <-> ours, in one place
# ---------------------------------------------------------------------------
# ours -> published, by prefix (the block's, after "blocks.<i>." / "model.layers.<i>.")
_PUBLISHED_BLOCK = {"norm1.": "input_layernorm.", "attn_out_norm.": "input_layernorm_2.",
                    "norm2.": "post_attention_layernorm.", "mlp_out_norm.": "post_attention_layernorm_2.",
                    "attn.proj.": "self_attn.o_proj.", "mlp.down.": "mlp.down_proj."}
_PUBLISHED_FUSED = {"attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
                    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
_PUBLISHED_TOP = {"tok_emb.": "model.embed_tokens.", "final_readout.": "model.alpha_readout.",
                  "exit_gate.": "model.early_exit_gate.", "lm_head.": "lm_head."}


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    """Widths of q, k and v in the fused projection (k, v: n_kv_heads heads)."""
    hd = cfg.d_model // cfg.n_heads
    return [cfg.n_heads * hd, (cfg.n_kv_heads or cfg.n_heads) * hd, (cfg.n_kv_heads or cfg.n_heads) * hd]


def _split_sizes(name: str, t: torch.Tensor, cfg: ModelConfig) -> list[int]:
    return _qkv_sizes(cfg) if name == "attn.qkv.weight" else [t.shape[0] // 2, t.shape[0] // 2]


def to_published(state: dict, cfg: ModelConfig) -> dict:
    """A state dict in our names -> the published Ouro names (fused projections split)."""
    out = {}
    for k, v in state.items():
        if k.startswith("blocks."):
            i, rest = k[len("blocks."):].split(".", 1)
            p = f"model.layers.{i}."
            if rest in _PUBLISHED_FUSED:
                pieces = v.split(_split_sizes(rest, v, cfg))  # cloned: no two tensors share memory
                out.update(zip((p + n for n in _PUBLISHED_FUSED[rest]), (t.clone() for t in pieces)))
                continue
            old = next(o for o in _PUBLISHED_BLOCK if rest.startswith(o))
            out[p + _PUBLISHED_BLOCK[old] + rest[len(old):]] = v
        elif k.startswith("readout_norm."):  # one step norm, or one alpha readout per step
            rest = k[len("readout_norm."):]
            out[("model.alpha_readouts." if rest[0].isdigit() else "model.norm.") + rest] = v
        else:
            old = next((o for o in _PUBLISHED_TOP if k.startswith(o)), None)
            if old is None:
                raise KeyError(f"{k} has no published name")
            out[_PUBLISHED_TOP[old] + k[len(old):]] = v
    return out


def from_published(state: dict, cfg: ModelConfig) -> dict:
    """A state dict in the published Ouro names -> ours (fused projections concatenated);
    names it does not know are kept, for the strict load to report."""
    out, parts = {}, {}
    inverse_block = {v: k for k, v in _PUBLISHED_BLOCK.items()}
    inverse_fused = {n: (ours, j) for ours, names in _PUBLISHED_FUSED.items() for j, n in enumerate(names)}
    inverse_top = {v: k for k, v in _PUBLISHED_TOP.items()}
    for k, v in state.items():
        if k.startswith("model.layers.") and k.count(".") >= 3:
            i, rest = k[len("model.layers."):].split(".", 1)
            if rest in inverse_fused:
                ours, j = inverse_fused[rest]
                parts.setdefault(f"blocks.{i}.{ours}", {})[j] = (k, v)
                continue
            old = next((o for o in inverse_block if rest.startswith(o)), None)
            out[f"blocks.{i}." + inverse_block[old] + rest[len(old):] if old else k] = v
        elif k.startswith(("model.norm.", "model.alpha_readouts.")):  # the step norm(s) or alpha readouts
            out["readout_norm." + k.split(".", 2)[2]] = v
        else:
            old = next((o for o in inverse_top if k.startswith(o)), None)
            out[inverse_top[old] + k[len(old):] if old else k] = v
    for ours, got in parts.items():
        n = len(_PUBLISHED_FUSED[ours.split(".", 2)[2]])
        if len(got) == n:
            out[ours] = torch.cat([got[j][1] for j in range(n)])
        else:  # a projection missing: keep what there is under its own name (a strict load reports it)
            out.update({name: t for name, t in got.values()})
    return out


def _published_state_dict(module: LoopedLM, state: dict, prefix: str, local_metadata) -> dict:
    ours = {k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
    state.update({prefix + k: v for k, v in to_published(ours, module.cfg).items()})
    return state


def _load_published(module: LoopedLM, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                    errors) -> None:
    mine = {k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
    state.update({prefix + k: v for k, v in from_published(mine, module.cfg).items()})


# ---------------------------------------------------------------------------
# sizes and cost
# ---------------------------------------------------------------------------
def flops_per_token(cfg: ModelConfig, n_loops: int | None = None, n_readouts: int | None = None) -> int:
    """Forward matmul FLOPs per token (2 per multiply-add) of any architecture: the shared stack
    once per loop, the vocabulary head once per readout (what is counted: docs/performance.md)."""
    K = cfg.n_loops if n_loops is None else n_loops
    R = K if n_readouts is None else n_readouts
    T, d, f = cfg.seq_len, cfg.d_model, cfg.d_ff
    kv = (cfg.n_kv_heads or cfg.n_heads) * (d // cfg.n_heads)  # width of k and of v
    per_layer = 2 * (2 * d * d + 2 * d * kv + 3 * d * f) + 2 * 2 * (T / 2) * d
    gate = 2 * d if cfg.exit_gate or architecture(cfg).always_gated else 0
    return int(K * (cfg.n_layers * per_layer + gate) + R * 2 * d * cfg.vocab_size)


def count_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return build_model(cfg).num_params()


if __name__ == "__main__":  # parameter counts of the paper presets
    from .config import preset
    for name in ("paper-44m", "paper-129m", "cpu", "smoke"):
        print(f"{name:>11}: {count_params(preset(name).model) / 1e6:8.2f}M parameters")
