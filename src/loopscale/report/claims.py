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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import paper
from .aggregate import Group, clamp_modes, exits, final_exit, radial_loops, stats
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
                "per_seed": self.per_seed_text(), "rule": self.rule}


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
    return CondStats(cond=g.cond, n=len(used), n_runs=len(g.runs), d_model=g.d_model, K=g.K, runs_text=g.runs_text(),
                     norm_K=stats(f["norm"] for f in fe)[0], ppl_K=stats(f["ppl"] for f in fe)[0],
                     ce_K=stats(f["ce"] for f in fe)[0],
                     exit_ppl=[stats(per_k[k])[0] for k in sorted(per_k)],
                     radial=[stats(rad[k])[0] for k in sorted(rad)],
                     clamp_dce={m: stats(v)[0] for m, v in sorted(dce.items())})


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
def claim_drift(t: dict) -> ClaimResult:
    cid, claim = "a", "Per-loop CE through an RMSNorm readout lets ‖H_K‖ drift"
    p = (f"‖H_K‖ ≈ {paper.NORM_K_PER_LOOP_RMSNORM['44M']:,} (44M), {paper.NORM_K_PER_LOOP_RMSNORM['129M']:,} (129M) "
         f"vs tens ({paper.NORM_K_SCALE_VISIBLE_RANGE[0]}–{paper.NORM_K_SCALE_VISIBLE_RANGE[1]}) with the raw readout")
    rule = f"‖H_K‖(per-loop CE + RMSNorm) ≥ {DRIFT_RATIO_MIN:g} × ‖H_K‖(per-loop CE + raw)"
    try:
        a, b = _get(t, PER_LOOP_RMS, "norm"), _get(t, PER_LOOP_RAW, "norm")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ratio = a.norm_K / b.norm_K
    ours = f"‖H_K‖ {num(a.norm_K)} vs {num(b.norm_K)} (ratio {num(ratio, 'ratio')})"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ratio >= DRIFT_RATIO_MIN else NOT_REPRODUCED, rule)


def claim_small_norms(t: dict) -> ClaimResult:
    cid, claim = "b", "A raw readout or a norm penalty keeps ‖H_K‖ small"
    p = f"‖H_K‖ in the tens ({paper.NORM_K_SCALE_VISIBLE_RANGE[0]}–{paper.NORM_K_SCALE_VISIBLE_RANGE[1]}; d=512/768)"
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_VISIBLE)}}} has "
            f"‖H_K‖ ≤ {SMALL_NORM_MAX_PER_SQRT_D:g}·√d")
    got, missing = _present(t, SCALE_VISIBLE, "norm")
    if not got:
        return _not_run(cid, claim, p, rule, missing)
    ok = all(s.norm_K <= SMALL_NORM_MAX_PER_SQRT_D * _sqrt_d(s) for s in got)
    ours = "; ".join(f"{s.cond.label}: {num(s.norm_K)} ({num(s.norm_K / _sqrt_d(s))}·√d)" for s in got)
    ref = t.get(PER_LOOP_RMS)
    if ref is not None and ref.n and finite(ref.norm_K):
        ours += f"; for reference per-loop CE + RMSNorm readout: {num(ref.norm_K)}"
    if missing:
        ours += " (not run: " + "; ".join(missing) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


def claim_inter_loop(t: dict) -> ClaimResult:
    cid, claim = "c", "Inter-loop normalisation removes the drift"
    p = "named by the paper as a fix; no runs shipped (loopscale addition)"
    rule = (f"‖H_K‖(per-loop CE + RMSNorm + inter-loop norm) ≤ {SMALL_NORM_MAX_PER_SQRT_D:g}·√d and "
            f"‖H_K‖(per-loop CE + RMSNorm, residual) ≥ {DRIFT_RATIO_MIN:g} × it")
    try:
        il, base = _get(t, INTER_LOOP, "norm"), _get(t, PER_LOOP_RMS, "norm")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    small = il.norm_K <= SMALL_NORM_MAX_PER_SQRT_D * _sqrt_d(il)
    ratio = base.norm_K / il.norm_K
    ours = (f"‖H_K‖ {num(il.norm_K)} ({num(il.norm_K / _sqrt_d(il))}·√d) with inter-loop norm vs {num(base.norm_K)} "
            f"without (ratio {num(ratio, 'ratio')})")
    return ClaimResult(cid, claim, p, ours, REPRODUCED if small and ratio >= DRIFT_RATIO_MIN else NOT_REPRODUCED,
                       rule)


def claim_radial(t: dict) -> ClaimResult:
    cid, claim = "d", "Scale-invariant readouts have ~zero radial gradient; the raw readout does not"
    p = f"radial fraction ~{paper.RADIAL_RMSNORM:.0e} (RMSNorm readout) vs ~{paper.RADIAL_RAW:.0e} (raw readout)"
    rule = (f"max over loops of every RMSNorm/LayerNorm-readout condition ≤ {RADIAL_INVISIBLE_MAX:.0e} and the mean "
            f"over loops of every raw-readout condition ≥ {RADIAL_VISIBLE_MIN:.0e}")
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
    ok = inv_max <= RADIAL_INVISIBLE_MAX and min(vis_means) >= RADIAL_VISIBLE_MIN
    ours = (f"scale-invariant max {num(inv_max, 'sci')} ({len(inv)} condition(s)); raw mean "
            + ", ".join(f"{num(m, 'sci')} ({s.cond.label})" for s, m in zip(vis, vis_means)))
    if miss_i or miss_v:
        ours += " (not run: " + "; ".join(miss_i + miss_v) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


def claim_k_invariance(t: dict) -> ClaimResult:
    cid, claim = "e", "The drifting model is K-invariant: more loops stop helping"
    rms, raw = paper.PPL_129M[PER_LOOP_RMS.base], paper.PPL_129M[PER_LOOP_RAW.base]
    pr, pw = _rel_range(list(rms)), _rel_range(list(raw))
    p = (f"129M exit PPL k=1..4: RMSNorm {'/'.join(f'{x:.2f}' for x in rms)} (R={num(pr, 'pct')}) vs raw "
         f"{'/'.join(f'{x:.2f}' for x in raw)} (R={num(pw, 'pct')}); ratio {pr / pw:.2f}")
    rule = (f"R = (max_k PPL_k − min_k PPL_k)/min_k PPL_k over exits k=1..K; "
            f"R(per-loop CE + RMSNorm) ≤ {K_INVARIANCE_RATIO_MAX:g} × R(per-loop CE + raw)")
    try:
        a, b = _get(t, PER_LOOP_RMS, "exits"), _get(t, PER_LOOP_RAW, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ra, rb = _rel_range(a.exit_ppl), _rel_range(b.exit_ppl)
    ratio = ra / rb if rb > 0 else math.inf
    ours = (f"RMSNorm {'/'.join(num(x) for x in a.exit_ppl)} (R={num(ra, 'pct')}) vs raw "
            f"{'/'.join(num(x) for x in b.exit_ppl)} (R={num(rb, 'pct')}); ratio {num(ratio)}")
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ratio <= K_INVARIANCE_RATIO_MAX else NOT_REPRODUCED, rule)


def claim_scale_control(t: dict) -> ClaimResult:
    cid, claim = "f", "Scale-controlled variants reach lower final-exit PPL than per-loop CE + RMSNorm"
    base = paper.PPL_129M[PER_LOOP_RMS.base][-1]
    p = (f"129M PPL at K=4: RMSNorm {base:.2f} vs " +
         ", ".join(f"{c.label.split(' + ', 1)[1]} {paper.PPL_129M[c.base][-1]:.2f}" for c in SCALE_CONTROLLED))
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has final-exit PPL "
            f"≤ (1 − {PPL_GAIN_MIN:g}) × PPL(per-loop CE + RMSNorm) at the same K")
    try:
        ref = _get(t, PER_LOOP_RMS, "ppl")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    got, missing = _present(t, SCALE_CONTROLLED, "ppl")
    if not got:
        return _not_run(cid, claim, p, rule, missing)
    ok = all(s.ppl_K <= (1 - PPL_GAIN_MIN) * ref.ppl_K for s in got)
    ours = f"RMSNorm {num(ref.ppl_K)} vs " + ", ".join(
        f"{s.cond.label}: {num(s.ppl_K)} ({num(s.ppl_K / ref.ppl_K - 1, 'spct')})" for s in got)
    if missing:
        ours += " (not run: " + "; ".join(missing) + ")"
    return ClaimResult(cid, claim, p, ours, REPRODUCED if ok else NOT_REPRODUCED, rule)


CLAMP_RULE_MODE = "freeze_loop1"  # the clamp whose ΔCE decides claim (g) (official radial_clamp_intervention.py)


def claim_clamp(t: dict) -> ClaimResult:
    cid, claim = "g", "Clamping the scale of the drifting model barely changes CE"
    p = "clamping the scale of a trained model changes CE very little"
    rule = (f"on per-loop CE + RMSNorm, the seed mean of |ΔCE| at exit K of the official {CLAMP_RULE_MODE} clamp "
            f"(remove_radial reported beside it) ≤ max({CLAMP_GAP_FRACTION:g} × "
            f"|CE_K(per-loop RMSNorm) − CE_K(per-loop raw)|, {CLAMP_FLOOR_NATS:g} nats)")
    try:
        a = _get(t, PER_LOOP_RMS, "clamp")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    gap = math.nan
    try:
        b = _get(t, PER_LOOP_RAW, "ppl")
        if finite(a.ce_K) and finite(b.ce_K):
            gap = abs(a.ce_K - b.ce_K)
    except _Missing:
        pass
    thr = max(CLAMP_GAP_FRACTION * gap, CLAMP_FLOOR_NATS) if finite(gap) else CLAMP_FLOOR_NATS
    worst = a.clamp_dce.get(CLAMP_RULE_MODE)
    if not finite(worst):
        return _not_run(cid, claim, p, rule, [f"{PER_LOOP_RMS.label}: no {CLAMP_RULE_MODE} clamp in eval/clamp.json"])
    worst = abs(worst)
    ours = (", ".join(f"{m} |ΔCE| {v:.4f}" for m, v in a.clamp_dce.items() if finite(v)) +
            f" nats; threshold {thr:.4f} nats" +
            (f" (CE gap to raw {gap:.4f})" if finite(gap) else " (raw condition absent: floor only)"))
    return ClaimResult(cid, claim, p, ours, REPRODUCED if worst <= thr else NOT_REPRODUCED, rule)


CLAIMS = (claim_drift, claim_small_norms, claim_inter_loop, claim_radial, claim_k_invariance, claim_scale_control,
          claim_clamp)


def evaluate(table: dict, size: str = "") -> list[ClaimResult]:
    """Every claim on one size: `table` maps Condition -> CondStats."""
    out = []
    for fn in CLAIMS:
        r = fn(table)
        r.size = size
        out.append(r)
    return out


def evaluate_groups(groups: list[Group]) -> list[ClaimResult]:
    """Claims per model size (in size order), on the seed means and per seed."""
    by_size: dict[Size, list] = {}
    for g in groups:
        by_size.setdefault(g.size, []).append(g)
    out = []
    for size, gs in by_size.items():
        results = evaluate({g.cond: condition_stats(g) for g in gs}, size.label)
        seeds = sorted({r.seed for g in gs for r in g.used if r.seed is not None})
        per_seed = {s: evaluate({g.cond: condition_stats(_of_seed(g, s)) for g in gs}) for s in seeds}
        for i, r in enumerate(results):
            r.mean_verdict = r.verdict
            r.seed_verdicts = {s: per_seed[s][i].verdict for s in seeds}
            r.verdict = combine(r.mean_verdict, r.seed_verdicts)
        out += results
    return out


def _of_seed(g: Group, seed) -> Group:
    return Group(g.size, g.cond, [r for r in g.runs if r.seed == seed])


def claims_markdown(results: list[ClaimResult]) -> str:
    from .fmt import md_table
    multi = len({r.size for r in results}) > 1
    header = (["Size"] if multi else []) + ["Claim", "Paper", "Ours (seed means)", "Verdict", "Per seed", "Rule"]
    rows = [([r.size] if multi else []) + [f"({r.id}) {r.claim}", r.paper, r.ours, f"**{r.verdict}**",
                                           r.per_seed_text() or "—", r.rule]
            for r in results]
    return md_table(header, rows)
