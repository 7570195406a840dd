"""The registry (loopscale.registry): every concept defined once, read everywhere.

The main test adds a readout through the registry alone (monkeypatched) and takes it
through training, evaluation and the report: adding a readout touches the registry, the
model's readout code only when it needs a new kind of norm, and tests."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from loopscale import config as C
from loopscale import registry as R
from loopscale.diagnostics import run_all
from loopscale.model import LoopedLM
from loopscale.report.tables import build_tables
from loopscale.report.figures import write_figures
from loopscale.report.runs import load_runs
from loopscale.train import train


def test_condition_id_label_and_order():
    c = R.condition("rmsnorm", "per_loop", "norm_penalty")
    assert c.id == c.slug == "rmsnorm-per_loop-norm_penalty-residual"  # the run directory, as before
    assert c.label == "per-loop CE + RMSNorm readout + norm penalty"
    other = R.condition("rmsnorm", "per_loop", "norm_penalty", penalty_weight=0.1)
    assert other.id == c.id and other.slug == c.id + "-lambda0.1" and other.label.endswith("(λ=0.1)")
    assert R.condition("final_norm", "per_loop").label == "per-loop CE + final-only norm"
    assert R.condition("rmsnorm", "per_loop", recurrence="inter_loop_norm").label == \
        "per-loop CE + RMSNorm readout + inter-loop norm"
    # the paper's seven Table-1 conditions first, in its order, then the additions
    conds = [R.condition(*base) for base, _ in R.CANONICAL]
    assert sorted(reversed(conds), key=R.Condition.sort_key) == conds
    extra = R.condition("raw", "per_loop", recurrence="inter_loop_norm")
    assert sorted([extra, conds[0]], key=R.Condition.sort_key) == [conds[0], extra]
    assert R.Condition.from_config(C.preset("smoke", {"model": {"readout": "raw"}}).to_dict()) == \
        R.condition("raw", "per_loop")


def test_styles_are_colour_blind_safe_and_distinct():
    conds = [R.condition(*base) for base, _ in R.CANONICAL]
    assert all(c.colour in R.PALETTE for c in conds)
    assert len({(c.colour, str(c.linestyle), c.marker) for c in conds}) == len(conds)
    rms, ln = R.condition("rmsnorm", "per_loop"), R.condition("layernorm", "per_loop")
    assert rms.linestyle != ln.linestyle and rms.marker != ln.marker  # not by colour alone
    # conditions outside the canonical list still get a palette colour
    assert R.condition("raw", "per_loop", "norm_penalty", "inter_loop_norm").colour in R.PALETTE


def test_readout_semantics():
    rms, raw, fin, ln = (R.READOUTS[n] for n in ("rmsnorm", "raw", "final_norm", "layernorm"))
    assert rms.scale_invariant and ln.scale_invariant and not fin.scale_invariant and not raw.scale_invariant
    assert raw.raw and not fin.raw and fin.exits_differ and not rms.exits_differ
    assert [fin.norm_at(k, 3) for k in (1, 2, 3)] == ["raw", "raw", "rmsnorm"]
    assert "final-only" in fin.label and "exits k < K" in fin.description
    with pytest.raises(ValueError, match="one norm kind"):
        R.Readout("mixed", "mixed", "rmsnorm", "layernorm", "")


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: extra threads only add stalls on a busy machine
    yield
    torch.set_num_threads(n)


@pytest.mark.slow  # end to end: train, evaluate, tables and figures (seconds)
def test_a_readout_added_through_the_registry_trains_evaluates_and_reports(monkeypatch, smoke_data, tmp_path,
                                                                             one_thread):
    toy = R.Readout("toy_final_ln", "final-only LayerNorm", None, "layernorm",
                    "raw exits k < K, LayerNorm at exit K (test only)", linestyle=":", marker="v")
    monkeypatch.setitem(R.READOUTS, toy.name, toy)
    with pytest.raises(C.ConfigError, match="model.readout: unknown value 'nope'.*toy_final_ln"):
        C.preset("smoke", {"model": {"readout": "nope"}})

    cfg = C.preset("smoke", {"model": {"readout": toy.name}, "train": {"max_steps": 6, "log_every": 3}})
    model = LoopedLM(cfg.model)
    assert type(model.readout_norm).__name__ == "LayerNorm"
    out = tmp_path / "toy"
    assert train(cfg, smoke_data, out, progress=False)["status"] == "completed"
    run_all(out / "model.pt", smoke_data, out / "eval", device="cpu", progress=False,
            names=("depth", "norms", "radial"), eval_config=C.eval_preset("smoke"))
    # radial: exits k < K are raw (the loss sees the scale), exit K is LayerNorm (it does not)
    toy_radial = json.loads((tmp_path / "toy" / "eval" / "radial.json").read_text())["loops"]
    K = cfg.model.n_loops
    assert [r["readout"] for r in toy_radial] == ["raw"] * (K - 1) + ["layernorm"]
    assert toy_radial[-1]["radial_fraction"] < 1e-6 < toy_radial[0]["radial_fraction"]
    depth = json.loads((tmp_path / "toy" / "eval" / "depth.json").read_text())
    assert depth["exits"][-1]["ce"] == pytest.approx(depth["depth"][K - 1]["ce"], rel=1e-6)
    assert depth["exits"][0]["ce"] != pytest.approx(depth["depth"][0]["ce"], rel=1e-4)  # own exit readout

    loaded = load_runs([out])
    tables = {t.name: t for t in build_tables(loaded)}
    main = tables["main"].df
    assert list(main["condition"]) == ["per-loop CE + final-only LayerNorm"]
    assert list(main["condition_id"]) == ["toy_final_ln-per_loop-none-residual"]
    radial = tables["radial"].df
    assert list(radial["exit_readout"]) == ["raw"] * (K - 1) + ["layernorm"]
    assert not pd.isna(main["ppl_K_mean"]).any()
    toy_cond = loaded[0].condition
    assert toy_cond.colour in R.PALETTE and toy_cond.linestyle == ":" and toy_cond.marker == "v"
    pngs = write_figures(loaded, tmp_path / "figures")
    assert all(p.stat().st_size > 1000 for p in pngs)
