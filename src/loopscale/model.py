"""The looped language model, in one file.

One shared stack of pre-norm decoder blocks is applied K times. After loop k the hidden
state H_k is both *read out* (logits_k = W_emb · r(H_k)) and *fed back* as the input of
loop k+1. Two choices decide the paper's story:

  readout r(·)   rmsnorm | layernorm  scale-invariant: r(αH) = r(H), the loss cannot see ‖H‖
                 raw                  r(H) = H: the loss sees the scale
                 final_norm           final-only norm: raw at exits 1..K-1, RMSNorm at exit K
                 alpha_readout        s_ref^(1-α)·s^α·H/s, s = RMS(H) (loopscale.readouts)
                 tapernorm            gate·RMSNorm(H) + (1-gate)·c·H·w, gate 1 -> 0 in training
  recurrence     residual             H_k feeds loop k+1 as is (paper default)
                 inter_loop_norm      RMSNorm(H_k) feeds loop k+1 (scale removed from the loop)
                 spectral_damping     σ(a)·H_k feeds loop k+1 (a learned scalar)

An optional exit gate (model.exit_gate; the adaptive loss reads it) maps H_k to the logit
of exiting at loop k.

(The readouts are declared in loopscale.registry: which norm at the exits k < K, which at K.)
Everything else follows the paper's setup: learned absolute positions added once, no
biases, SwiGLU MLP, LM head tied to the token embedding, PyTorch default initialisation
(so token embeddings are N(0, 1)).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .readouts import AlphaReadout, TaperNorm, drive_tapers
from .registry import READOUTS


class KVCache:
    """Keys and values of the positions seen so far, for one (loop, layer) in generation."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' k, v ([B, heads, T, head_dim]); return all of them."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)  # fused q, k, v
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        past = 0 if cache is None else len(cache)
        mask = None
        if cache is not None:  # generation: attend to the cached positions too
            k, v = cache.append(k, v)
            if past and T > 1:  # query i sits at position past + i
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # fused gate and up
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)  # on the SwiGLU output only

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        # the paper drops at three sites: the embedding sum, the attention probabilities
        # (inside Attention) and the SwiGLU output; the attention branch's output is not dropped
        x = x + self.attn(self.norm1(x), cache)
        x = x + self.drop(self.mlp(self.norm2(x)))
        return x


def make_norm(kind: str, cfg: ModelConfig) -> nn.Module:
    """A readout norm by its registry name (Readout.exit_norm / final_norm)."""
    if kind == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=False)
    if kind == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    if kind == "alpha":
        return AlphaReadout(cfg.d_model, init_alpha=cfg.alpha_init, fixed_alpha=cfg.alpha_fixed,
                            alpha_min=cfg.alpha_min, alpha_max=cfg.alpha_max, s_ref=cfg.alpha_s_ref,
                            ema_decay=cfg.alpha_ema_decay, init_log_s_ref=cfg.alpha_log_s_ref, eps=cfg.norm_eps)
    if kind == "taper":
        return TaperNorm(cfg.d_model, eps=cfg.norm_eps, ema_decay=cfg.taper_ema_decay)
    raise ValueError(f"unknown readout norm {kind!r}")


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))  # the shared stack
        # one readout norm shared by every loop (absent for the raw readout)
        self.readout_spec = READOUTS[cfg.readout]
        norm = self.readout_spec.norm
        self.per_loop_readout = norm == "alpha" and cfg.alpha_per_loop  # one alpha readout per exit
        self.readout_norm = None if norm is None else \
            nn.ModuleList(make_norm(norm, cfg) for _ in range(cfg.n_loops)) if self.per_loop_readout else \
            make_norm(norm, cfg)
        self.loop_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.recurrence == "inter_loop_norm" else None
        # spectral damping: loop k+1 receives σ(damping_logit)·H_k (σ(2) ≈ 0.88 at the start)
        self.damping_logit = nn.Parameter(torch.tensor(2.0)) if cfg.recurrence == "spectral_damping" else None
        self.exit_gate = nn.Linear(cfg.d_model, 1) if cfg.exit_gate else None  # logit of exiting at loop k
        # opt-in activation checkpointing: keep only each block call's input for backward and
        # recompute the block there (one more stack forward; dropout masks replay exactly)
        self.checkpoint_blocks = False
        if cfg.init == "gpt2":
            self.apply(_gpt2_init)

    # -- the loop, in parts (forward, halting and the diagnostics all use these) ----
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The input of loop 1: token + position embeddings (added once), dropout.

        `start` is the position of idx's first token (generation with a KV cache)."""
        T = start + idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(start, T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

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
        """The recurrence: what loop k+1 receives from H_k (`k`: unused here; per-step readouts
        of other architectures need it)."""
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
            x = self.feed(h)
        return states

    # -- the readout -----------------------------------------------------------
    def readout(self, h: torch.Tensor, final: bool = True, k: int | None = None) -> torch.Tensor:
        """r(H): the normalised (or raw) state that the tied head reads.

        `final` marks the last exit of the pass (the final-only norm reads the others raw);
        `k` (the exit's loop, 1-based) picks that exit's readout where each exit has its own
        (alpha_per_loop; exits past K use exit K's). Such a model needs `k` at exits k < K."""
        norm = self.readout_spec.final_norm if final else self.readout_spec.exit_norm
        if norm is None:
            return h
        if not self.per_loop_readout:
            return self.readout_norm(h)
        if k is None:
            if not final:
                raise ValueError("this model has one readout per exit (alpha_per_loop): give the exit's k")
            k = self.cfg.n_loops
        return self.readout_norm[min(k, self.cfg.n_loops) - 1](h)

    def logits(self, h: torch.Tensor, final: bool = True, k: int | None = None) -> torch.Tensor:
        return F.linear(self.readout(h, final, k), self.tok_emb.weight)  # tied LM head

    # -- the exit gate (adaptive loss) ---------------------------------------
    def gate_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The exit gate's logit at every position of H_k: [B, T]."""
        if self.exit_gate is None:
            raise ValueError("this model has no exit gate (model.exit_gate)")
        return self.exit_gate(h).squeeze(-1)

    def exit_pdf(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The exit distribution [K, B, T] of a pass: p_k = λ_k·Π_{j<k}(1-λ_j), λ_k =
        σ(gate(H_k)); the last loop takes the mass left (a survival chain)."""
        return exit_distribution(torch.stack([self.gate_logits(h) for h in states]))

    # -- the training schedule -------------------------------------------------
    def schedule(self, step: int, total_steps: int) -> None:
        """Settings that follow the training step (TaperNorm's gate); the trainer calls it
        before every step and before validation. A no-op for the other models."""
        drive_tapers(self, step, total_steps, self.cfg.taper_warmup_frac, self.cfg.taper_decay_frac)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_emb.weight

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of `model.arch`: LoopedLM, or the Ouro architecture (loopscale.ouro.OuroLM)."""
    if getattr(cfg, "arch", "looped") == "ouro":
        from .ouro import OuroLM
        return OuroLM(cfg)
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


def flops_per_token(cfg: ModelConfig, n_loops: int | None = None, n_readouts: int | None = None,
                    seq_len: int | None = None) -> int:
    """Forward matmul FLOPs per token (2 per multiply-add): the stack counted once per loop,
    the vocabulary head once per readout, attention scores at the given context length (and
    the exit gate's d-wide dot product once per loop, where the model has one)."""
    K = cfg.n_loops if n_loops is None else n_loops
    R = K if n_readouts is None else n_readouts
    T = cfg.seq_len if seq_len is None else seq_len
    d, f = cfg.d_model, cfg.d_ff
    per_layer = 2 * (3 * d * d + d * d + 3 * d * f) + 2 * 2 * T * d / 2  # projections + causal QK^T, AV
    gate = 2 * d if cfg.exit_gate else 0
    return int(K * (cfg.n_layers * per_layer + gate) + R * 2 * d * cfg.vocab_size)


def count_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return build_model(cfg).num_params()


if __name__ == "__main__":  # parameter counts of the paper presets
    from .config import preset
    for name in ("paper-44m", "paper-129m", "cpu", "smoke"):
        print(f"{name:>11}: {count_params(preset(name).model) / 1e6:8.2f}M parameters")
