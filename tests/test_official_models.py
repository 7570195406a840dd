"""The official release's model options (docs/diagnostics.md, "Model options of the official
release"): alpha readout, TaperNorm, spectral damping, the adaptive exit-gate loss and the
scale anchor. Each formula is checked on its own, and each option trains, evaluates and
reports through the registry like the paper's conditions."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from loopscale import config as C
from loopscale import registry as R
from loopscale.diagnostics import run_all
from loopscale.model import LoopedLM, exit_distribution
from loopscale.objective import compute_loss
from loopscale.readouts import AlphaReadout, TaperNorm, drive_tapers, taper_gate
from loopscale.report.runs import load_runs
from loopscale.report.styles import PALETTE, colour
from loopscale.report.tables import build_tables
from loopscale.train import train


def smoke(model=None, objective=None, **train_kw):
    return C.preset("smoke", {"model": model or {}, "objective": objective or {},
                              "train": {"max_steps": 6, "log_every": 3, **train_kw}})


def batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


# ---------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------
def test_spectral_damping_feeds_sigmoid_a_times_h_between_loops():
    cfg = smoke({"recurrence": "spectral_damping"})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).eval()
    assert float(model.damping_logit.detach()) == 2.0  # σ(2) ≈ 0.88, the official start
    with torch.no_grad():
        model.damping_logit.fill_(-0.7)
    x, _ = batch(cfg)
    inputs = {}

    def spy(k, x_in, h):
        inputs[k] = x_in
        return h
    with torch.no_grad():
        states = model(x, state_fn=spy)
    a = torch.sigmoid(torch.tensor(-0.7))
    for k in (2, 3):  # loop k receives σ(a)·H_{k-1}: a scalar, the same for every channel
        torch.testing.assert_close(inputs[k], a * states[k - 2], rtol=0, atol=0)
    assert R.RECURRENCES["spectral_damping"].label == "spectral damping"


def test_exit_distribution_is_the_survival_chain():
    g = torch.randn(4, 3, 5)
    p = exit_distribution(g)
    lam, left, want = torch.sigmoid(g), torch.ones(3, 5), []
    for k in range(4):
        want.append(lam[k] * left if k < 3 else left)
        left = left * (1 - lam[k])
    torch.testing.assert_close(p, torch.stack(want))
    torch.testing.assert_close(p.sum(0), torch.ones(3, 5))


def test_adaptive_loss_is_gate_weighted_ce_minus_entropy_and_trains_the_gate():
    cfg = smoke(objective={"loss": "adaptive", "entropy_weight": 0.25})
    assert cfg.model.exit_gate  # the loss reads the gate: the model has one
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    x, y = batch(cfg)
    states = model(x)
    out = compute_loss(model, states, y, cfg.objective)
    K = len(states)
    p = model.exit_pdf(states)
    ce = [F.cross_entropy(model.logits(h, k == K - 1).reshape(-1, cfg.model.vocab_size), y.reshape(-1),
                          reduction="none").reshape(y.shape) for k, h in enumerate(states)]
    want = sum((p[k] * ce[k]).mean() for k in range(K)) - 0.25 * (-(p * p.clamp_min(1e-8).log()).sum(0)).mean()
    torch.testing.assert_close(out.total, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.ce, torch.stack([c.mean() for c in ce]).detach(), rtol=1e-5, atol=1e-5)
    out.total.backward()
    assert model.exit_gate.weight.grad.abs().sum() > 0


def test_scale_anchor_adds_w_times_rms_minus_target_squared():
    cfg = smoke(objective={"regularizer": "scale_anchor", "anchor_weight": 0.3, "anchor_target": 2.0})
    plain = smoke()
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    x, y = batch(cfg)
    with torch.no_grad():
        states = model(x)
        a = compute_loss(model, states, y, cfg.objective)
        b = compute_loss(model, states, y, plain.objective)
    rms = torch.stack([h.pow(2).mean() for h in states]).mean().sqrt()
    torch.testing.assert_close(a.total - b.total, 0.3 * (rms - 2.0) ** 2, rtol=1e-5, atol=1e-6)


def test_alpha_readout_spans_constant_scale_to_raw():
    torch.manual_seed(0)
    h = torch.randn(3, 4, 16) * 9
    raw = AlphaReadout(16, fixed_alpha=1.0).eval()
    torch.testing.assert_close(raw(h), h, rtol=1e-6, atol=1e-5)  # α = 1: the raw state
    const = AlphaReadout(16, fixed_alpha=0.0, s_ref="fixed", init_log_s_ref=math.log(3.0)).eval()
    torch.testing.assert_close(const(h).pow(2).mean(-1).sqrt(), torch.full((3, 4), 3.0))  # α = 0: RMS s_ref
    mid = AlphaReadout(16, init_alpha=0.3, s_ref="fixed").eval()
    assert float(mid.alpha().detach()) == pytest.approx(0.3, abs=1e-6)
    torch.testing.assert_close(mid(5 * h), 5 ** 0.3 * mid(h), rtol=1e-5, atol=1e-5)  # r(cH) = c^α r(H)
    ranged = AlphaReadout(16, init_alpha=0.5, alpha_min=0.2, alpha_max=0.6)
    with torch.no_grad():
        ranged.alpha_logit.fill_(50.0)
    assert float(ranged.alpha().detach()) == pytest.approx(0.6)
    ema = AlphaReadout(16, ema_decay=0.9).train()
    ema(h)
    assert float(ema.log_s_ref) == pytest.approx(float(h.pow(2).mean(-1).sqrt().log().mean()), rel=1e-6)
    ema(2 * h)
    assert int(ema.ema_count) == 2
    learned = AlphaReadout(16, s_ref="learned", gain=True)
    learned(h).sum().backward()
    assert learned.log_s_ref.grad is not None and learned.weight.grad is not None
    with pytest.raises(ValueError, match="s_ref"):
        AlphaReadout(16, s_ref="median")


def test_per_loop_alpha_readouts_are_one_per_exit():
    cfg = smoke({"readout": "alpha_readout", "alpha_per_loop": True})
    model = LoopedLM(cfg.model).eval()
    assert len(model.readout_norm) == cfg.model.n_loops
    with torch.no_grad():
        for k, m in enumerate(model.readout_norm):
            m.alpha_logit.fill_(k - 1.0)
    h = torch.randn(2, 5, cfg.model.d_model) * 4
    outs = [model.readout(h, k == 3, k) for k in (1, 2, 3)]
    for k in (1, 2, 3):
        torch.testing.assert_close(outs[k - 1], model.readout_norm[k - 1](h))
    assert not torch.allclose(outs[0], outs[1])
    torch.testing.assert_close(model.readout(h, True, 7), outs[2])  # past K: exit K's
    with pytest.raises(ValueError, match="give the exit's k"):
        model.readout(h, final=False)


def test_tapernorm_gate_follows_the_official_schedule_and_training_drives_it(smoke_data, tmp_path, one_thread):
    assert taper_gate(0, 100) == (1.0, 5) and taper_gate(4, 100)[0] == 1.0
    assert taper_gate(5 + 95 // 2, 100)[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert taper_gate(100, 100)[0] == 0.0
    t = TaperNorm(8).train()
    h = torch.randn(2, 3, 8) * 5
    torch.testing.assert_close(t(h), F.rms_norm(h, (8,), eps=1e-6))  # gate 1: RMSNorm
    assert int(t.ema_count) == 1 and not bool(t.calibrated)
    assert drive_tapers(torch.nn.Sequential(t), 10, 100) == pytest.approx(taper_gate(10, 100)[0])
    assert bool(t.calibrated) and float(t.scale_coeff) == pytest.approx(float(t.ema_num / t.ema_den))
    assert drive_tapers(torch.nn.Linear(2, 2), 10, 100) is None

    cfg = smoke({"readout": "tapernorm"}, max_steps=40, log_every=10)
    out = tmp_path / "taper"
    assert train(cfg, smoke_data, out, progress=False)["status"] == "completed"
    state = torch.load(out / "model.pt", weights_only=True)["model"]
    assert float(state["readout_norm.gate"]) == 0.0 and bool(state["readout_norm.calibrated"])
    assert int(state["readout_norm.ema_count"]) > 0  # warm-up (2 steps) collected the calibration EMA
    assert float(state["readout_norm.scale_coeff"]) != 1.0


def test_config_checks_the_new_keys():
    with pytest.raises(C.ConfigError, match="model.alpha_min .* must be below model.alpha_max"):
        smoke({"alpha_min": 0.8, "alpha_max": 0.5})
    with pytest.raises(C.ConfigError, match="model.alpha_s_ref: unknown value 'median'"):
        smoke({"alpha_s_ref": "median"})
    with pytest.raises(C.ConfigError, match="model.alpha_fixed must be"):
        smoke({"alpha_fixed": 1.5})
    with pytest.raises(C.ConfigError, match="objective.entropy_weight must be"):
        smoke(objective={"entropy_weight": -1})
    assert not smoke().model.exit_gate and smoke(objective={"loss": "adaptive"}).model.exit_gate


# ---------------------------------------------------------------------------
# every option trains, evaluates and reports
# ---------------------------------------------------------------------------
OPTIONS = {
    "alpha_readout": ({"readout": "alpha_readout"}, {}, "per-loop CE + alpha readout"),
    "tapernorm": ({"readout": "tapernorm"}, {}, "per-loop CE + TaperNorm readout"),
    "spectral_damping": ({"recurrence": "spectral_damping"}, {}, "per-loop CE + RMSNorm readout + spectral damping"),
    "adaptive": ({}, {"loss": "adaptive"}, "adaptive CE + RMSNorm readout"),
    "scale_anchor": ({}, {"regularizer": "scale_anchor"}, "per-loop CE + RMSNorm readout + scale anchor"),
    "alpha_per_loop": ({"readout": "alpha_readout", "alpha_per_loop": True}, {}, "per-loop CE + alpha readout"),
}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_official_option_trains_evaluates_and_reports(option, smoke_data, tmp_path, one_thread):
    model_kw, obj_kw, label = OPTIONS[option]
    cfg = smoke(model_kw, obj_kw)
    out = tmp_path / option
    s = train(cfg, smoke_data, out, progress=False)
    assert s["status"] == "completed" and len(s["validation"]["val_ce"]) == cfg.model.n_loops
    assert all(math.isfinite(c) for c in s["validation"]["val_ce"])
    names = ("depth", "norms", "radial") + (("clamp", "halting") if option == "alpha_per_loop" else ())
    res = run_all(out / "model.pt", smoke_data, out / "eval", device="cpu", progress=False,
                  names=names, eval_config=C.eval_preset("smoke"))
    assert len(res["depth"]["exits"]) == cfg.model.n_loops
    radial = json.loads((out / "eval" / "radial.json").read_text())["loops"]
    assert len(radial) == cfg.model.n_loops
    loaded = load_runs([out])
    main = {t.name: t for t in build_tables(loaded)}["main"].df
    assert list(main["condition"]) == [label]
    assert not pd.isna(main["ppl_K_mean"]).any()
    cond = loaded[0].condition
    assert colour(cond) in PALETTE
    if option in ("alpha_readout", "tapernorm"):  # neither scale-invariant nor raw
        assert not cond.scale_invariant_readout and not cond.raw_readout
