"""The Ouro architecture: a Hugging Face Ouro checkpoint written here in the published layout
loads by name, and its logits equal an independent reference forward of the published
architecture (plain torch ops, written from its description) at every step count; the
readout variants obey their formulas; the exit gate's distribution and loss."""
import json
import math

import pytest
import torch

from loopscale import ouro
from loopscale.config import ConfigError, RunConfig, preset, preset_dict
from loopscale.io import CheckpointError
from loopscale.model import LoopedLM, build_model, count_params
from ouro_support import HF_TINY, published_tensors, write_hf

torch.set_num_threads(1)

# a tiny Ouro config.json in the published schema (grouped-query attention, RoPE base 10,000)






def reference_logits(t: dict, hf: dict, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The published Ouro forward, from its description, in plain torch ops (float64):
    embed; `steps` times: the layers (sandwich norms, RoPE attention with grouped key/value
    heads, SwiGLU), then model.norm; lm_head on the last normed state."""
    t = {k: v.double() for k, v in t.items()}
    eps, H, KV, hd = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    B, T = ids.shape

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    pos = torch.arange(T, dtype=torch.float64)
    freqs = 1.0 / hf["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(pos, freqs)  # [T, hd/2]; pair (i, i + hd/2) rotates by ang[:, i]
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rotate(x):  # x [B, heads, T, hd]
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = t["model.embed_tokens.weight"][ids]
    for _ in range(steps):
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = norm(x, t[p + "input_layernorm.weight"])
            q = (a @ t[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
            k = (a @ t[p + "self_attn.k_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
            v = (a @ t[p + "self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
            q, k = rotate(q), rotate(k)
            group = H // KV  # query head j reads key/value head j // group
            k = torch.stack([k[:, j // group] for j in range(H)], dim=1)
            v = torch.stack([v[:, j // group] for j in range(H)], dim=1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            s = s.masked_fill(~causal, float("-inf"))
            o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, H * hd)
            x = x + norm(o @ t[p + "self_attn.o_proj.weight"].T, t[p + "input_layernorm_2.weight"])
            m = norm(x, t[p + "post_attention_layernorm.weight"])
            gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
            y = (gate * torch.sigmoid(gate) * up) @ t[p + "mlp.down_proj.weight"].T
            x = x + norm(y, t[p + "post_attention_layernorm_2.weight"])
        x = norm(x, t["model.norm.weight"])
    return x @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("ouro-hf"), HF_TINY, published_tensors(HF_TINY))


def test_presets_match_the_published_config():
    """ouro-1.4b: every number of ByteDance/Ouro-1.4B's config.json."""
    m = preset("ouro-1.4b").model
    assert (m.arch, m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.n_loops,
            m.rope_theta, m.norm_eps) == ("ouro", 24, 2048, 16, 16, 5632, 49152, 4, 1e6, 1e-6)
    n = count_params(m)
    assert 1.3e9 < n < 1.5e9, n  # "1.4B" (untied head counted)
    for name in ("ouro-tiny", "ouro-smoke"):
        assert preset(name).model.arch == "ouro"


@pytest.mark.parametrize("shards", [0, 3])
def test_hf_checkpoint_equals_reference_forward(tmp_path, shards):
    t = published_tensors(HF_TINY, seed=1)
    path = write_hf(tmp_path / "ckpt", HF_TINY, t, shards=shards)
    model, cfg = ouro.from_pretrained(path, seq_len=64)
    assert cfg.model.n_loops == 4 and cfg.model.n_kv_heads == 2
    ids = torch.randint(0, HF_TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for steps in range(1, 7):  # the trained K = 4 and beyond
            ours = model.logits(model(ids, n_loops=steps)[-1]).double()
            ref = reference_logits(t, HF_TINY, ids, steps)
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_loaded_model_generates_with_kv_cache_like_full_passes(hf_dir):
    """The KV-cache path (generation) gives the full pass's last-position logits (RoPE offsets)."""
    from loopscale.model import KVCache
    model, _ = ouro.from_pretrained(hf_dir)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.logits(model(ids)[-1])[0, -1]
        caches = [[KVCache() for _ in model.blocks] for _ in range(4)]
        for split in (ids[:, :5], ids[:, 5:7], ids[:, 7:]):
            x = model.embed(split)
            for k in range(1, 5):
                h = model.loop(x, caches[k - 1])
                x = model.feed(h, k)
        torch.testing.assert_close(model.logits(h)[0, -1], full, rtol=1e-4, atol=1e-4)


def test_save_pretrained_round_trip(tmp_path, hf_dir):
    model, _ = ouro.from_pretrained(hf_dir)
    out = ouro.save_pretrained(model, tmp_path / "again", shard_tensors=5)
    again, _ = ouro.from_pretrained(out)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_bad_checkpoints_are_one_line_errors(tmp_path):
    t = published_tensors(HF_TINY)
    with pytest.raises(CheckpointError, match="not 'ouro'"):
        ouro.from_pretrained(write_hf(tmp_path / "a", {**HF_TINY, "model_type": "llama"}, t))
    with pytest.raises(CheckpointError, match="misses model.early_exit_gate"):
        ouro.from_pretrained(write_hf(tmp_path / "b", HF_TINY, {k: v for k, v in t.items() if "gate." not in k
                                                                 or "mlp" in k}))
    with pytest.raises(CheckpointError, match="shape"):
        ouro.from_pretrained(write_hf(tmp_path / "c", {**HF_TINY, "intermediate_size": 40}, t))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        ouro.from_pretrained(write_hf(tmp_path / "d", {**HF_TINY, "rope_scaling": {"rope_type": "yarn"}}, t))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps(HF_TINY))
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        ouro.from_pretrained(tmp_path / "e")


def test_config_validation():
    d = preset_dict("ouro-tiny")
    for change, match in (({"readout": "final_norm"}, "not a readout of model.arch=ouro"),
                          ({"recurrence": "spectral_damping"}, "leave model.recurrence out"),
                          ({"n_kv_heads": 3}, "divisible by model.n_kv_heads"),
                          ({"arch": "transformer"}, "model.arch")):
        bad = {**d, "model": {**d["model"], **change}}
        with pytest.raises(ConfigError, match=match):
            RunConfig.from_dict(bad)
    s = preset_dict("smoke")
    with pytest.raises(ConfigError, match=r"^model.readout 'final_alpha' is not a readout of model.arch=looped "
                                          r"\(it is one of model.arch=ouro\); choose one of rmsnorm, layernorm"):
        RunConfig.from_dict({**s, "model": {**s["model"], "readout": "final_alpha"}})
    with pytest.raises(ConfigError, match=r"model.alpha_fixed must be .*\[0, 1\]"):
        RunConfig.from_dict({**d, "model": {**d["model"], "alpha_fixed": 1.5}})


# ---------------------------------------------------------------------------
# readout variants
# ---------------------------------------------------------------------------
def tiny(readout: str, **model) -> LoopedLM:
    torch.manual_seed(0)
    cfg = preset("ouro-tiny", {"model": {"readout": readout, **model}}).model
    return build_model(cfg).eval()


def test_published_norm_is_scale_invariant_and_feeds_the_next_step():
    m = tiny("rmsnorm")
    h = torch.randn(2, 5, 32)
    torch.testing.assert_close(m.readout(37.0 * h), m.readout(h), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.feed(h), m.model.norm(h))
    torch.testing.assert_close(m.readout(h, final=False), m.readout(h, final=True))


def test_final_raw_is_raw_on_the_last_step_of_every_depth():
    m = tiny("final_raw")
    h = torch.randn(2, 5, 32)
    assert torch.equal(m.readout(h, final=True), h)
    torch.testing.assert_close(m.readout(h, final=False), m.model.norm(h))
    ids = torch.randint(0, 2048, (1, 6))
    with torch.no_grad():
        for K in (1, 3, 4, 6, 8):  # the raw readout lands on step K, whatever K
            states = m(ids, n_loops=K)
            torch.testing.assert_close(m.logits(states[-1], final=True), states[-1] @ m.lm_head.weight.T)


def test_alpha_readout_formula():
    h = torch.randn(3, 4, 32) * 5
    s = h.pow(2).mean(-1, keepdim=True).sqrt()
    raw = tiny("final_alpha", alpha_fixed=1.0)
    torch.testing.assert_close(raw.readout(h), h, rtol=1e-5, atol=1e-5)  # α = 1: the raw state
    const = tiny("final_alpha", alpha_fixed=0.0)
    with torch.no_grad():
        const.model.alpha_readout.log_s_ref.fill_(math.log(2.5))
    out = const.readout(h)  # α = 0: RMS = s_ref for every token, the direction kept
    torch.testing.assert_close(out.pow(2).mean(-1).sqrt(), torch.full((3, 4), 2.5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(const.readout(9 * h), out, rtol=1e-5, atol=1e-5)
    learned = tiny("final_alpha", alpha_init=0.3)
    a = torch.sigmoid(learned.model.alpha_readout.alpha_logit)
    assert abs(float(a.detach()) - 0.3) < 1e-4 and learned.model.alpha_readout.log_s_ref.requires_grad
    with torch.no_grad():
        learned.model.alpha_readout.log_s_ref.fill_(0.4)
    expect = torch.exp((1 - a) * 0.4 + a * s.log()) * h / s
    torch.testing.assert_close(learned.readout(h), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(learned.readout(h, final=False), learned.model.norm(h))  # k < K: model.norm


def test_per_loop_alpha_uses_each_steps_readout():
    m = tiny("per_loop_alpha")
    with torch.no_grad():
        for i, r in enumerate(m.model.alpha_readouts):
            r.log_s_ref.fill_(0.1 * (i + 1))
    h = torch.randn(1, 3, 32)
    for k in range(1, 4):
        torch.testing.assert_close(m.feed(h, k), m.model.alpha_readouts[k - 1](h))
    torch.testing.assert_close(m.readout(h, final=True), m.model.alpha_readouts[-1](h))
    with pytest.raises(ValueError, match="needs the step k"):
        m.feed(h)


def test_official_trainer_names_load(tmp_path):
    """State dicts of the official trainer (its wrappers hold the published norm as .norm)."""
    m = tiny("final_alpha")
    state = {}
    for k, v in m.state_dict().items():
        if k.endswith("ema_count"):
            continue
        k = k.replace("model.norm.", "model.norm.norm.").replace("model.alpha_readout.", "model.norm.alpha_readout.")
        state["_orig_mod." + k] = v.clone() + 0.5 if v.is_floating_point() else v
    other = tiny("final_alpha")
    ouro.load_state(other, state, "official last.pt")
    torch.testing.assert_close(other.model.norm.weight, m.model.norm.weight + 0.5)
    torch.testing.assert_close(other.model.alpha_readout.log_s_ref, m.model.alpha_readout.log_s_ref + 0.5)


# ---------------------------------------------------------------------------
# the exit gate
# ---------------------------------------------------------------------------
def test_exit_distribution():
    m = tiny("rmsnorm")
    ids = torch.randint(0, 2048, (2, 7))
    states = m(ids)
    pdf = m.exit_distribution(states)
    assert pdf.shape == (2, 7, 4)
    torch.testing.assert_close(pdf.sum(-1), torch.ones(2, 7))
    lam = [torch.sigmoid(m.model.early_exit_gate(m.model.norm(h)).squeeze(-1)) for h in states[:3]]
    torch.testing.assert_close(pdf[..., 1], lam[1] * (1 - lam[0]))
    torch.testing.assert_close(pdf[..., 3], (1 - lam[0]) * (1 - lam[1]) * (1 - lam[2]))
    torch.testing.assert_close(m.exit_pdf(states), pdf.movedim(-1, 0))  # steps first


# ---------------------------------------------------------------------------
# evaluations
# ---------------------------------------------------------------------------
def test_variable_depth_and_scale_sensitivity(hf_dir):
    model, _ = ouro.from_pretrained(hf_dir)
    windows = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(5))
    rows = ouro.variable_depth(model, windows, range(1, 9), batch_size=2)
    assert [r["K"] for r in rows] == list(range(1, 9))
    x, y = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        z = model.logits(model(x, n_loops=6)[-1])
    ce6 = torch.nn.functional.cross_entropy(z.reshape(-1, 97), y.reshape(-1)).item()
    assert abs(rows[5]["ce"] - ce6) < 1e-5 and abs(rows[5]["ppl"] - math.exp(ce6)) < 1e-3
    sweep = ouro.scale_sensitivity(model, windows, [0.5, 1.0, 8.0])
    assert max(r["ce"] for r in sweep) - min(r["ce"] for r in sweep) < 1e-5  # RMSNorm absorbs the scale
    raw = tiny("final_raw")
    w = torch.randint(0, 2048, (2, 9))
    sweep = ouro.scale_sensitivity(raw, w, [0.25, 1.0, 4.0])
    assert len({round(r["ce"], 4) for r in sweep}) == 3  # the raw readout sees it


@pytest.mark.parametrize("readout", ["rmsnorm", "per_loop_alpha"])
def test_generation_with_the_kv_cache_equals_full_passes(readout):
    """loopscale.generate on an Ouro model: greedy tokens with the KV cache are those of full
    passes without it, at the trained depth and beyond."""
    from loopscale.generate import generate
    m = tiny(readout)
    for n in (4, 6):
        cached = generate(m, [5, 9, 2, 7], 6, n_loops=n)
        plain = generate(m, [5, 9, 2, 7], 6, n_loops=n, use_cache=False)
        assert cached.tokens == plain.tokens and len(cached.tokens) == 6
