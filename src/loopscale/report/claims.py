"""The paper's claims, each with a verdict computed from the runs by a fixed rule.

The rules and their thresholds below were fixed before any result was looked at; they are
not to be tuned to make a claim pass. Each rule is applied twice: to the seed means of the
completed runs, and to every seed on its own (the runs of that seed, conditions matched by
seed). The verdict states both:

  reproduced (3/3 seeds)       the rule holds on the seed means and in every seed
  not reproduced (0/3 seeds)   the rule fails on the seed means and in every seed
  mixed: 2/3 seeds             the seeds disagree (or the seed means disagree with all seeds):
                               the rule holds in 2 of the 3 seeds where it could be evaluated;
                               the seed-mean verdict follows in brackets
  not run at this scale        a condition (or diagnostic) the rule needs has no completed run

A seed enters the count only when the rule can be evaluated on it (every condition the rule
needs has a completed run with that seed).

Conditions are matched by readout × loss × regularizer × recurrence within one model size
(so depth K, width d and data are matched). Values are seed means over completed runs only;
diverged and failed runs never enter them.

Rules (d = model width, √d = norm of an N(0,1) embedding row, the paper's init scale):

 (a) drift            ‖H_K‖(per-loop CE + RMSNorm) ≥ DRIFT_RATIO_MIN × ‖H_K‖(per-loop CE + raw)
 (b) small norms      every present scale-visible condition (terminal/per-loop CE + raw readout,
                      terminal/per-loop CE + RMSNorm + norm penalty) has ‖H_K‖ ≤ SMALL_NORM_MAX_PER_SQRT_D·√d
 (c) inter-loop norm  per-loop CE + RMSNorm + inter-loop norm has ‖H_K‖ ≤ SMALL_NORM_MAX_PER_SQRT_D·√d and
                      the residual per-loop CE + RMSNorm model's ‖H_K‖ is ≥ DRIFT_RATIO_MIN × it
 (d) radial fraction  max over loops and over RMSNorm/LayerNorm-readout conditions of the radial fraction
                      ≤ RADIAL_INVISIBLE_MAX, and every raw-readout condition's mean over loops
                      ≥ RADIAL_VISIBLE_MIN
 (e) K-invariance     R = (max_k PPL_k − min_k PPL_k) / min_k PPL_k over exits k = 1..K;
                      R(per-loop CE + RMSNorm) ≤ K_INVARIANCE_RATIO_MAX × R(per-loop CE + raw)
 (f) scale control    every present scale-controlled per-loop variant of the paper (raw readout,
                      final-only norm, RMSNorm + norm penalty) has final-exit PPL
                      ≤ (1 − PPL_GAIN_MIN) × PPL of per-loop CE + RMSNorm at the same K
 (g) clamp            on per-loop CE + RMSNorm, the seed mean of |ΔCE| at exit K of the official freeze_loop1
                      clamp ≤ max(CLAMP_GAP_FRACTION × |CE_K(per-loop RMSNorm) − CE_K(per-loop raw)|,
                      CLAMP_FLOOR_NATS); the other clamps (official remove_radial, ...) are reported beside it
                      (only the floor when the raw condition is absent)

Amended after results (the rules above are kept as first registered; claims.md shows their
verdicts beside the amended ones, with the reason). Each amendment is justified from the
paper's text or the official code only:

 (c) accumulation     A = ‖H_K‖/‖H_1‖ (exit norms of one pass); A(per-loop CE + RMSNorm + inter-loop norm)
                      ≤ ACCUMULATION_MAX and A(residual per-loop CE + RMSNorm) ≥ ACCUMULATION_RATIO_MIN × it.
                      Because the paper's fix removes the scale from the *recurrence path* (loop k+1 receives
                      a state of fixed RMS, so scale cannot accumulate across loops); it does not bound the
                      magnitude one pass of the stack writes, which the registered rule tested. The
                      magnitude ‖H_K‖ and its growth over training stay in the row as reported facts.
 (e2) depth gain      G = (PPL_1 − PPL_K)/PPL_1; every present scale-controlled per-loop variant has
                      G ≥ max(DEPTH_GAIN_RATIO_MIN × G(per-loop CE + RMSNorm), PPL_GAIN_MIN). Added because
                      the paper's K-invariance claim has two halves (Table 1, 129M: the drifting model's
                      exits are flat, the scale-controlled variants gain from depth); (e) tests only the first.
 (f) matched depth    every present scale-controlled variant has PPL_k ≤ (1 − PPL_GAIN_MIN) × PPL_k(per-loop
                      CE + RMSNorm) at every exit k = 2..K. Because the paper's frontier claim (Table 1's
                      exits, Table 5) compares the variants at matched depth, not only at K.
 (g) freeze_loop1     on per-loop CE + RMSNorm, the seed mean of |ΔCE| at exit K under `freeze_loop1`
                      ≤ the registered threshold; the official `remove_radial` is reported beside it.
                      Because the paper's clamp "rescales the hidden state to its loop-1 magnitude"
                      (`freeze_loop1` of the official radial_clamp_intervention.py); `remove_radial` removes
                      the update's radial component, another intervention.

Robustness: every rule is re-evaluated on the seed means over a range of its threshold
(`ClaimSpec.grid`, the registered value among them); claims.md prints the verdict at each,
so a verdict that hinges on the exact bound is visible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import paper
from .aggregate import Group, clamp_modes, exits, final_exit, radial_loops, stats, training_norms
from .fmt import num
from ..registry import Condition, condition
from .runs import Size, finite

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
NOT_RUN = "not run at this scale"
MIXED = "mixed"

# ---- thresholds (fixed in advance; see the module docstring) ----
DRIFT_RATIO_MIN = 10.0  # (a), (c): drift = ‖H_K‖ at least 10× the scale-controlled model's
SMALL_NORM_MAX_PER_SQRT_D = 10.0  # (b), (c): "small" = ‖H_K‖ ≤ 10·√d (paper: 17–83 at d=512/768, ≤ 3·√d)
RADIAL_INVISIBLE_MAX = 1e-6  # (d): float noise for scale-invariant readouts (paper ~1e-9)
RADIAL_VISIBLE_MIN = 1e-4  # (d): clearly larger for raw readouts (100× the noise bound; paper ~1e-2)
K_INVARIANCE_RATIO_MAX = 0.5  # (e): the drifting model's exit-PPL range at most half the raw model's
PPL_GAIN_MIN = 0.01  # (f): at least 1% lower final-exit PPL
CLAMP_GAP_FRACTION = 0.25  # (g): |ΔCE| at most a quarter of the RMSNorm-vs-raw CE gap ...
CLAMP_FLOOR_NATS = 0.01  # ... or 0.01 nats (1% PPL), whichever is larger
# amended / added after results (see the module docstring)
ACCUMULATION_MAX = 1.5  # (c): ‖H_K‖/‖H_1‖ with inter-loop norm near 1 (one pass's output, not K passes')
ACCUMULATION_RATIO_MIN = 2.0  # (c): the residual model accumulates at least twice as much
DEPTH_GAIN_RATIO_MIN = 2.0  # (e2): scale-controlled variants gain at least twice the drifting model's
FREEZE_MODE = "freeze_loop1"  # (g): the paper's clamp
REGISTERED_CLAMP_MODES = ("remove_radial", "freeze_loop1")  # (g) as registered: the worse of these two

PER_LOOP_RMS = condition("rmsnorm", "per_loop")
PER_LOOP_RAW = condition("raw", "per_loop")
TERMINAL_RAW = condition("raw", "terminal")
PER_LOOP_FINAL = condition("final_norm", "per_loop")
PER_LOOP_PENALTY = condition("rmsnorm", "per_loop", "norm_penalty")
TERMINAL_PENALTY = condition("rmsnorm", "terminal", "norm_penalty")
INTER_LOOP = condition("rmsnorm", "per_loop", "none", "inter_loop_norm")
SCALE_VISIBLE = (PER_LOOP_RAW, TERMINAL_RAW, PER_LOOP_PENALTY, TERMINAL_PENALTY)
SCALE_CONTROLLED = (PER_LOOP_RAW, PER_LOOP_FINAL, PER_LOOP_PENALTY)


@dataclass
class CondStats:
    """Seed means of one condition at one size (completed runs only)."""
    cond: Condition
    n: int  # completed seeds
    n_runs: int
    d_model: int
    K: int
    runs_text: str = ""
    norm_K: float = math.nan
    ppl_K: float = math.nan
    ce_K: float = math.nan
    exit_ppl: list = field(default_factory=list)  # seed-mean PPL per exit k=1..K
    exit_norm: list = field(default_factory=list)  # seed-mean ‖H_k‖ per exit k=1..K
    accumulation: float = math.nan  # seed mean of ‖H_K‖/‖H_1‖ (per run, then averaged)
    growth: float = math.nan  # seed mean of the exponent b of ‖H_K‖ ∝ t^b over the training log
    radial: list = field(default_factory=list)  # seed-mean radial fraction per exit k=1..K
    clamp_dce: dict = field(default_factory=dict)  # clamp mode -> seed mean of |ΔCE| at exit K


@dataclass
class ClaimResult:
    id: str
    claim: str
    paper: str
    ours: str
    verdict: str
    rule: str
    size: str = ""
    mean_verdict: str = ""  # the rule on the seed means ("" until evaluate_groups sets it)
    seed_verdicts: dict = field(default_factory=dict)  # seed -> the rule on that seed alone
    registered_rule: str = ""  # the rule as first registered, where it was amended after results
    registered_verdict: str = ""  # its verdict (seed means and per seed)
    amendment: str = ""  # "amended after results, because …" / "added after results, because …"
    robustness: str = ""  # the seed-mean verdict over a range of the rule's threshold

    @property
    def outcome(self) -> str:
        """reproduced | not reproduced | mixed | not run at this scale (the verdict without counts)."""
        return MIXED if self.verdict.startswith(MIXED) else self.verdict.split(" (", 1)[0]

    def per_seed_text(self) -> str:
        return "; ".join(f"{s}: {v}" for s, v in self.seed_verdicts.items())

    def as_dict(self) -> dict:
        ev = [v for v in self.seed_verdicts.values() if v != NOT_RUN]
        return {"size": self.size, "id": self.id, "claim": self.claim, "paper": self.paper, "ours": self.ours,
                "verdict": self.verdict, "outcome": self.outcome, "verdict_seed_means": self.mean_verdict or self.verdict,
                "seeds_reproduced": sum(v == REPRODUCED for v in ev), "seeds_evaluated": len(ev),
                "per_seed": self.per_seed_text(), "rule": self.rule, "robustness": self.robustness,
                "amendment": self.amendment, "registered_rule": self.registered_rule,
                "registered_verdict": self.registered_verdict}


def combine(mean: str, per_seed: dict) -> str:
    """The verdict from the seed-mean verdict and the per-seed ones (see the module docstring)."""
    if mean == NOT_RUN:
        return NOT_RUN
    ev = [v for v in per_seed.values() if v != NOT_RUN]
    if not ev:  # no seed has every condition the rule needs (e.g. conditions run with different seeds)
        return f"{mean} (seed means only; no seed has every condition)"
    k, n = sum(v == REPRODUCED for v in ev), len(ev)
    if all(v == mean for v in ev):
        return f"{mean} ({k}/{n} seed{'s' if n > 1 else ''})"
    return f"{MIXED}: {k}/{n} seeds (seed means: {mean})"


def condition_stats(g: Group) -> CondStats:
    used = g.used
    fe = [final_exit(r) for r in used]
    per_k: dict = {}
    for r in used:
        for row in exits(r)[0] or []:
            per_k.setdefault(int(row["k"]), []).append(row.get("ppl"))
    rad: dict = {}
    for r in used:
        for row in radial_loops(r) or []:
            rad.setdefault(int(row["k"]), []).append(row.get("radial_fraction"))
    dce: dict = {}
    for r in used:
        for mode, rows in (clamp_modes(r) or {}).items():
            if mode == "none" or not rows:
                continue
            last = max(rows, key=lambda x: x.get("k", 0))
            v = last.get("delta_ce")
            dce.setdefault(mode, []).append(abs(v) if finite(v) else v)  # |ΔCE| per seed: no cancellation
    per_k_norm: dict = {}
    acc, growth = [], []
    for r in used:
        rows = exits(r)[0] or []
        for row in rows:
            per_k_norm.setdefault(int(row["k"]), []).append(row.get("norm"))
        n = [row.get("norm") for row in rows]
        if len(n) >= 2 and finite(n[0]) and finite(n[-1]) and n[0] > 0:
            acc.append(n[-1] / n[0])
        growth.append(training_growth(r))
    return CondStats(cond=g.cond, n=len(used), n_runs=len(g.runs), d_model=g.d_model, K=g.K, runs_text=g.runs_text(),
                     norm_K=stats(f["norm"] for f in fe)[0], ppl_K=stats(f["ppl"] for f in fe)[0],
                     ce_K=stats(f["ce"] for f in fe)[0],
                     exit_ppl=[stats(per_k[k])[0] for k in sorted(per_k)],
                     exit_norm=[stats(per_k_norm[k])[0] for k in sorted(per_k_norm)],
                     accumulation=stats(acc)[0], growth=stats(growth)[0],
                     radial=[stats(rad[k])[0] for k in sorted(rad)],
                     clamp_dce={m: stats(v)[0] for m, v in sorted(dce.items())})


def training_growth(run, from_fraction: float = 0.2) -> float:
    """Exponent b of ‖H_K‖ ∝ t^b over one run's training log (least squares in log-log, on the
    records from `from_fraction` of the last logged step on); NaN with fewer than 3 records."""
    pts = [(s, v) for s, v in training_norms(run) if s > 0 and finite(v) and v > 0]
    if not pts:
        return math.nan
    last = max(s for s, _ in pts)
    pts = [(s, v) for s, v in pts if s >= from_fraction * last]
    if len(pts) < 3 or len({s for s, _ in pts}) < 2:
        return math.nan
    x = [math.log(s) for s, _ in pts]
    y = [math.log(v) for _, v in pts]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else math.nan


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
class _Missing(Exception):
    pass


def _get(table: dict, cond: Condition, what: str = "") -> CondStats:
    """The condition's stats, or _Missing naming why it cannot be used."""
    s = table.get(cond)
    if s is None:
        raise _Missing(f"{cond.label}: no runs")
    if s.n == 0:
        raise _Missing(f"{cond.label}: {s.runs_text}")
    if what == "norm" and not finite(s.norm_K):
        raise _Missing(f"{cond.label}: no ‖H_K‖")
    if what == "ppl" and not finite(s.ppl_K):
        raise _Missing(f"{cond.label}: no final-exit PPL")
    if what == "exits" and (len([p for p in s.exit_ppl if finite(p)]) < 2):
        raise _Missing(f"{cond.label}: fewer than two exit PPLs")
    if what == "radial" and not [v for v in s.radial if finite(v)]:
        raise _Missing(f"{cond.label}: no eval/radial.json")
    if what == "clamp" and not [v for v in s.clamp_dce.values() if finite(v)]:
        raise _Missing(f"{cond.label}: no eval/clamp.json")
    if what == FREEZE_MODE and not finite(s.clamp_dce.get(FREEZE_MODE)):
        raise _Missing(f"{cond.label}: no {FREEZE_MODE} clamp in eval/clamp.json")
    if what == "accumulation" and not finite(s.accumulation):
        raise _Missing(f"{cond.label}: no ‖H_1‖, ‖H_K‖ exit norms")
    return s


def _present(table: dict, conds, what: str) -> tuple[list, list]:
    got, missing = [], []
    for c in conds:
        try:
            got.append(_get(table, c, what))
        except _Missing as e:
            missing.append(str(e))
    return got, missing


def _not_run(cid, claim, paper_txt, rule, why) -> ClaimResult:
    return ClaimResult(cid, claim, paper_txt, "missing: " + "; ".join(why), NOT_RUN, rule)


def _rel_range(ppl: list) -> float:
    v = [p for p in ppl if finite(p)]
    return (max(v) - min(v)) / min(v)


def _sqrt_d(s: CondStats) -> float:
    return math.sqrt(s.d_model) if s.d_model else math.nan


# ---------------------------------------------------------------------------
# the claims
# ---------------------------------------------------------------------------
def claim_drift(t: dict, ratio_min: float = DRIFT_RATIO_MIN) -> ClaimResult:
    cid, claim = "a", "Per-loop CE through an RMSNorm readout lets ‖H_K‖ drift"
    p = (f"‖H_K‖ ≈ {paper.NORM_K_PER_LOOP_RMSNORM['44M']:,} (44M), {paper.NORM_K_PER_LOOP_RMSNORM['129M']:,} (129M) "
         f"vs tens ({paper.NORM_K_SCALE_VISIBLE_RANGE[0]}–{paper.NORM_K_SCALE_VISIBLE_RANGE[1]}) with the raw readout")
    rule = f"‖H_K‖(per-loop CE + RMSNorm) ≥ {ratio_min:g} × ‖H_K‖(per-loop CE + raw)"
    try:
        a, b = _get(t, PER_LOOP_RMS, "norm"), _get(t, PER_LOOP_RAW, "norm")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ratio = a.norm_K / b.norm_K
    ours = f"‖H_K‖ {num(a.norm_K)} vs {num(b.norm_K)} (ratio {num(ratio, 'ratio')})"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ratio >= ratio_min else NOT_REPRODUCED, rule)


def claim_small_norms(t: dict, max_per_sqrt_d: float = SMALL_NORM_MAX_PER_SQRT_D) -> ClaimResult:
    cid, claim = "b", "A raw readout or a norm penalty keeps ‖H_K‖ small"
    p = f"‖H_K‖ in the tens ({paper.NORM_K_SCALE_VISIBLE_RANGE[0]}–{paper.NORM_K_SCALE_VISIBLE_RANGE[1]}; d=512/768)"
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_VISIBLE)}}} has "
            f"‖H_K‖ ≤ {max_per_sqrt_d:g}·√d")
    got, missing = _present(t, SCALE_VISIBLE, "norm")
    if not got:
        return _not_run(cid, claim, p, rule, missing)
    ok = all(s.norm_K <= max_per_sqrt_d * _sqrt_d(s) for s in got)
    ours = "; ".join(f"{s.cond.label}: {num(s.norm_K)} ({num(s.norm_K / _sqrt_d(s))}·√d)" for s in got)
    ref = t.get(PER_LOOP_RMS)
    if ref is not None and ref.n and finite(ref.norm_K):
        ours += f"; for reference per-loop CE + RMSNorm readout: {num(ref.norm_K)}"
    if missing:
        ours += " (not run: " + "; ".join(missing) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


INTER_LOOP_CLAIM = "Inter-loop normalisation removes the drift"
INTER_LOOP_PAPER = ("named by the paper as a fix that removes the scale from the recurrence path; no runs shipped "
                    "(loopscale addition)")


def claim_inter_loop(t: dict, max_per_sqrt_d: float = SMALL_NORM_MAX_PER_SQRT_D,
                     ratio_min: float = DRIFT_RATIO_MIN) -> ClaimResult:
    """(c) as first registered: the final-state magnitude."""
    cid = "c"
    rule = (f"‖H_K‖(per-loop CE + RMSNorm + inter-loop norm) ≤ {max_per_sqrt_d:g}·√d and "
            f"‖H_K‖(per-loop CE + RMSNorm, residual) ≥ {ratio_min:g} × it")
    try:
        il, base = _get(t, INTER_LOOP, "norm"), _get(t, PER_LOOP_RMS, "norm")
    except _Missing as e:
        return _not_run(cid, INTER_LOOP_CLAIM, INTER_LOOP_PAPER, rule, [str(e)])
    small = il.norm_K <= max_per_sqrt_d * _sqrt_d(il)
    ratio = base.norm_K / il.norm_K
    ours = (f"‖H_K‖ {num(il.norm_K)} ({num(il.norm_K / _sqrt_d(il))}·√d) with inter-loop norm vs {num(base.norm_K)} "
            f"without (ratio {num(ratio, 'ratio')})")
    return ClaimResult(cid, INTER_LOOP_CLAIM, INTER_LOOP_PAPER, ours,
                       REPRODUCED if small and ratio >= ratio_min else NOT_REPRODUCED, rule)


def claim_accumulation(t: dict, max_accumulation: float = ACCUMULATION_MAX,
                       ratio_min: float = ACCUMULATION_RATIO_MIN) -> ClaimResult:
    """(c) amended: the scale no longer accumulates across loops."""
    cid = "c"
    rule = (f"A = ‖H_K‖/‖H_1‖ over one pass; A(per-loop CE + RMSNorm + inter-loop norm) ≤ {max_accumulation:g} and "
            f"A(per-loop CE + RMSNorm, residual) ≥ {ratio_min:g} × it")
    try:
        il, base = _get(t, INTER_LOOP, "accumulation"), _get(t, PER_LOOP_RMS, "accumulation")
    except _Missing as e:
        return _not_run(cid, INTER_LOOP_CLAIM, INTER_LOOP_PAPER, rule, [str(e)])
    ok = il.accumulation <= max_accumulation and base.accumulation >= ratio_min * il.accumulation
    facts = f"; ‖H_K‖ {num(il.norm_K)} ({num(il.norm_K / _sqrt_d(il))}·√d) vs {num(base.norm_K)} residual"
    if finite(il.growth):
        facts += f"; with inter-loop norm ‖H_K‖ still grows over training ∝ t^{il.growth:.2f}"
        if finite(base.growth):
            facts += f" (residual t^{base.growth:.2f})"
    ours = (f"‖H_K‖/‖H_1‖ {num(il.accumulation)} with inter-loop norm vs {num(base.accumulation)} residual" + facts)
    return ClaimResult(cid, INTER_LOOP_CLAIM, INTER_LOOP_PAPER, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


def claim_radial(t: dict, tolerance: float = 1.0) -> ClaimResult:
    """`tolerance` > 1 loosens both bounds (the invisible one up, the visible one down) by that factor."""
    cid, claim = "d", "Scale-invariant readouts have ~zero radial gradient; the raw readout does not"
    p = f"radial fraction ~{paper.RADIAL_RMSNORM:.0e} (RMSNorm readout) vs ~{paper.RADIAL_RAW:.0e} (raw readout)"
    inv_max_thr, vis_min_thr = RADIAL_INVISIBLE_MAX * tolerance, RADIAL_VISIBLE_MIN / tolerance
    rule = (f"max over loops of every RMSNorm/LayerNorm-readout condition ≤ {inv_max_thr:.0e} and the mean "
            f"over loops of every raw-readout condition ≥ {vis_min_thr:.0e}")
    inv_conds = sorted((c for c in t if c.scale_invariant_readout), key=Condition.sort_key)
    vis_conds = sorted((c for c in t if c.raw_readout), key=Condition.sort_key)
    inv, miss_i = _present(t, inv_conds, "radial")
    vis, miss_v = _present(t, vis_conds, "radial")
    why = []
    if not inv:
        why.append("no RMSNorm/LayerNorm-readout condition with radial data" + (f" ({'; '.join(miss_i)})" if miss_i else ""))
    if not vis:
        why.append("no raw-readout condition with radial data" + (f" ({'; '.join(miss_v)})" if miss_v else ""))
    if why:
        return _not_run(cid, claim, p, rule, why)
    inv_max = max(max(v for v in s.radial if finite(v)) for s in inv)
    vis_means = [stats(s.radial)[0] for s in vis]
    ok = inv_max <= inv_max_thr and min(vis_means) >= vis_min_thr
    ours = (f"scale-invariant max {num(inv_max, 'sci')} ({len(inv)} condition(s)); raw mean "
            + ", ".join(f"{num(m, 'sci')} ({s.cond.label})" for s, m in zip(vis, vis_means)))
    if miss_i or miss_v:
        ours += " (not run: " + "; ".join(miss_i + miss_v) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


def claim_k_invariance(t: dict, ratio_max: float = K_INVARIANCE_RATIO_MAX) -> ClaimResult:
    cid, claim = "e", "The drifting model is K-invariant: more loops stop helping"
    rms, raw = paper.PPL_129M[PER_LOOP_RMS.base], paper.PPL_129M[PER_LOOP_RAW.base]
    pr, pw = _rel_range(list(rms)), _rel_range(list(raw))
    p = (f"129M exit PPL k=1..4: RMSNorm {'/'.join(f'{x:.2f}' for x in rms)} (R={num(pr, 'pct')}) vs raw "
         f"{'/'.join(f'{x:.2f}' for x in raw)} (R={num(pw, 'pct')}); ratio {pr / pw:.2f}")
    rule = (f"R = (max_k PPL_k − min_k PPL_k)/min_k PPL_k over exits k=1..K; "
            f"R(per-loop CE + RMSNorm) ≤ {ratio_max:g} × R(per-loop CE + raw)")
    try:
        a, b = _get(t, PER_LOOP_RMS, "exits"), _get(t, PER_LOOP_RAW, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ra, rb = _rel_range(a.exit_ppl), _rel_range(b.exit_ppl)
    ratio = ra / rb if rb > 0 else math.inf
    ours = (f"RMSNorm {'/'.join(num(x) for x in a.exit_ppl)} (R={num(ra, 'pct')}) vs raw "
            f"{'/'.join(num(x) for x in b.exit_ppl)} (R={num(rb, 'pct')}); ratio {num(ratio)}")
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ratio <= ratio_max else NOT_REPRODUCED, rule)


def _depth_gain(ppl: list) -> float:
    v = [p for p in ppl if finite(p)]
    return (v[0] - v[-1]) / v[0] if len(v) >= 2 and len(v) == len(ppl) else math.nan


def claim_depth_gain(t: dict, ratio_min: float = DEPTH_GAIN_RATIO_MIN) -> ClaimResult:
    """(e2), added after results: the scale-controlled variants do gain from depth."""
    cid, claim = "e2", "Scale-controlled variants gain from depth where the drifting model does not"
    p = "129M gain G = (PPL_1 − PPL_4)/PPL_1: " + ", ".join(
        f"{lbl} {num(_depth_gain(list(paper.PPL_129M[c.base])), 'pct')}"
        for lbl, c in (("RMSNorm", PER_LOOP_RMS), ("raw", PER_LOOP_RAW), ("final-only norm", PER_LOOP_FINAL),
                       ("norm penalty", PER_LOOP_PENALTY)))
    rule = (f"G = (PPL_1 − PPL_K)/PPL_1 over exits; every present condition of "
            f"{{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has G ≥ max({ratio_min:g} × G(per-loop CE + RMSNorm), "
            f"{PPL_GAIN_MIN:g})")
    try:
        ref = _get(t, PER_LOOP_RMS, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    got, missing = _present(t, SCALE_CONTROLLED, "exits")
    got = [s for s in got if len(s.exit_ppl) == len(ref.exit_ppl)]
    if not got:
        return _not_run(cid, claim, p, rule, missing or ["no scale-controlled condition at the same K"])
    g_ref = _depth_gain(ref.exit_ppl)
    if not finite(g_ref):
        return _not_run(cid, claim, p, rule, [f"{ref.cond.label}: an exit PPL is missing"])
    thr = max(ratio_min * g_ref, PPL_GAIN_MIN)
    gains = [(s, _depth_gain(s.exit_ppl)) for s in got]
    ok = all(finite(g) and g >= thr for _, g in gains)
    ours = f"G RMSNorm {num(g_ref, 'spct')} (threshold {num(thr, 'pct')}) vs " + ", ".join(
        f"{s.cond.label}: {num(g, 'spct')}" for s, g in gains)
    if missing:
        ours += " (not run: " + "; ".join(missing) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


SCALE_CONTROL_CLAIM = "Scale-controlled variants reach lower PPL than per-loop CE + RMSNorm"


def _scale_control_paper() -> str:
    base = paper.PPL_129M[PER_LOOP_RMS.base][-1]
    return (f"129M PPL at K=4: RMSNorm {base:.2f} vs " +
            ", ".join(f"{c.label.split(' + ', 1)[1]} {paper.PPL_129M[c.base][-1]:.2f}" for c in SCALE_CONTROLLED))


def claim_scale_control(t: dict, gain_min: float = PPL_GAIN_MIN) -> ClaimResult:
    """(f) as first registered: the final exit only."""
    cid, claim, p = "f", SCALE_CONTROL_CLAIM, _scale_control_paper()
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has final-exit PPL "
            f"≤ (1 − {gain_min:g}) × PPL(per-loop CE + RMSNorm) at the same K")
    try:
        ref = _get(t, PER_LOOP_RMS, "ppl")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    got, missing = _present(t, SCALE_CONTROLLED, "ppl")
    if not got:
        return _not_run(cid, claim, p, rule, missing)
    ok = all(s.ppl_K <= (1 - gain_min) * ref.ppl_K for s in got)
    ours = f"RMSNorm {num(ref.ppl_K)} vs " + ", ".join(
        f"{s.cond.label}: {num(s.ppl_K)} ({num(s.ppl_K / ref.ppl_K - 1, 'spct')})" for s in got)
    if missing:
        ours += " (not run: " + "; ".join(missing) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


def claim_matched_depth(t: dict, gain_min: float = PPL_GAIN_MIN) -> ClaimResult:
    """(f) amended: lower PPL at every matched depth k = 2..K."""
    cid, claim = "f", SCALE_CONTROL_CLAIM
    p = _scale_control_paper() + "; lower at every exit k = 2..4 too (Table 1)"
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has PPL_k "
            f"≤ (1 − {gain_min:g}) × PPL_k(per-loop CE + RMSNorm) at every exit k = 2..K")
    try:
        ref = _get(t, PER_LOOP_RMS, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    got, missing = _present(t, SCALE_CONTROLLED, "exits")
    got = [s for s in got if len(s.exit_ppl) == len(ref.exit_ppl)]
    if not got:
        return _not_run(cid, claim, p, rule, missing or ["no scale-controlled condition at the same K"])
    ks = range(1, len(ref.exit_ppl))  # 0-based exits 2..K

    def worst(s: CondStats) -> float:  # the largest PPL_k(s)/PPL_k(ref) over k = 2..K
        r = [s.exit_ppl[i] / ref.exit_ppl[i] for i in ks if finite(s.exit_ppl[i]) and finite(ref.exit_ppl[i])]
        return max(r) if len(r) == len(ks) else math.nan

    w = [(s, worst(s)) for s in got]
    ok = all(finite(x) and x <= 1 - gain_min for _, x in w)
    ours = "worst ratio to RMSNorm over k=2..K: " + ", ".join(
        f"{s.cond.label}: {num(x - 1, 'spct')} (exits {'/'.join(num(v) for v in s.exit_ppl)})" for s, x in w) + \
        f"; RMSNorm exits {'/'.join(num(v) for v in ref.exit_ppl)}"
    if missing:
        ours += " (not run: " + "; ".join(missing) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


CLAMP_CLAIM = "Clamping the scale of the drifting model barely changes CE"
CLAMP_PAPER = "rescaling the hidden state to its loop-1 magnitude changes CE very little"


def _clamp_threshold(t: dict, a: CondStats, fraction: float) -> tuple[float, float]:
    gap = math.nan
    try:
        b = _get(t, PER_LOOP_RAW, "ppl")
        if finite(a.ce_K) and finite(b.ce_K):
            gap = abs(a.ce_K - b.ce_K)
    except _Missing:
        pass
    return (max(fraction * gap, CLAMP_FLOOR_NATS) if finite(gap) else CLAMP_FLOOR_NATS), gap


def _clamp_text(a: CondStats, thr: float, gap: float) -> str:
    return (", ".join(f"{m} |ΔCE| {abs(v):.4f}" for m, v in a.clamp_dce.items() if finite(v)) +
            f" nats; threshold {thr:.4f} nats" +
            (f" (CE gap to raw {gap:.4f})" if finite(gap) else " (raw condition absent: floor only)"))


def claim_clamp(t: dict, fraction: float = CLAMP_GAP_FRACTION) -> ClaimResult:
    """(g) as first registered: the worse of every clamp mode."""
    cid = "g"
    rule = (f"on per-loop CE + RMSNorm, max over clamps (remove_radial, freeze_loop1) of the seed mean of |ΔCE| "
            f"at exit K ≤ max({fraction:g} × |CE_K(per-loop RMSNorm) − CE_K(per-loop raw)|, {CLAMP_FLOOR_NATS:g} nats)")
    try:
        a = _get(t, PER_LOOP_RMS, "clamp")
    except _Missing as e:
        return _not_run(cid, CLAMP_CLAIM, CLAMP_PAPER, rule, [str(e)])
    thr, gap = _clamp_threshold(t, a, fraction)
    modes = [abs(a.clamp_dce[m]) for m in REGISTERED_CLAMP_MODES if finite(a.clamp_dce.get(m))]
    if not modes:
        return _not_run(cid, CLAMP_CLAIM, CLAMP_PAPER, rule, [f"{PER_LOOP_RMS.label}: no remove_radial or "
                                                             f"freeze_loop1 clamp in eval/clamp.json"])
    worst = max(modes)
    return ClaimResult(cid, CLAMP_CLAIM, CLAMP_PAPER, _clamp_text(a, thr, gap),
                       REPRODUCED if worst <= thr else NOT_REPRODUCED, rule)


def claim_freeze(t: dict, fraction: float = CLAMP_GAP_FRACTION) -> ClaimResult:
    """(g) amended: the paper's clamp, freeze_loop1; the other modes are reported beside it."""
    cid = "g"
    rule = (f"on per-loop CE + RMSNorm, the seed mean of |ΔCE| at exit K under {FREEZE_MODE} "
            f"≤ max({fraction:g} × |CE_K(per-loop RMSNorm) − CE_K(per-loop raw)|, {CLAMP_FLOOR_NATS:g} nats); "
            f"remove_radial reported beside it")
    try:
        a = _get(t, PER_LOOP_RMS, FREEZE_MODE)
    except _Missing as e:
        return _not_run(cid, CLAMP_CLAIM, CLAMP_PAPER, rule, [str(e)])
    thr, gap = _clamp_threshold(t, a, fraction)
    v = abs(a.clamp_dce[FREEZE_MODE])
    return ClaimResult(cid, CLAMP_CLAIM, CLAMP_PAPER, _clamp_text(a, thr, gap),
                       REPRODUCED if v <= thr else NOT_REPRODUCED, rule)


# ---------------------------------------------------------------------------
# the claims as registered, amended and added, with their robustness grids
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ClaimSpec:
    """One claim: the rule in force (`fn`, its threshold keyword `knob` and the grid of values
    the robustness line evaluates), and where it was amended after results, the rule as first
    registered (`registered`) and why (`amendment`)."""
    fn: object
    knob: str
    grid: tuple
    registered: object = None
    amendment: str = ""


CLAIM_SPECS = (
    ClaimSpec(claim_drift, "ratio_min", (3, 5, 10, 20, 50)),
    ClaimSpec(claim_small_norms, "max_per_sqrt_d", (3, 5, 10, 20, 40)),
    ClaimSpec(claim_accumulation, "max_accumulation", (1.1, 1.25, 1.5, 2.0, 3.0), registered=claim_inter_loop,
              amendment="amended after results, because the paper's fix removes the scale from the recurrence path "
                        "(loop k+1 receives a fixed-RMS state, so scale cannot accumulate across loops); one pass "
                        "of the stack still writes a large state, which the registered magnitude rule tested"),
    ClaimSpec(claim_radial, "tolerance", (0.01, 0.1, 1, 10, 100)),
    ClaimSpec(claim_k_invariance, "ratio_max", (0.25, 0.5, 0.75, 1.0)),
    ClaimSpec(claim_depth_gain, "ratio_min", (1.5, 2, 3, 5),
              amendment="added after results, because the paper's K-invariance claim has two halves (Table 1: the "
                        "scale-controlled variants gain from depth) and (e) tested only the drifting model's"),
    ClaimSpec(claim_matched_depth, "gain_min", (0, 0.005, 0.01, 0.02, 0.05), registered=claim_scale_control,
              amendment="amended after results, because the paper's frontier claim compares the variants at "
                        "matched depth (Table 1's exits, Table 5), not only at the final exit"),
    ClaimSpec(claim_freeze, "fraction", (0.1, 0.25, 0.5, 1.0), registered=claim_clamp,
              amendment="amended after results, because the paper's clamp rescales the state to its loop-1 "
                        "magnitude (freeze_loop1 in the official radial_clamp_intervention.py); remove_radial is "
                        "another intervention and is reported beside it"),
)
CLAIMS = tuple(spec.fn for spec in CLAIM_SPECS)  # the rules in force


def robustness(spec: ClaimSpec, table: dict) -> str:
    """The rule's verdict on `table` at each value of its threshold grid, e.g.
    'ratio_min 3, 5, 10: reproduced; 20, 50: not reproduced'."""
    by: dict = {}
    for v in spec.grid:
        by.setdefault(spec.fn(table, **{spec.knob: v}).verdict, []).append(f"{v:g}")
    if list(by) == [NOT_RUN]:
        return ""
    return f"{spec.knob} " + "; ".join(f"{', '.join(vs)}: {verdict}" for verdict, vs in by.items())


def evaluate(table: dict, size: str = "", specs=CLAIM_SPECS) -> list[ClaimResult]:
    """Every claim on one size: `table` maps Condition -> CondStats (the rules in force)."""
    out = []
    for spec in specs:
        r = spec.fn(table)
        r.size = size
        out.append(r)
    return out


def _registered(specs) -> tuple:
    return tuple(ClaimSpec(s.registered, "", ()) for s in specs if s.registered is not None)


def evaluate_groups(groups: list[Group], specs=CLAIM_SPECS) -> list[ClaimResult]:
    """Claims per model size (in size order), on the seed means and per seed; where a rule was
    amended, the registered rule's verdict beside it; a robustness line per claim."""
    by_size: dict[Size, list] = {}
    for g in groups:
        by_size.setdefault(g.size, []).append(g)
    out = []
    for size, gs in by_size.items():
        table = {g.cond: condition_stats(g) for g in gs}
        seeds = sorted({r.seed for g in gs for r in g.used if r.seed is not None})
        seed_tables = {s: {g.cond: condition_stats(_of_seed(g, s)) for g in gs} for s in seeds}

        def judged(specs_) -> list[ClaimResult]:
            results = evaluate(table, size.label, specs_)
            per_seed = {s: evaluate(seed_tables[s], specs=specs_) for s in seeds}
            for i, r in enumerate(results):
                r.mean_verdict = r.verdict
                r.seed_verdicts = {s: per_seed[s][i].verdict for s in seeds}
                r.verdict = combine(r.mean_verdict, r.seed_verdicts)
            return results

        results = judged(specs)
        registered = iter(judged(_registered(specs)))
        for spec, r in zip(specs, results):
            r.robustness = robustness(spec, table)
            r.amendment = spec.amendment
            if spec.registered is not None:
                reg = next(registered)
                r.registered_rule, r.registered_verdict = reg.rule, reg.verdict
        out += results
    return out


def _of_seed(g: Group, seed) -> Group:
    return Group(g.size, g.cond, [r for r in g.runs if r.seed == seed])


def claims_markdown(results: list[ClaimResult]) -> str:
    from .fmt import md_table
    multi = len({r.size for r in results}) > 1
    header = (["Size"] if multi else []) + ["Claim", "Paper", "Ours (seed means)", "Verdict", "Per seed", "Rule",
                                            "Robustness (seed means)", "As first registered"]

    def registered(r: ClaimResult) -> str:
        if r.registered_rule:
            return f"{r.amendment}. Registered rule: {r.registered_rule} → **{r.registered_verdict}**"
        return r.amendment or "as registered"

    rows = [([r.size] if multi else []) + [f"({r.id}) {r.claim}", r.paper, r.ours, f"**{r.verdict}**",
                                           r.per_seed_text() or "—", r.rule, r.robustness or "—", registered(r)]
            for r in results]
    return md_table(header, rows)
