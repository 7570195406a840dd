"""LoopedLM against the paper's block written out by hand, and the paper's dropout sites.

The reference below reads the weights by name from LoopedLM's state dict and recomputes the
forward pass with explicit q/k/v projections, softmax attention and a SwiGLU with separate
w1 (gate), w3 (up) and w2 (down) matrices: per-loop logits must agree within rounding.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from loopscale.config import preset
from loopscale.model import LoopedLM


def build(readout, recurrence, dtype, dropout=0.0):
    cfg = preset("smoke", {"model": {"readout": readout, "recurrence": recurrence, "n_layers": 2, "n_heads": 2,
                                     "dropout": dropout}})
    torch.manual_seed(0)
    return LoopedLM(cfg.model).to(dtype), cfg.model


def rms(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def reference_logits(sd, cfg, idx):
    """The paper's looped LM, eval mode: [logits_1, ..., logits_K]."""
    d, h, f, eps = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.norm_eps
    T = idx.shape[1]
    x = sd["tok_emb.weight"][idx] + sd["pos_emb.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = []
    for k in range(1, cfg.n_loops + 1):
        for i in range(cfg.n_layers):
            p = lambda name: sd[f"blocks.{i}.{name}"]  # noqa: E731
            wq, wk, wv = p("attn.qkv.weight").split(d)
            a = rms(x, p("norm1.weight"), eps)
            q, kk, v = (t.view(*t.shape[:2], h, d // h).transpose(1, 2) for t in (a @ wq.T, a @ wk.T, a @ wv.T))
            scores = (q @ kk.transpose(-1, -2)) / math.sqrt(d // h)
            att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(x.shape)
            x = x + y @ p("attn.proj.weight").T
            w1, w3 = p("mlp.gate_up.weight").split(f)  # gate, up
            m = rms(x, p("norm2.weight"), eps)
            x = x + (F.silu(m @ w1.T) * (m @ w3.T)) @ p("mlp.down.weight").T
        hk = x
        if cfg.readout == "raw" or (cfg.readout == "final_norm" and k < cfg.n_loops):
            r = hk
        else:
            r = rms(hk, sd["readout_norm.weight"], eps)
        out.append(r @ sd["tok_emb.weight"].T)
        if cfg.recurrence == "inter_loop_norm":
            x = rms(hk, sd["loop_norm.weight"], eps)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("readout,recurrence", [("rmsnorm", "residual"), ("raw", "residual"),
                                                ("final_norm", "residual"), ("rmsnorm", "inter_loop_norm")])
def test_per_loop_logits_equal_the_reference(readout, recurrence, dtype, tol):
    model, cfg = build(readout, recurrence, dtype)
    model.eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = [model.logits(h, final=(k == cfg.n_loops - 1)) for k, h in enumerate(model(idx))]
        ref = reference_logits(model.state_dict(), cfg, idx)
    assert len(ours) == len(ref) == cfg.n_loops
    for k, (a, b) in enumerate(zip(ours, ref), start=1):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel <= tol, f"exit {k}: relative difference {rel:.2e} > {tol:.0e}"


def test_reference_detects_a_changed_block():
    # the comparison is sharp: an extra residual scaling in one block breaks it
    model, cfg = build("raw", "residual", torch.float64)
    model.eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["blocks.1.mlp.down.weight"] *= 1.001
    with torch.no_grad():
        a = model.logits(model(idx)[-1])
        b = reference_logits(sd, cfg, idx)[-1]
    assert ((a - b).abs().max() / b.abs().max()).item() > 1e-6


def count_dropout_sites(model, cfg, monkeypatch):
    """Dropout calls of one training forward: nn.Dropout modules by name, functional
    dropouts, and SDPA calls with their dropout_p."""
    modules, functional, sdpa = [], [], []
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(lambda mod, i, o, name=name: modules.append(name))
    real_dropout, real_sdpa = F.dropout, F.scaled_dot_product_attention

    def dropout(x, p=0.5, training=True, inplace=False):
        functional.append(p if training else 0.0)
        return real_dropout(x, p, training, inplace)

    def attention(*a, dropout_p=0.0, **kw):
        sdpa.append(dropout_p)
        return real_sdpa(*a, dropout_p=dropout_p, **kw)
    monkeypatch.setattr(F, "dropout", dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    model.train()
    model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    return modules, functional, sdpa


@pytest.mark.parametrize("recurrence", ["residual", "inter_loop_norm"])
def test_dropout_only_at_the_papers_three_sites(recurrence, monkeypatch):
    model, cfg = build("rmsnorm", recurrence, torch.float32, dropout=0.1)
    modules, functional, sdpa = count_dropout_sites(model, cfg, monkeypatch)
    calls = cfg.n_loops * cfg.n_layers  # block calls per forward
    # the embedding sum once, then the SwiGLU output once per block call
    assert modules == ["drop"] + [f"blocks.{i}.drop" for _ in range(cfg.n_loops) for i in range(cfg.n_layers)]
    assert functional == [0.1] * (1 + calls)  # no other (functional) dropout anywhere
    assert sdpa == [0.1] * calls  # attention probabilities, once per block call
    model.eval()
    modules.clear(), functional.clear(), sdpa.clear()
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    assert set(sdpa) == {0.0} and set(functional) <= {0.0}
