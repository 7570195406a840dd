"""One looped model: the Ouro architecture is a setting of LoopedLM (model.ARCHITECTURES), its
state dicts keep the published parameter names (model.to_published / from_published)."""
import pytest
import torch

from loopscale.config import preset
from loopscale.model import ARCHITECTURES, LoopedLM, from_published, to_published
from loopscale.ouro import OuroLM

torch.set_num_threads(1)
READOUTS = ("rmsnorm", "final_raw", "final_alpha", "per_loop_alpha")


@pytest.mark.parametrize("readout", READOUTS)
def test_an_ouro_config_through_looped_lm_equals_ouro_lm(readout):
    """Same seed: the same initial weights under the published names, the same logits at every
    exit and depth, the same exit distribution."""
    cfg = preset("ouro-tiny", {"model": {"readout": readout}}).model
    torch.manual_seed(0)
    ref = OuroLM(cfg).eval()
    torch.manual_seed(0)
    m = LoopedLM(cfg).eval()
    a, b = ref.state_dict(), m.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for n in (1, cfg.n_loops, cfg.n_loops + 2):
            hr, hm = ref(ids, n_loops=n), m(ids, n_loops=n)
            for k, (x, y) in enumerate(zip(hr, hm), start=1):
                torch.testing.assert_close(m.logits(y, k == n, k), ref.logits(x, k == n, k), rtol=0, atol=0)
        torch.testing.assert_close(m.exit_distribution(hm), ref.exit_distribution(hr), rtol=1e-6, atol=1e-7)


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
