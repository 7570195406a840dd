"""One looped model: the Ouro architecture is a setting of LoopedLM (model.ARCHITECTURES), its
state dicts keep the published parameter names (model.to_published / from_published); one FLOP
formula for every architecture; one readout registry whose entries name their architectures."""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from loopscale import registry as R
from loopscale.config import ConfigError, ModelConfig, RunConfig, preset, preset_dict
from loopscale.model import ARCHITECTURES, LoopedLM, build_model, flops_per_token, from_published, to_published

torch.set_num_threads(1)
READOUTS = R.readouts_of("ouro")


@pytest.mark.parametrize("readout", READOUTS)
def test_an_ouro_config_builds_the_one_looped_model(readout):
    """build_model gives LoopedLM for every architecture; an Ouro config's state dict holds the
    published names (the Ouro track's readouts included) and its exits read as Ouro's do."""
    cfg = preset("ouro-tiny", {"model": {"readout": readout}}).model
    torch.manual_seed(0)
    m = build_model(cfg).eval()
    assert type(m) is LoopedLM and m.arch is ARCHITECTURES["ouro"] and m.pos_emb is None and m.lm_head is not None
    assert {"model.embed_tokens.weight", "model.early_exit_gate.bias", "lm_head.weight"} <= set(m.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = m(ids)
        pdf = m.exit_distribution(hs)
    torch.testing.assert_close(pdf.sum(-1), torch.ones(2, 9))
    assert pdf.shape == (2, 9, cfg.n_loops)


def test_published_names_round_trip():
    cfg = preset("ouro-tiny", {"model": {"readout": "per_loop_alpha"}}).model
    m = LoopedLM(cfg)
    published = m.state_dict()
    assert "model.layers.1.self_attn.k_proj.weight" in published and "model.alpha_readouts.3.log_s_ref" in published
    assert published["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8
    ours = from_published(published, cfg)
    assert sorted(to_published(ours, cfg)) == sorted(published)
    with torch.no_grad():
        other = LoopedLM(cfg)
        other.load_state_dict({k: v + 1 if v.is_floating_point() else v for k, v in published.items()})
        torch.testing.assert_close(other.blocks[0].attn.qkv.weight, m.blocks[0].attn.qkv.weight + 1)


def test_the_looped_architecture_keeps_its_names():
    cfg = preset("smoke").model
    assert not ARCHITECTURES["looped"].published_names
    names = set(LoopedLM(cfg).state_dict())
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.gate_up.weight"} <= names
    assert not any("_out_norm" in n or n.startswith("lm_head") for n in names)


# ---------------------------------------------------------------------------
# one FLOP formula (model.flops_per_token), checked against hand counts
# ---------------------------------------------------------------------------
def test_flops_per_token_of_an_ouro_config_with_grouped_kv_heads():
    """ouro-tiny: d 32, 4 heads of 8, 2 key/value heads (k and v 16 wide), SwiGLU 64, T 32,
    2 layers, K 4, vocabulary 2048, untied head, RoPE (no position table), exit gate always."""
    cfg = preset("ouro-tiny").model
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.seq_len, cfg.n_layers, cfg.n_loops,
            cfg.vocab_size, cfg.exit_gate) == (32, 4, 2, 64, 32, 2, 4, 2048, False)
    q = o = 32 * 32                 # multiply-adds per token of each projection
    k = v = 32 * 16                 # grouped: 2 key/value heads of 8
    mlp = 32 * 128 + 64 * 32        # fused gate/up, then down
    attention = 2 * (32 // 2) * 32  # QK^T and AV, 16 keys on average (causal), all 4 query heads
    layer = 2 * (q + k + v + o + mlp + attention)        # 20,480 FLOPs
    loop = 2 * layer + 2 * 32                           # + the exit gate's dot product: 41,024
    head = 2 * 32 * 2048                                # 131,072 per readout
    assert flops_per_token(cfg) == 4 * loop + 4 * head == 688_384
    assert flops_per_token(cfg, 6, 1) == 6 * loop + head
    # without grouping, k and v are as wide as q
    full = dataclasses.replace(cfg, n_kv_heads=0)
    assert flops_per_token(full) - flops_per_token(cfg) == 4 * 2 * 2 * 2 * (32 * 32 - 32 * 16)


def test_flops_per_token_of_the_looped_default():
    """ModelConfig(): d 512, 8 heads, SwiGLU 2048, T 256, 8 layers, K 4, vocabulary 20,000,
    tied head, learned positions (not counted: a table lookup), no exit gate."""
    cfg = ModelConfig()
    q = k = v = o = 512 * 512
    mlp = 3 * 512 * 2048
    attention = 2 * 128 * 512
    layer = 2 * (q + k + v + o + mlp + attention)  # 8,650,752
    head = 2 * 512 * 20000
    assert flops_per_token(cfg) == 4 * 8 * layer + 4 * head == 358_744_064
    assert flops_per_token(cfg, n_readouts=1) == 4 * 8 * layer + head
    gated = dataclasses.replace(cfg, exit_gate=True)
    assert flops_per_token(gated) - flops_per_token(cfg) == 4 * 2 * 512


def test_flops_per_token_matches_counted_matmuls_of_an_ouro_model():
    """The projections, the exit gate and the head as torch's FlopCounterMode counts them in a
    forward pass of ouro-tiny (attention by hand: SDPA is not counted on CPU)."""
    cfg = preset("ouro-tiny").model
    m = LoopedLM(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        states = m(idx)
        for k, h in enumerate(states, start=1):
            m.logits(h, final=k == len(states), k=k)
            m.gate_logits(h, k)
    counted = sum(v for op, v in fc.get_flop_counts()["Global"].items() if "mm" in str(op))
    attention = cfg.n_loops * cfg.n_layers * 2 * cfg.seq_len * cfg.d_model * idx.numel()
    assert flops_per_token(cfg) * idx.numel() == counted + attention


# ---------------------------------------------------------------------------
# one readout registry: each readout names the architectures it applies to
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch,base", [("looped", "smoke"), ("ouro", "ouro-tiny")])
def test_a_readout_of_another_architecture_is_a_one_line_config_error(arch, base):
    for name, spec in R.READOUTS.items():
        if spec.applies_to(arch):
            assert preset(base, {"model": {"readout": name}}).model.readout == name
            continue
        with pytest.raises(ConfigError) as e:
            preset(base, {"model": {"readout": name}})
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"model.readout {name!r} is not a readout of model.arch={arch}")
        assert msg.endswith("choose one of " + ", ".join(R.readouts_of(arch)))


def test_ouro_does_not_read_model_recurrence():
    """Ouro's recurrence is its step norm: a config may leave model.recurrence out (or say
    inter_loop_norm, as the presets do); the model is the same."""
    d = preset_dict("ouro-tiny")
    assert d["model"].pop("recurrence") == "inter_loop_norm"
    unset = RunConfig.from_dict(d).model
    assert unset.recurrence == "residual"
    ids = torch.randint(0, unset.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    for cfg in (unset, preset("ouro-tiny").model):
        torch.manual_seed(0)
        m = LoopedLM(cfg).eval()
        assert m.loop_norm is None and m.damping_logit is None
        with torch.no_grad():
            logits.append(torch.stack([m.logits(h, k == cfg.n_loops, k) for k, h in enumerate(m(ids), start=1)]))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"^model.recurrence=spectral_damping does not apply to model.arch=ouro"):
        preset("ouro-tiny", {"model": {"recurrence": "spectral_damping"}})
