"""Halting under the paper's protocol (Table 8) against the official scripts' outputs.

`tests/fixtures/official/<cond>/eval/` holds what the official `early_exit_curve.py` and
`adaptive_halt_benchmark.py` wrote for each checkpoint (the first non-overlapping windows of
`token_ids/validation_ids.json`, batch size times batches as `scripts/commands.sh` ran them).
loopscale's `halting` diagnostic, run on the same checkpoint converted and the same windows,
must give the same rows (timings excepted: they are this machine's wall clock).

loopscale's model computes the same logits as the official one to ~1e-5 (fused projections
sum in another order), not bit for bit. A threshold that falls within that noise of some
unit's confidence (a saturated max_prob/entropy near 1, a logit margin near a tie) can move
that unit across it: such a row may differ from the official one by at most the units whose
confidence lies within BAND of the threshold, and every other row must be equal.
"""
import csv
import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from loopscale.config import EvalConfig, RunConfig, merge
from loopscale import convert
from loopscale.evaluate import EvalRun
from loopscale.halting import (PAPER_CURVE_THRESHOLDS, PAPER_HALT_THRESHOLDS, PAPER_POLICY, POLICIES, collect,
                               halting, paper_calibrate, paper_curve, paper_exit_index, paper_thresholds, paper_units)
from loopscale.model import LoopedLM
from official import CHECKPOINTS, OFFICIAL as FIX, eval_windows, flag

CONDS = [p.parent.name for p in CHECKPOINTS]
OFFICIAL_NAME = {v: k for k, v in PAPER_POLICY.items()}
BAND = {"max_prob": 1e-5, "margin": 1e-4, "entropy": 1e-5}  # confidence noise from ~1e-5 logit differences


def load_official(cond_dir: Path) -> tuple[LoopedLM, RunConfig]:
    """An official checkpoint as a LoopedLM, converted with no flags (`loopscale convert-paper`)."""
    model, cfg, _, _ = convert.load_official(cond_dir / "last.pt")
    return model.float().eval(), cfg


@lru_cache(maxsize=None)
def paper_payload(cond: str) -> dict:
    return _paper_run(cond)[0]


@lru_cache(maxsize=None)
def exit_stats(cond: str) -> tuple:
    return _paper_run(cond)[1]


@lru_cache(maxsize=None)
def _paper_run(cond: str) -> tuple:
    model, cfg = load_official(FIX / cond)
    for p in model.parameters():
        p.requires_grad_(False)
    tokens = np.asarray(json.loads((FIX / "token_ids" / "validation_ids.json").read_text()), dtype=np.int64)
    windows, batch, epsilon = official_protocol(cond)
    ecfg = EvalConfig(batch_size=batch, halting_tokens=windows * cfg.model.seq_len, halting_epsilon=epsilon)
    run = EvalRun(model=model, cfg=cfg, ecfg=ecfg, tokens=tokens, device=torch.device("cpu"), step=None,
                  status="ok", model_path=FIX / cond / "last.pt", data_dir=FIX / "token_ids", progress=False)
    payload, _ = halting(run)
    return payload["paper"], collect(run, np.arange(windows) * cfg.model.seq_len)


def official_protocol(cond: str) -> tuple[int, int, float]:
    """(windows, batch size, epsilon) of the official halting scripts' commands for `cond`
    (scripts/commands.sh). loopscale runs the curve and the calibration on one set of windows
    with the scripts' threshold counts, so the commands must agree on those."""
    curves = [f"early_exit_curve_{g}" for g in ("sequence", "token")]
    halts = [f"adaptive_halt_{PAPER_POLICY[p]}" for p in POLICIES]
    windows = {eval_windows("early_exit_curve", cond, o) for o in curves} | \
        {eval_windows("adaptive_halt_benchmark", cond, o) for o in halts} | \
        {int(flag("adaptive_halt_benchmark", cond, "--batch-size", o)) * int(flag("adaptive_halt_benchmark", cond, "--bench-batches", o))
         for o in halts}
    batches = {int(flag("early_exit_curve", cond, "--batch-size", o)) for o in curves}
    assert {int(flag("early_exit_curve", cond, "--num-thresholds", o)) for o in curves} == {PAPER_CURVE_THRESHOLDS}
    assert {int(flag("adaptive_halt_benchmark", cond, "--num-thresholds", o)) for o in halts} == {PAPER_HALT_THRESHOLDS}
    targets = {float(flag("adaptive_halt_benchmark", cond, "--target-rel-ppl", o)) for o in halts}
    assert len(windows) == len(batches) == len(targets) == 1, (windows, batches, targets)
    return windows.pop(), batches.pop(), round(targets.pop() - 1, 12)

def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def close(a, b, rtol=2e-5, atol=2e-6) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol)


@pytest.mark.parametrize("granularity", ["sequence", "token"])
@pytest.mark.parametrize("cond", CONDS)
def test_curve_equals_official(cond, granularity):
    official = read_csv(FIX / cond / "eval" / f"early_exit_curve_{granularity}" / "early_exit_curve.csv")
    ours = paper_payload(cond)["curve"][granularity]
    ce, conf = exit_stats(cond)
    assert len(ours) == len(official)
    for o, r in zip(official, ours):
        policy = OFFICIAL_NAME.get(o["policy"], o["policy"])
        assert policy == r["policy"]
        K = len(r["exit_counts"])
        counts = [int(o[f"exit_K{i + 1}"]) for i in range(K)]
        assert int(o["num_items"]) == r["num_items"] and int(o["num_tokens"]) == r["num_tokens"]
        if not o["threshold"]:
            assert r["threshold"] is None
        else:
            assert close(o["threshold"], r["threshold"], atol=BAND[policy]), (policy, o["threshold"], r["threshold"])
        if counts != r["exit_counts"]:  # only units within the noise band of the threshold may move
            unit_ce, unit_tokens, score = paper_units(ce, conf[policy], granularity)
            moved = (np.abs(score[:, :K - 1] - float(o["threshold"])) <= BAND[policy]).any(axis=1)
            near = int(moved.sum())
            assert 0 < near and sum(abs(a - b) for a, b in zip(counts, r["exit_counts"])) <= 2 * near, \
                (policy, o["threshold"], counts, r["exit_counts"], near)
            # the PPL may move only by what the units within the band can change: each at most
            # the spread of its CE over the exits, over all the tokens (derived from this fixture
            # set's own exits, not a fixed relative tolerance that assumes its token count)
            spread = float((unit_ce[moved].max(axis=1) - unit_ce[moved].min(axis=1)).sum() / unit_tokens.sum())
            assert abs(math.log(float(o["ppl"])) - math.log(float(r["ppl"]))) <= spread + 1e-6, \
                (policy, o["ppl"], r["ppl"], spread)
            continue
        assert close(o["avg_loops"], r["avg_loops"]) and close(o["avg_loop_fraction"], r["avg_loop_fraction"])
        assert close(o["ppl"], r["ppl"]) and close(o["ce"], r["ce"])


@pytest.mark.parametrize("cond", CONDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_calibrated_halting_equals_official(cond, policy):
    (o,) = read_csv(FIX / cond / "eval" / f"adaptive_halt_{PAPER_POLICY[policy]}" / "adaptive_halt_benchmark.csv")
    r = paper_payload(cond)["calibrated"][policy]
    assert r["official_policy"] == o["policy"]
    assert close(o["threshold"], r["threshold"], atol=BAND[policy])
    for key in ("calib_fixed_ppl", "calib_dynamic_ppl", "calib_dynamic_avg_loops", "bench_fixed_ppl",
                "bench_dynamic_ppl", "bench_dynamic_avg_loops"):  # the *seconds* columns are wall clock
        assert close(o[key], r[key]), (key, o[key], r[key])
    assert r["bench_fixed_seconds"] > 0 and r["bench_speedup"] > 0


# ---------------------------------------------------------------------------
# the protocol's rules on hand-made numbers
# ---------------------------------------------------------------------------
def test_thresholds_bracket_the_early_exit_confidences():
    score = np.array([[0.1, 0.5, 9.0], [0.3, 0.2, 9.0]])  # the last exit's confidence is never used
    t = paper_thresholds(score, 3)
    np.testing.assert_allclose(t, [0.1 - 1e-6, 0.1, 0.25, 0.5, 0.5 + 1e-6])
    assert paper_exit_index(score, t[0]).tolist() == [0, 0]
    assert paper_exit_index(score, 0.25).tolist() == [1, 0]
    assert paper_exit_index(score, t[-1]).tolist() == [2, 2]


def test_calibration_is_in_sample_fewest_loops_lowest_threshold():
    # two windows of 2 tokens, K = 2: exiting early costs window 0 nothing and window 1 a lot
    ce = np.array([[[1.0, 1.0], [1.0, 1.0]], [[5.0, 1.0], [5.0, 1.0]]])  # [windows, T, K]
    conf = np.array([[[0.9, 1.0], [0.9, 1.0]], [[0.4, 1.0], [0.4, 1.0]]])
    unit_ce, tokens, score = paper_units(ce, conf, "sequence")
    assert unit_ce.tolist() == [[2.0, 2.0], [10.0, 2.0]] and tokens.tolist() == [2.0, 2.0]
    best = paper_calibrate(unit_ce, tokens, score, 1.01, n_thresholds=5)
    # τ in (0.4, 0.9]: window 0 exits at 1 (1.5 loops, PPL e^1); the lowest such threshold is 0.525
    assert best["calib_dynamic_avg_loops"] == 1.5 and math.isclose(best["threshold"], 0.525, rel_tol=1e-6)
    assert math.isclose(best["calib_fixed_ppl"], math.e) and math.isclose(best["calib_dynamic_ppl"], math.e)
    rows = paper_curve(ce, {p: conf for p in POLICIES}, "token", n_thresholds=5)
    assert [r["policy"] for r in rows[:2]] == ["fixed_K1", "fixed_K2"]
    assert math.isclose(rows[0]["ce"], 3.0) and rows[0]["exit_counts"] == [4, 0]
    sweep = [r for r in rows if r["policy"] == "max_prob"]
    assert [r["avg_loops"] for r in sweep] == sorted(r["avg_loops"] for r in sweep)


@pytest.mark.parametrize("n_loops", [1, 2])
def test_paper_protocol_on_a_shallow_model(n_loops):
    """K = 1 (no early exit possible) and K = 2 run through; every unit exits at some k <= K."""
    torch.manual_seed(0)
    cfg = RunConfig.from_dict(merge(RunConfig().to_dict(), {"model": {
        "vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "seq_len": 8, "n_loops": n_loops},
        "data": {"vocab_size": 64}}))
    model = LoopedLM(cfg.model).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokens = np.random.default_rng(0).integers(0, 64, size=200).astype(np.int64)
    run = EvalRun(model=model, cfg=cfg, ecfg=EvalConfig(batch_size=4, halting_tokens=128), tokens=tokens,
                  device=torch.device("cpu"), step=None, status="ok", model_path=Path("model.pt"),
                  data_dir=Path("data"), progress=False)
    paper = halting(run)[0]["paper"]
    assert paper["windows"] == 16
    for g, rows in paper["curve"].items():
        n_units = 16 if g == "sequence" else 128
        assert [r["policy"] for r in rows[:n_loops]] == [f"fixed_K{k}" for k in range(1, n_loops + 1)]
        assert all(sum(r["exit_counts"]) == n_units and 1 <= r["avg_loops"] <= n_loops for r in rows)
    for c in paper["calibrated"].values():
        assert c["calib_dynamic_ppl"] <= 1.01 * c["calib_fixed_ppl"] * (1 + 1e-9)
        assert math.isclose(c["bench_fixed_ppl"], c["calib_fixed_ppl"], rel_tol=1e-5)
        assert math.isclose(c["bench_dynamic_ppl"], c["calib_dynamic_ppl"], rel_tol=1e-5)
        assert math.isclose(c["bench_dynamic_avg_loops"], c["calib_dynamic_avg_loops"], rel_tol=1e-9)
        if n_loops == 1:
            assert c["calib_dynamic_avg_loops"] == 1.0
