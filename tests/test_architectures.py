"""One looped model: the Ouro architecture is a setting of LoopedLM (model.ARCHITECTURES), its
state dicts keep the published parameter names (model.to_published / from_published)."""
import pytest
import torch

from loopscale.config import preset
from loopscale.model import ARCHITECTURES, LoopedLM, build_model, from_published, to_published

torch.set_num_threads(1)
READOUTS = ("rmsnorm", "final_raw", "final_alpha", "per_loop_alpha")


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
