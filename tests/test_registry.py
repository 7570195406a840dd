"""The registry (loopscale.registry): every concept defined once, read everywhere.

The main test adds a readout through the registry alone (monkeypatched) and takes it
through training, evaluation and the report: adding a readout touches the registry, the
model's readout code only when it needs a new kind of norm, and tests."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from loopscale import config as C
from loopscale import registry as R
from loopscale.diagnostics import run_all
from loopscale.model import LoopedLM
from loopscale.report.tables import build_tables
from loopscale.report.figures import write_figures
from loopscale.report.runs import load_runs
from loopscale.report import styles as S
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
    conds = [R.condition(*base) for base in R.CANONICAL_BASES]
    assert sorted(reversed(conds), key=R.Condition.sort_key) == conds
    extra = R.condition("raw", "per_loop", recurrence="inter_loop_norm")
    assert sorted([extra, conds[0]], key=R.Condition.sort_key) == [conds[0], extra]
    assert R.Condition.from_config(C.preset("smoke", {"model": {"readout": "raw"}}).to_dict()) == \
        R.condition("raw", "per_loop")


def test_styles_are_colour_blind_safe_and_distinct():
    conds = [R.condition(*base) for base in R.CANONICAL_BASES]
    assert all(S.colour(c) in S.PALETTE for c in conds)
    assert len({(S.colour(c), str(S.linestyle(c)), S.marker(c)) for c in conds}) == len(conds)
    rms, ln = R.condition("rmsnorm", "per_loop"), R.condition("layernorm", "per_loop")
    assert S.linestyle(rms) != S.linestyle(ln) and S.marker(rms) != S.marker(ln)  # not by colour alone
    # conditions outside the canonical list still get a palette colour
    assert S.colour(R.condition("raw", "per_loop", "norm_penalty", "inter_loop_norm")) in S.PALETTE
    # every readout is drawn: its own style, the default one, or (unregistered) the unknown one
    assert set(S.READOUT_STYLE) <= set(R.READOUTS)
    assert S.readout_style("no_such_readout") == S.UNKNOWN_STYLE


def _lab(colour: str) -> tuple:
    """CIELAB (D65) of an sRGB colour."""
    from matplotlib.colors import to_rgb
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(colour)]
    xyz = [sum(m * c for m, c in zip(row, lin)) for row in
           ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505))]
    f = [t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29
         for t in (xyz[0] / 0.95047, xyz[1], xyz[2] / 1.08883)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def _delta_e(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(_lab(a), _lab(b))) ** 0.5


def test_every_registered_condition_has_its_own_colour():
    """Colour alone tells the registered conditions apart: one palette colour each, no two
    closer than a ΔE*ab of 25 (dark and light blue, Okabe–Ito's closest pair, are 26 apart),
    and the two scale-invariant per-loop readouts, which sit on top of each other in the
    figures, far apart (the Okabe–Ito vermillion and orange they had were 33 apart)."""
    conds = [R.condition(*base) for base in R.CANONICAL_BASES]
    colours = [S.colour(c) for c in conds]
    assert len(set(colours)) == len(conds) and set(colours) <= set(S.PALETTE)
    for i, a in enumerate(conds):
        for b in conds[i + 1:]:
            assert _delta_e(S.colour(a), S.colour(b)) >= 25, (a.label, b.label, S.colour(a), S.colour(b))
    rms, ln = R.condition("rmsnorm", "per_loop"), R.condition("layernorm", "per_loop")
    assert _delta_e(S.colour(rms), S.colour(ln)) >= 50
    assert _delta_e("#D55E00", "#E69F00") < 50  # the rule above tells the old pair's colours apart
    # the other conditions cycle through the palette from after the registered ones
    others = [R.condition(*b) for b in R.all_bases() if b not in R.CANONICAL_BASES]
    assert S.colour(others[0]) == S.PALETTE[len(R.CANONICAL_BASES) % len(S.PALETTE)]


def test_readout_semantics():
    rms, raw, fin, ln = (R.READOUTS[n] for n in ("rmsnorm", "raw", "final_norm", "layernorm"))
    assert rms.scale_invariant and ln.scale_invariant and not fin.scale_invariant and not raw.scale_invariant
    assert raw.raw and not fin.raw and fin.exits_differ and not rms.exits_differ
    assert [fin.norm_at(k, 3) for k in (1, 2, 3)] == ["raw", "raw", "rmsnorm"]
    assert "final-only" in fin.label and "exits k < K" in fin.description
    with pytest.raises(ValueError, match="one norm kind"):
        R.Readout("mixed", "mixed", "rmsnorm", "layernorm", "")


@pytest.mark.slow  # end to end: train, evaluate, tables and figures (seconds)
def test_a_readout_added_through_the_registry_trains_evaluates_and_reports(monkeypatch, smoke_data, tmp_path,
                                                                             one_thread):
    toy = R.Readout("toy_final_ln", "final-only LayerNorm", None, "layernorm",
                    "raw exits k < K, LayerNorm at exit K (test only)")
    monkeypatch.setitem(R.READOUTS, toy.name, toy)
    monkeypatch.setitem(S.READOUT_STYLE, toy.name, (":", "v"))  # optional: else styles.DEFAULT_STYLE
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
    assert S.colour(toy_cond) in S.PALETTE and S.linestyle(toy_cond) == ":" and S.marker(toy_cond) == "v"
    pngs = write_figures(loaded, tmp_path / "figures")
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_one_readout_registry_names_each_readouts_architectures():
    """The Ouro track's readouts are entries of READOUTS like the others, for model.arch=ouro;
    they come after every other readout in tables and each has a colour of its own."""
    assert R.readouts_of("looped") == ("rmsnorm", "layernorm", "raw", "final_norm", "alpha_readout", "tapernorm")
    assert R.readouts_of("ouro") == ("rmsnorm", "final_raw", "final_alpha", "per_loop_alpha")
    assert R.axis_values("readout") == tuple(R.READOUTS)
    fin_raw, fin_alpha, per_loop = (R.READOUTS[n] for n in ("final_raw", "final_alpha", "per_loop_alpha"))
    assert [fin_raw.norm_at(k, 3) for k in (1, 2, 3)] == ["rmsnorm", "rmsnorm", "raw"]
    assert fin_alpha.exits_differ and per_loop.exits_differ and per_loop.per_loop and not fin_alpha.per_loop
    assert not any(r.scale_invariant or r.raw for r in (fin_raw, fin_alpha, per_loop))
    conds = [R.condition(r, "terminal", recurrence="inter_loop_norm") for r in R.readouts_of("ouro")]
    assert sorted(conds, key=R.Condition.sort_key) == [conds[i] for i in (0, 2, 1, 3)]  # rmsnorm, then by name
    assert len({S.colour(c) for c in conds}) == 4
    # exits and exit K of different kinds only where the exits read the step norm (Ouro)
    R.Readout("ok", "ok", "rmsnorm", "alpha", "", archs=("ouro",))
    with pytest.raises(ValueError, match="one norm kind"):
        R.Readout("mixed", "mixed", "rmsnorm", "alpha", "", archs=("looped", "ouro"))
