"""The paper's claims, each with a verdict computed from the runs by a fixed rule.

The rules, their kinds, the verdicts and the researcher choices: docs/studies.md, "The claim rules".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import paper
from .groups import Group, stats
from .markdown import md_table, num
from .records import RunRecord, records_of_runs
from ..registry import Condition, condition
from .runs import finite

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
NOT_RUN = "not run at this scale"
MIXED = "mixed"
UNINFORMATIVE = "control uninformative"
EVIDENCE, SANITY = "evidence", "sanity"

# ---- thresholds (pre-registered; see docs/studies.md, "The claim rules") ----
DRIFT_RATIO_MIN = 10.0  # (a), (c): drift = ‖H_K‖ at least 10× the scale-controlled model's
SMALL_NORM_MAX_PER_SQRT_D = 10.0  # (b), (b-pen), (c): "small" = ‖H_K‖ ≤ 10·√d (paper: 17–83 at d=512/768, ≤ 3·√d)
RADIAL_INVISIBLE_MAX = 1e-6  # (d): float noise for scale-invariant readouts (paper ~1e-9)
RADIAL_VISIBLE_MIN = 1e-4  # (d): clearly larger for raw readouts (100× the noise bound; paper ~1e-2)
K_INVARIANCE_RATIO_MAX = 0.5  # (e): the drifting model's exit-PPL range at most half the raw model's
PPL_GAIN_MIN = 0.01  # (e2), (c-depth), (f): at least 1% (PPL or depth gain)
ACCUMULATION_MAX = 1.5  # (c-acc): ‖H_K‖/‖H_1‖ with inter-loop norm near 1
ACCUMULATION_RATIO_MIN = 2.0  # (c-acc): the residual model accumulates at least twice as much
DEPTH_GAIN_RATIO_MIN = 2.0  # (e2): scale-controlled variants gain at least twice the drifting model's
INTER_LOOP_DEPTH_GAIN_RATIO_MIN = 2.0  # (c-depth): inter-loop norm gains at least twice the drifting model's
CLAMP_DCE_MAX = 0.02  # (g): |ΔCE_K| under freeze_loop1 at most 0.02 nats, a fixed bound
CLAMP_SENSITIVITY_RATIO_MAX = 0.5  # (g-ctrl): S(drifting) at most half the raw control's S
CONTROL_LOG_SCALE_MIN = 0.05  # (g-ctrl): the control must change its scale by |ln A| ≥ 0.05 to inform
FREEZE_MODE = "freeze_loop1"  # (g): the paper's clamp ("rescales the hidden state to its loop-1 magnitude")
OTHER_CLAMP = "remove_radial"  # the official code's other clamp, reported beside it and a researcher choice
# as first registered (the experiments before the pre-registration)
CLAMP_GAP_FRACTION = 0.25  # (g) registered: |ΔCE| at most a quarter of the RMSNorm-vs-raw CE gap ...
CLAMP_FLOOR_NATS = 0.01  # ... or 0.01 nats, whichever is larger
REGISTERED_CLAMP_MODES = ("remove_radial", "freeze_loop1")  # (g) as registered: the worse of these two

PER_LOOP_RMS = condition("rmsnorm", "per_loop")
PER_LOOP_RAW = condition("raw", "per_loop")
TERMINAL_RAW = condition("raw", "terminal")
PER_LOOP_FINAL = condition("final_norm", "per_loop")
PER_LOOP_PENALTY = condition("rmsnorm", "per_loop", "norm_penalty")
TERMINAL_PENALTY = condition("rmsnorm", "terminal", "norm_penalty")
INTER_LOOP = condition("rmsnorm", "per_loop", "none", "inter_loop_norm")
RAW_READOUTS = (PER_LOOP_RAW, TERMINAL_RAW)
PENALTIES = (PER_LOOP_PENALTY, TERMINAL_PENALTY)
SCALE_VISIBLE = RAW_READOUTS + PENALTIES
SCALE_CONTROLLED = (PER_LOOP_RAW, PER_LOOP_FINAL, PER_LOOP_PENALTY)

# the ‖H_K‖ statistics a norm rule can read (researcher choice; "mean" is the rule's)
NORM_STATS = {"mean": "mean per-token ‖H_K‖ (evaluation)", "median": "median per-token ‖H_K‖ (norms diagnostic)",
              "train_last": "the training log's last ‖H_K‖"}


@dataclass
class CondStats:
    """Seed means of one condition at one arm (completed runs only)."""
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
    log_scale: float = math.nan  # seed mean of |ln(‖H_K‖/‖H_1‖)| (per run, then averaged)
    growth: float = math.nan  # seed mean of the exponent b of ‖H_K‖ ∝ t^b over the training log
    radial: list = field(default_factory=list)  # seed-mean radial fraction per exit k=1..K
    clamp_dce: dict = field(default_factory=dict)  # clamp mode -> seed mean of |ΔCE| at exit K
    norm_K_median: float = math.nan  # seed mean of the median per-token ‖H_K‖ (norms diagnostic)
    norm_K_train: float = math.nan  # seed mean of the training log's last ‖H_K‖

    def norm(self, stat: str = "mean") -> float:
        return {"mean": self.norm_K, "median": self.norm_K_median, "train_last": self.norm_K_train}[stat]


@dataclass
class ClaimResult:
    id: str
    claim: str
    paper: str
    ours: str
    verdict: str
    rule: str
    size: str = ""
    arm: str = ""
    kind: str = EVIDENCE
    why_sanity: str = ""  # a sanity check: why it holds by construction
    mean_verdict: str = ""  # the rule on the seed means ("" until evaluated per seed)
    seed_verdicts: dict = field(default_factory=dict)  # seed -> the rule on that seed alone
    registered_rule: str = ""  # the rule as first registered, where it was amended after results
    registered_verdict: str = ""  # its verdict (seed means and per seed)
    amendment: str = ""  # "amended after results, because …" / "added after results, because …"
    robustness: str = ""  # the seed-mean verdict over a range of the rule's threshold
    choice_cells: list = field(default_factory=list)  # [(choice, option, seed, verdict)] (researcher choices)

    @property
    def outcome(self) -> str:
        """reproduced | not reproduced | mixed | not run at this scale | control uninformative."""
        return MIXED if self.verdict.startswith(MIXED) else self.verdict.split(" (", 1)[0]

    @property
    def headline(self) -> str:
        """The verdict on the seed means."""
        return self.mean_verdict or self.verdict

    def per_seed_text(self) -> str:
        return "; ".join(f"{s}: {v}" for s, v in self.seed_verdicts.items())

    def choices_agree(self) -> tuple[int, int]:
        """(cells agreeing with the headline seed-mean verdict, cells evaluated) over choice × seed."""
        ev = [v for *_, v in self.choice_cells if v in (REPRODUCED, NOT_REPRODUCED)]
        return sum(v == self.headline for v in ev), len(ev)

    def choices_text(self) -> str:
        if not self.choice_cells:
            return "no researcher choice varied"
        k, n = self.choices_agree()
        axes = sorted({c for c, *_ in self.choice_cells})
        return f"{k}/{n} choice × seed cells agree ({'; '.join(axes)})" if n else "no cell evaluable"

    def as_dict(self) -> dict:
        ev = [v for v in self.seed_verdicts.values() if v in (REPRODUCED, NOT_REPRODUCED)]
        k, n = self.choices_agree()
        return {"arm": self.arm, "size": self.size, "id": self.id, "kind": self.kind, "claim": self.claim,
                "paper": self.paper, "ours": self.ours, "verdict": self.verdict, "outcome": self.outcome,
                "verdict_seed_means": self.headline,
                "seeds_reproduced": sum(v == REPRODUCED for v in ev), "seeds_evaluated": len(ev),
                "per_seed": self.per_seed_text(), "rule": self.rule, "why_sanity": self.why_sanity,
                "choices_agree": k, "choices_evaluated": n, "robustness": self.robustness,
                "amendment": self.amendment, "registered_rule": self.registered_rule,
                "registered_verdict": self.registered_verdict}


CLAIMS_COLUMNS = ["arm", "size", "id", "kind", "claim", "paper", "ours", "verdict", "outcome", "verdict_seed_means",
                  "seeds_reproduced", "seeds_evaluated", "per_seed", "rule", "why_sanity", "choices_agree",
                  "choices_evaluated", "robustness", "amendment", "registered_rule", "registered_verdict"]
CHOICES_COLUMNS = ["arm", "id", "kind", "claim", "choice", "option", "headline", "seed", "verdict", "agrees"]


def combine(mean: str, per_seed: dict) -> str:
    """The verdict from the seed-mean verdict and the per-seed ones (docs/studies.md, "The claim rules")."""
    if mean in (NOT_RUN, UNINFORMATIVE):
        return mean
    ev = [v for v in per_seed.values() if v in (REPRODUCED, NOT_REPRODUCED)]
    if not ev:  # no seed has every condition the rule needs (e.g. conditions run with different seeds)
        return f"{mean} (seed means only; no seed has every condition)"
    k, n = sum(v == REPRODUCED for v in ev), len(ev)
    if all(v == mean for v in ev):
        return f"{mean} ({k}/{n} seed{'s' if n > 1 else ''})"
    return f"{MIXED}: {k}/{n} seeds (seed means: {mean})"


def stats_of(cond: Condition, recs: list[RunRecord]) -> CondStats:
    """The seed means of one condition's runs (completed ones only)."""
    used = [r for r in recs if r.completed]
    r0 = recs[0]

    def per_k(attr: str) -> list:
        vals = [getattr(r, attr) for r in used if getattr(r, attr)]
        n_k = max((len(v) for v in vals), default=0)
        return [stats(v[k] for v in vals if k < len(v))[0] for k in range(n_k)]

    ends = [(r.exit_norm[0], r.exit_norm[-1]) for r in used if len(r.exit_norm) >= 2]
    acc = [b / a for a, b in ends if finite(a) and finite(b) and a > 0 and b > 0]
    logs = [abs(math.log(x)) for x in acc]
    dce: dict = {}
    for r in used:
        for mode, v in r.clamp.items():
            dce.setdefault(mode, []).append(abs(v) if finite(v) else v)  # |ΔCE| per seed: no cancellation
    parts = [f"{len(used)} completed"] + [f"seed {r.seed} {r.note}" for r in recs if not r.completed]
    return CondStats(cond=cond, n=len(used), n_runs=len(recs), d_model=r0.d_model, K=r0.K, runs_text="; ".join(parts),
                     norm_K=stats(r.last(r.exit_norm) for r in used)[0],
                     ppl_K=stats(r.last(r.exit_ppl) for r in used)[0],
                     ce_K=stats(r.last(r.exit_ce) for r in used)[0],
                     exit_ppl=per_k("exit_ppl"), exit_norm=per_k("exit_norm"), radial=per_k("radial"),
                     accumulation=stats(acc)[0], log_scale=stats(logs)[0],
                     growth=stats(r.growth for r in used)[0],
                     clamp_dce={m: stats(v)[0] for m, v in sorted(dce.items())},
                     norm_K_median=stats(r.norm_median for r in used)[0],
                     norm_K_train=stats(r.norm_train_last for r in used)[0])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
class _Missing(Exception):
    pass


def _get(table: dict, cond: Condition, what: str = "", stat: str = "mean") -> CondStats:
    """The condition's stats, or _Missing naming why it cannot be used."""
    s = table.get(cond)
    if s is None:
        raise _Missing(f"{cond.label}: no runs")
    if s.n == 0:
        raise _Missing(f"{cond.label}: {s.runs_text}")
    if what == "norm" and not finite(s.norm(stat)):
        raise _Missing(f"{cond.label}: no ‖H_K‖ ({NORM_STATS[stat]})")
    if what == "ppl" and not finite(s.ppl_K):
        raise _Missing(f"{cond.label}: no final-exit PPL")
    if what == "exits" and sum(finite(p) for p in s.exit_ppl) < 2:
        raise _Missing(f"{cond.label}: fewer than two exit PPLs")
    if what == "radial" and not any(finite(v) for v in s.radial):
        raise _Missing(f"{cond.label}: no eval/radial.json")
    if what == "clamp" and not any(finite(v) for v in s.clamp_dce.values()):
        raise _Missing(f"{cond.label}: no eval/clamp.json")
    if what in (FREEZE_MODE, OTHER_CLAMP) and not finite(s.clamp_dce.get(what)):
        raise _Missing(f"{cond.label}: no {what} clamp in eval/clamp.json")
    if what == "accumulation" and not finite(s.accumulation):
        raise _Missing(f"{cond.label}: no ‖H_1‖, ‖H_K‖ exit norms")
    return s


def _present(table: dict, conds, what: str, stat: str = "mean") -> tuple[list, list]:
    got, missing = [], []
    for c in conds:
        try:
            got.append(_get(table, c, what, stat))
        except _Missing as e:
            missing.append(str(e))
    return got, missing


def _not_run(cid, claim, paper_txt, rule, why) -> ClaimResult:
    return ClaimResult(cid, claim, paper_txt, "missing: " + "; ".join(why), NOT_RUN, rule)


def _noting(ours: str, missing: list) -> str:
    """`ours` with the conditions that could not be used named after it."""
    return ours + (" (not run: " + "; ".join(missing) + ")" if missing else "")


def _scale_controlled(t: dict, what: str) -> tuple[CondStats, list, list]:
    """(per-loop CE + RMSNorm, the scale-controlled conditions present beside it (at its K where
    `what` is "exits"), the missing ones); _Missing where there is nothing to compare."""
    ref = _get(t, PER_LOOP_RMS, what)
    got, missing = _present(t, SCALE_CONTROLLED, what)
    if what == "exits":
        got = [s for s in got if len(s.exit_ppl) == len(ref.exit_ppl)]
    if not got:
        raise _Missing("; ".join(missing or ["no scale-controlled condition at the same K"]))
    return ref, got, missing


def _rel_range(ppl: list) -> float:
    v = [p for p in ppl if finite(p)]
    return (max(v) - min(v)) / min(v)


def _depth_gain(ppl: list) -> float:
    v = [p for p in ppl if finite(p)]
    return (v[0] - v[-1]) / v[0] if len(v) >= 2 and len(v) == len(ppl) else math.nan


METRICS = {"range": ("R", _rel_range), "gain": ("G", _depth_gain)}  # (e)/(e2): a researcher choice


def _sqrt_d(s: CondStats) -> float:
    return math.sqrt(s.d_model) if s.d_model else math.nan


def _stat_note(stat: str) -> str:
    return "" if stat == "mean" else f" [{NORM_STATS[stat]}]"


def _verdict(ok: bool) -> str:
    return REPRODUCED if ok else NOT_REPRODUCED


# ---------------------------------------------------------------------------
# the claims
# ---------------------------------------------------------------------------
def claim_drift(t: dict, ratio_min: float = DRIFT_RATIO_MIN, stat: str = "mean") -> ClaimResult:
    cid, claim = "a", "Per-loop CE through an RMSNorm readout lets ‖H_K‖ drift"
    p = (f"‖H_K‖ ≈ {paper.NORM_K_PER_LOOP_RMSNORM['44M']:,} (44M), {paper.NORM_K_PER_LOOP_RMSNORM['129M']:,} (129M) "
         f"vs tens ({paper.NORM_K_SCALE_VISIBLE_RANGE[0]}–{paper.NORM_K_SCALE_VISIBLE_RANGE[1]}) with the raw readout")
    rule = f"‖H_K‖(per-loop CE + RMSNorm) ≥ {ratio_min:g} × ‖H_K‖(per-loop CE + raw)" + _stat_note(stat)
    try:
        a, b = _get(t, PER_LOOP_RMS, "norm", stat), _get(t, PER_LOOP_RAW, "norm", stat)
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ratio = a.norm(stat) / b.norm(stat)
    ours = f"‖H_K‖ {num(a.norm(stat))} vs {num(b.norm(stat))} (ratio {num(ratio, 'ratio')})"
    return ClaimResult(cid, claim, p, ours, _verdict(ratio >= ratio_min), rule)


def _small_norms(t, cid, claim, conds, max_per_sqrt_d, stat) -> ClaimResult:
    p = f"‖H_K‖ in the tens ({paper.NORM_K_SCALE_VISIBLE_RANGE[0]}–{paper.NORM_K_SCALE_VISIBLE_RANGE[1]}; d=512/768)"
    rule = (f"every present condition of {{{', '.join(c.label for c in conds)}}} has "
            f"‖H_K‖ ≤ {max_per_sqrt_d:g}·√d" + _stat_note(stat))
    got, missing = _present(t, conds, "norm", stat)
    if not got:
        return _not_run(cid, claim, p, rule, missing)
    ok = all(s.norm(stat) <= max_per_sqrt_d * _sqrt_d(s) for s in got)
    ours = "; ".join(f"{s.cond.label}: {num(s.norm(stat))} ({num(s.norm(stat) / _sqrt_d(s))}·√d)" for s in got)
    ref = t.get(PER_LOOP_RMS)
    if ref is not None and ref.n and finite(ref.norm(stat)):
        ours += f"; for reference per-loop CE + RMSNorm readout: {num(ref.norm(stat))}"
    return ClaimResult(cid, claim, p, _noting(ours, missing), _verdict(ok), rule)


def claim_small_norms(t: dict, max_per_sqrt_d: float = SMALL_NORM_MAX_PER_SQRT_D, stat: str = "mean") -> ClaimResult:
    """(b): the raw-readout conditions."""
    return _small_norms(t, "b", "A raw readout keeps ‖H_K‖ small", RAW_READOUTS, max_per_sqrt_d, stat)


def claim_small_norms_penalty(t: dict, max_per_sqrt_d: float = SMALL_NORM_MAX_PER_SQRT_D,
                              stat: str = "mean") -> ClaimResult:
    """(b-pen), a sanity check: the norm penalty bounds ‖H_K‖ through the loss itself."""
    return _small_norms(t, "b-pen", "A norm penalty keeps ‖H_K‖ small", PENALTIES, max_per_sqrt_d, stat)


def claim_small_norms_registered(t: dict, max_per_sqrt_d: float = SMALL_NORM_MAX_PER_SQRT_D) -> ClaimResult:
    """(b) as first registered: raw readouts and norm penalties together."""
    return _small_norms(t, "b", "A raw readout or a norm penalty keeps ‖H_K‖ small", SCALE_VISIBLE,
                        max_per_sqrt_d, "mean")


INTER_LOOP_CLAIM = "Inter-loop normalisation keeps ‖H_K‖ small"
INTER_LOOP_PAPER = ("named by the paper as a fix that removes the scale from the recurrence path; no runs shipped "
                    "(loopscale addition)")


def claim_inter_loop(t: dict, max_per_sqrt_d: float = SMALL_NORM_MAX_PER_SQRT_D,
                     ratio_min: float = DRIFT_RATIO_MIN, stat: str = "mean") -> ClaimResult:
    """(c): the final-state magnitude (the rule as first registered)."""
    cid = "c"
    rule = (f"‖H_K‖(per-loop CE + RMSNorm + inter-loop norm) ≤ {max_per_sqrt_d:g}·√d and "
            f"‖H_K‖(per-loop CE + RMSNorm, residual) ≥ {ratio_min:g} × it" + _stat_note(stat))
    try:
        il, base = _get(t, INTER_LOOP, "norm", stat), _get(t, PER_LOOP_RMS, "norm", stat)
    except _Missing as e:
        return _not_run(cid, INTER_LOOP_CLAIM, INTER_LOOP_PAPER, rule, [str(e)])
    small = il.norm(stat) <= max_per_sqrt_d * _sqrt_d(il)
    ratio = base.norm(stat) / il.norm(stat)
    ours = (f"‖H_K‖ {num(il.norm(stat))} ({num(il.norm(stat) / _sqrt_d(il))}·√d) with inter-loop norm vs "
            f"{num(base.norm(stat))} without (ratio {num(ratio, 'ratio')})")
    if finite(il.accumulation) and finite(base.accumulation):
        ours += f"; ‖H_K‖/‖H_1‖ {num(il.accumulation)} with inter-loop norm vs {num(base.accumulation)} residual"
    if finite(il.growth):
        ours += f"; with inter-loop norm ‖H_K‖ grows over training ∝ t^{il.growth:.2f}"
        if finite(base.growth):
            ours += f" (residual t^{base.growth:.2f})"
    return ClaimResult(cid, INTER_LOOP_CLAIM, INTER_LOOP_PAPER, ours, _verdict(small and ratio >= ratio_min), rule)


def claim_accumulation(t: dict, max_accumulation: float = ACCUMULATION_MAX,
                       ratio_min: float = ACCUMULATION_RATIO_MIN) -> ClaimResult:
    """(c-acc), a sanity check: the scale no longer accumulates across loops."""
    cid, claim = "c-acc", "Inter-loop normalisation stops accumulation across loops"
    rule = (f"A = ‖H_K‖/‖H_1‖ over one pass; A(per-loop CE + RMSNorm + inter-loop norm) ≤ {max_accumulation:g} and "
            f"A(per-loop CE + RMSNorm, residual) ≥ {ratio_min:g} × it")
    try:
        il, base = _get(t, INTER_LOOP, "accumulation"), _get(t, PER_LOOP_RMS, "accumulation")
    except _Missing as e:
        return _not_run(cid, claim, INTER_LOOP_PAPER, rule, [str(e)])
    ok = il.accumulation <= max_accumulation and base.accumulation >= ratio_min * il.accumulation
    ours = f"‖H_K‖/‖H_1‖ {num(il.accumulation)} with inter-loop norm vs {num(base.accumulation)} residual"
    return ClaimResult(cid, claim, INTER_LOOP_PAPER, ours, _verdict(ok), rule)


def claim_inter_loop_depth(t: dict, ratio_min: float = INTER_LOOP_DEPTH_GAIN_RATIO_MIN) -> ClaimResult:
    """(c-depth): with the scale out of the recurrence path, the model gains from depth."""
    cid, claim = "c-depth", "Inter-loop normalisation restores depth use"
    p = ("not measured by the paper; its account predicts it (a model whose recurrence carries no scale "
         "should use depth like the scale-controlled variants, Table 1)")
    rule = (f"G = (PPL_1 − PPL_K)/PPL_1; G(per-loop CE + RMSNorm + inter-loop norm) ≥ "
            f"max({ratio_min:g} × G(per-loop CE + RMSNorm, residual), {PPL_GAIN_MIN:g})")
    try:
        il, base = _get(t, INTER_LOOP, "exits"), _get(t, PER_LOOP_RMS, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    gi, gb = _depth_gain(il.exit_ppl), _depth_gain(base.exit_ppl)
    if not (finite(gi) and finite(gb)):
        return _not_run(cid, claim, p, rule, ["an exit PPL is missing"])
    thr = max(ratio_min * gb, PPL_GAIN_MIN)
    ours = (f"G with inter-loop norm {num(gi, 'spct')} vs residual {num(gb, 'spct')} (threshold {num(thr, 'pct')}); "
            f"exits {'/'.join(num(v) for v in il.exit_ppl)} vs {'/'.join(num(v) for v in base.exit_ppl)}")
    return ClaimResult(cid, claim, p, ours, _verdict(gi >= thr), rule)


def claim_radial(t: dict, tolerance: float = 1.0) -> ClaimResult:
    """(d), a sanity check. `tolerance` > 1 loosens both bounds by that factor."""
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
    return ClaimResult(cid, claim, p, _noting(ours, miss_i + miss_v), _verdict(ok), rule)


def claim_k_invariance(t: dict, ratio_max: float = K_INVARIANCE_RATIO_MAX, metric: str = "range") -> ClaimResult:
    cid, claim = "e", "The drifting model is K-invariant: more loops stop helping"
    name, f = METRICS[metric]
    rms, raw = paper.PPL_129M[PER_LOOP_RMS.base], paper.PPL_129M[PER_LOOP_RAW.base]
    pr, pw = _rel_range(list(rms)), _rel_range(list(raw))
    p = (f"129M exit PPL k=1..4: RMSNorm {'/'.join(f'{x:.2f}' for x in rms)} (R={num(pr, 'pct')}) vs raw "
         f"{'/'.join(f'{x:.2f}' for x in raw)} (R={num(pw, 'pct')}); ratio {pr / pw:.2f}")
    if metric == "range":
        rule = (f"R = (max_k PPL_k − min_k PPL_k)/min_k PPL_k over exits k=1..K; "
                f"R(per-loop CE + RMSNorm) ≤ {ratio_max:g} × R(per-loop CE + raw)")
    else:
        rule = f"G = (PPL_1 − PPL_K)/PPL_1; G(per-loop CE + RMSNorm) ≤ {ratio_max:g} × G(per-loop CE + raw)"
    try:
        a, b = _get(t, PER_LOOP_RMS, "exits"), _get(t, PER_LOOP_RAW, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ra, rb = f(a.exit_ppl), f(b.exit_ppl)
    if not (finite(ra) and finite(rb)):
        return _not_run(cid, claim, p, rule, ["an exit PPL is missing"])
    if metric == "range":
        ratio = ra / rb if rb > 0 else math.inf
        ok = ratio <= ratio_max
    else:
        ratio = ra / rb if rb > 0 else math.nan
        ok = rb > 0 and ra <= ratio_max * rb
    ours = (f"RMSNorm {'/'.join(num(x) for x in a.exit_ppl)} ({name}={num(ra, 'pct')}) vs raw "
            f"{'/'.join(num(x) for x in b.exit_ppl)} ({name}={num(rb, 'pct')}); ratio {num(ratio)}")
    return ClaimResult(cid, claim, p, ours, _verdict(ok), rule)


def claim_depth_gain(t: dict, ratio_min: float = DEPTH_GAIN_RATIO_MIN, metric: str = "gain") -> ClaimResult:
    """(e2): the scale-controlled variants do gain from depth."""
    cid, claim = "e2", "Scale-controlled variants gain from depth where the drifting model does not"
    name, f = METRICS[metric]
    p = "129M gain G = (PPL_1 − PPL_4)/PPL_1: " + ", ".join(
        f"{lbl} {num(_depth_gain(list(paper.PPL_129M[c.base])), 'pct')}"
        for lbl, c in (("RMSNorm", PER_LOOP_RMS), ("raw", PER_LOOP_RAW), ("final-only norm", PER_LOOP_FINAL),
                       ("norm penalty", PER_LOOP_PENALTY)))
    defn = ("G = (PPL_1 − PPL_K)/PPL_1 over exits" if metric == "gain" else
            "R = (max_k PPL_k − min_k PPL_k)/min_k PPL_k over exits")
    rule = (f"{defn}; every present condition of {{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has "
            f"{name} ≥ max({ratio_min:g} × {name}(per-loop CE + RMSNorm), {PPL_GAIN_MIN:g})")
    try:
        ref, got, missing = _scale_controlled(t, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    g_ref = f(ref.exit_ppl)
    if not finite(g_ref):
        return _not_run(cid, claim, p, rule, [f"{ref.cond.label}: an exit PPL is missing"])
    thr = max(ratio_min * g_ref, PPL_GAIN_MIN)
    gains = [(s, f(s.exit_ppl)) for s in got]
    ok = all(finite(g) and g >= thr for _, g in gains)
    ours = f"{name} RMSNorm {num(g_ref, 'spct')} (threshold {num(thr, 'pct')}) vs " + ", ".join(
        f"{s.cond.label}: {num(g, 'spct')}" for s, g in gains)
    return ClaimResult(cid, claim, p, _noting(ours, missing), _verdict(ok), rule)


SCALE_CONTROL_CLAIM = "Scale-controlled variants reach lower PPL than per-loop CE + RMSNorm"


def _scale_control_paper() -> str:
    base = paper.PPL_129M[PER_LOOP_RMS.base][-1]
    return (f"129M PPL at K=4: RMSNorm {base:.2f} vs " +
            ", ".join(f"{c.label.split(' + ', 1)[1]} {paper.PPL_129M[c.base][-1]:.2f}" for c in SCALE_CONTROLLED)
            + "; lower at every exit k = 2..4 too (Table 1)")


def claim_scale_control(t: dict, gain_min: float = PPL_GAIN_MIN) -> ClaimResult:
    """(f) as first registered: the final exit only."""
    cid, claim, p = "f", SCALE_CONTROL_CLAIM, _scale_control_paper()
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has final-exit PPL "
            f"≤ (1 − {gain_min:g}) × PPL(per-loop CE + RMSNorm) at the same K")
    try:
        ref, got, missing = _scale_controlled(t, "ppl")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ok = all(s.ppl_K <= (1 - gain_min) * ref.ppl_K for s in got)
    ours = f"RMSNorm {num(ref.ppl_K)} vs " + ", ".join(
        f"{s.cond.label}: {num(s.ppl_K)} ({num(s.ppl_K / ref.ppl_K - 1, 'spct')})" for s in got)
    return ClaimResult(cid, claim, p, _noting(ours, missing), _verdict(ok), rule)


def claim_matched_depth(t: dict, gain_min: float = PPL_GAIN_MIN, exits: str = "all") -> ClaimResult:
    """(f): lower PPL at every matched depth k = 2..K (exits="final": the final exit only)."""
    if exits == "final":
        return claim_scale_control(t, gain_min)
    cid, claim, p = "f", SCALE_CONTROL_CLAIM, _scale_control_paper()
    rule = (f"every present condition of {{{', '.join(c.label for c in SCALE_CONTROLLED)}}} has PPL_k "
            f"≤ (1 − {gain_min:g}) × PPL_k(per-loop CE + RMSNorm) at every exit k = 2..K")
    try:
        ref, got, missing = _scale_controlled(t, "exits")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    ks = range(1, len(ref.exit_ppl))  # 0-based exits 2..K

    def worst(s: CondStats) -> float:  # the largest PPL_k(s)/PPL_k(ref) over k = 2..K
        r = [s.exit_ppl[i] / ref.exit_ppl[i] for i in ks if finite(s.exit_ppl[i]) and finite(ref.exit_ppl[i])]
        return max(r) if len(r) == len(ks) else math.nan

    w = [(s, worst(s)) for s in got]
    ok = all(finite(x) and x <= 1 - gain_min for _, x in w)
    ours = "worst ratio to RMSNorm over k=2..K: " + ", ".join(
        f"{s.cond.label}: {num(x - 1, 'spct')} (exits {'/'.join(num(v) for v in s.exit_ppl)})" for s, x in w) + \
        f"; RMSNorm exits {'/'.join(num(v) for v in ref.exit_ppl)}"
    return ClaimResult(cid, claim, p, _noting(ours, missing), _verdict(ok), rule)


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


def _modes_text(s: CondStats) -> str:
    return ", ".join(f"{m} |ΔCE| {abs(v):.4f}" for m, v in s.clamp_dce.items() if finite(v)) + " nats"


def claim_clamp(t: dict, fraction: float = CLAMP_GAP_FRACTION) -> ClaimResult:
    """(g) as first registered: the worse of remove_radial and freeze_loop1, against a quarter of the CE gap."""
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
    ours = _modes_text(a) + f"; threshold {thr:.4f} nats" + (
        f" (CE gap to raw {gap:.4f})" if finite(gap) else " (raw condition absent: floor only)")
    return ClaimResult(cid, CLAMP_CLAIM, CLAMP_PAPER, ours, _verdict(max(modes) <= thr), rule)


def claim_freeze(t: dict, max_dce: float = CLAMP_DCE_MAX, mode: str = FREEZE_MODE) -> ClaimResult:
    """(g): |ΔCE_K| of the drifting model under the paper's clamp, against a fixed bound."""
    cid = "g"
    rule = (f"on per-loop CE + RMSNorm, the seed mean of |ΔCE| at exit K under {mode} ≤ {max_dce:g} nats (fixed "
            f"bound); " + ("remove_radial reported beside it" if mode == FREEZE_MODE else "the official remove_radial clamp"))
    try:
        a = _get(t, PER_LOOP_RMS, mode)
    except _Missing as e:
        return _not_run(cid, CLAMP_CLAIM, CLAMP_PAPER, rule, [str(e)])
    return ClaimResult(cid, CLAMP_CLAIM, CLAMP_PAPER, _modes_text(a) + f"; bound {max_dce:g} nats",
                       _verdict(abs(a.clamp_dce[mode]) <= max_dce), rule)


def claim_clamp_control(t: dict, ratio_max: float = CLAMP_SENSITIVITY_RATIO_MAX, mode: str = FREEZE_MODE) -> ClaimResult:
    """(g-ctrl): the drifting model's CE is less sensitive to the clamp's scale change than the raw control's."""
    cid, claim = "g-ctrl", "The drifting model's CE is less scale-sensitive than a raw readout's (clamp control)"
    p = ("the paper reports the clamp on the drifting model only; its account (a scale-invariant readout cannot see "
         "the scale) predicts the contrast with a raw readout")
    rule = (f"S = |ΔCE_K({mode})| / |ln(‖H_K‖/‖H_1‖)| (seed means); S(per-loop CE + RMSNorm) ≤ {ratio_max:g} × "
            f"S(per-loop CE + raw); control uninformative when |ln(‖H_K‖/‖H_1‖)|(raw) < {CONTROL_LOG_SCALE_MIN:g}")
    try:
        a, b = _get(t, PER_LOOP_RMS, mode), _get(t, PER_LOOP_RAW, mode)
        _get(t, PER_LOOP_RMS, "accumulation"), _get(t, PER_LOOP_RAW, "accumulation")
    except _Missing as e:
        return _not_run(cid, claim, p, rule, [str(e)])
    da, db = abs(a.clamp_dce[mode]), abs(b.clamp_dce[mode])
    ours_b = f"raw |ΔCE| {db:.4f} over |ln A| {b.log_scale:.3f}"
    if not finite(b.log_scale) or b.log_scale < CONTROL_LOG_SCALE_MIN:
        return ClaimResult(cid, claim, p, f"{ours_b} (< {CONTROL_LOG_SCALE_MIN:g}: the clamp barely changes the "
                                          f"control's scale); RMSNorm {_modes_text(a)}", UNINFORMATIVE, rule)
    if not finite(a.log_scale) or a.log_scale <= 0:
        return _not_run(cid, claim, p, rule, [f"{a.cond.label}: no scale change between loop 1 and K"])
    sa, sb = da / a.log_scale, db / b.log_scale
    ours = (f"S RMSNorm {sa:.4f} (|ΔCE| {da:.4f} over |ln A| {a.log_scale:.3f}) vs raw {sb:.4f} ({ours_b}); "
            f"ratio {num(sa / sb if sb > 0 else math.inf)}; RMSNorm {_modes_text(a)}; raw {_modes_text(b)}")
    return ClaimResult(cid, claim, p, ours, _verdict(sa <= ratio_max * sb), rule)


# ---------------------------------------------------------------------------
# the claims in force, as first registered, and the researcher choices
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """A choice a researcher made that the rule does not fix: the rule's keyword `knob` and its
    options ((value, label), ...), the rule's own first."""
    name: str
    knob: str
    options: tuple


STAT_CHOICE = Choice("‖H_K‖ statistic", "stat", tuple(NORM_STATS.items()))
CLAMP_CHOICE = Choice("clamp", "mode", ((FREEZE_MODE, FREEZE_MODE), (OTHER_CLAMP, OTHER_CLAMP)))
EXITS_CHOICE = Choice("exits", "exits", (("all", "every exit k = 2..K"), ("final", "final exit only")))
E_METRIC_CHOICE = Choice("metric", "metric", (("range", "exit-PPL range R"), ("gain", "depth gain G")))
E2_METRIC_CHOICE = Choice("metric", "metric", (("gain", "depth gain G"), ("range", "exit-PPL range R")))


@dataclass(frozen=True)
class ClaimSpec:
    """One claim: the rule in force (`fn`, its threshold keyword `knob` and the grid of values the
    threshold line evaluates), its kind (evidence | sanity, and why a sanity check holds by
    construction), the researcher choices it is re-evaluated under, and, for the experiments run
    before the pre-registration, the rule as first registered (`registered`) and the history
    (`amendment`)."""
    fn: object
    knob: str
    grid: tuple
    kind: str = EVIDENCE
    why_sanity: str = ""
    registered: object = None
    amendment: str = ""
    choices: tuple = ()


CLAIM_SPECS = (
    ClaimSpec(claim_drift, "ratio_min", (3, 5, 10, 20, 50), choices=(STAT_CHOICE,)),
    ClaimSpec(claim_small_norms, "max_per_sqrt_d", (3, 5, 10, 20, 40), choices=(STAT_CHOICE,),
              registered=claim_small_norms_registered,
              amendment="split after results (2026-12 review): the norm-penalty conditions moved to (b-pen), a sanity "
                        "check, because the penalty bounds ‖H_K‖ through the loss itself"),
    ClaimSpec(claim_small_norms_penalty, "max_per_sqrt_d", (3, 5, 10, 20, 40), kind=SANITY,
              why_sanity="enforced by the loss", choices=(STAT_CHOICE,),
              amendment="split from (b) after results (2026-12 review), its rule as registered"),
    ClaimSpec(claim_inter_loop, "max_per_sqrt_d", (3, 5, 10, 20, 40), choices=(STAT_CHOICE,),
              amendment="the rule as first registered; titled \"Inter-loop normalisation removes the drift\" until the "
                        "2026-12 review, and replaced after results by the accumulation rule, now (c-acc), a sanity "
                        "check"),
    ClaimSpec(claim_accumulation, "max_accumulation", (1.1, 1.25, 1.5, 2.0, 3.0), kind=SANITY,
              why_sanity="structural: each loop receives a fixed-RMS state",
              amendment="added after results (first as the amended (c)), because the paper's fix removes the scale "
                        "from the recurrence path; a sanity check since the 2026-12 review"),
    ClaimSpec(claim_inter_loop_depth, "ratio_min", (1.5, 2, 3, 5),
              amendment="added after results (2026-12 review), because the inter-loop model was as K-invariant as "
                        "the drifting one and no rule reported it"),
    ClaimSpec(claim_radial, "tolerance", (0.01, 0.1, 1, 10, 100), kind=SANITY,
              why_sanity="identity of scale-invariant readouts (r(αH) = r(H) forces a zero radial gradient)"),
    ClaimSpec(claim_k_invariance, "ratio_max", (0.25, 0.5, 0.75, 1.0), choices=(E_METRIC_CHOICE,)),
    ClaimSpec(claim_depth_gain, "ratio_min", (1.5, 2, 3, 5), choices=(E2_METRIC_CHOICE,),
              amendment="added after results, because the paper's K-invariance claim has two halves (Table 1: the "
                        "scale-controlled variants gain from depth) and (e) tested only the drifting model's"),
    ClaimSpec(claim_matched_depth, "gain_min", (0, 0.005, 0.01, 0.02, 0.05), registered=claim_scale_control,
              choices=(EXITS_CHOICE,),
              amendment="amended after results, because the paper's frontier claim compares the variants at "
                        "matched depth (Table 1's exits, Table 5), not only at the final exit"),
    ClaimSpec(claim_freeze, "max_dce", (0.01, 0.02, 0.05), registered=claim_clamp, choices=(CLAMP_CHOICE,),
              amendment="amended after results: to freeze_loop1 alone (the paper's clamp rescales the state to its "
                        "loop-1 magnitude, freeze_loop1 in the official radial_clamp_intervention.py), then (2026-12 "
                        "review) to a fixed bound, because a quarter of the RMSNorm-vs-raw CE gap gives a worse "
                        "drifting model a looser bound"),
    ClaimSpec(claim_clamp_control, "ratio_max", (0.25, 0.5, 1.0), choices=(CLAMP_CHOICE,),
              amendment="added after results (2026-12 review), because (g) alone has no control: the raw model's CE "
                        "moved as much under freeze_loop1 in cpu_long"),
)
# claim families: the claims an experiment's claims.md evaluates (params.yaml `claims:`)
FACTORIAL_IDS = ("a", "e", "e2", "f", "g", "g-ctrl")


def specs_of(family: str = "paper") -> tuple:
    if family == "paper":
        return CLAIM_SPECS
    if family == "factorial":
        return tuple(s for s in CLAIM_SPECS if claim_id(s) in FACTORIAL_IDS)
    raise ValueError(f"unknown claims family {family!r} (paper, factorial; dose has its own rules: report/dose.py)")


def claim_id(spec: ClaimSpec) -> str:
    return spec.fn({}).id


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
    """Every claim on one arm: `table` maps Condition -> CondStats (the rules in force)."""
    out = []
    for spec in specs:
        r = spec.fn(table)
        r.size, r.kind, r.why_sanity = size, spec.kind, spec.why_sanity
        out.append(r)
    return out


def _tables(recs: list[RunRecord]) -> tuple[dict, dict]:
    """The seed-mean table of one arm and one table per seed."""
    by_cond: dict = {}
    for r in recs:
        by_cond.setdefault(r.cond, []).append(r)
    table = {c: stats_of(c, rs) for c, rs in by_cond.items()}
    seeds = sorted({r.seed for r in recs if r.completed and r.seed is not None})
    per_seed = {s: {c: stats_of(c, [r for r in rs if r.seed == s]) for c, rs in by_cond.items()
                    if any(r.seed == s for r in rs)} for s in seeds}
    return table, per_seed


def _arms(records: list[RunRecord]) -> list[tuple[tuple, list]]:
    arms: dict = {}
    for r in records:
        arms.setdefault((r.arm, r.size), []).append(r)
    return sorted(arms.items(), key=lambda kv: (min(r.params for r in kv[1]), min(r.d_model for r in kv[1]), kv[0]))


def evaluate_records(records: list[RunRecord], specs=CLAIM_SPECS, preregistered: str = "") -> list[ClaimResult]:
    """Claims per arm, on the seed means and per seed; each claim under its researcher choices
    (per seed) and over its threshold grid (seed means). Where the experiment predates the
    pre-registration (`preregistered` empty) a changed rule's registered verdict is shown beside it;
    otherwise the rules are those `preregistered` names."""
    out = []
    for (arm, size), recs in _arms(records):
        table, seed_tables = _tables(recs)
        seeds = list(seed_tables)

        def judged(specs_) -> list[ClaimResult]:
            results = evaluate(table, size, specs_)
            per_seed = {s: evaluate(seed_tables[s], specs=specs_) for s in seeds}
            for i, r in enumerate(results):
                r.arm = arm
                r.mean_verdict = r.verdict
                r.seed_verdicts = {s: per_seed[s][i].verdict for s in seeds}
                r.verdict = combine(r.mean_verdict, r.seed_verdicts)
            return results

        results = judged(specs)
        for spec, r in zip(specs, results):
            r.robustness = robustness(spec, table)
            r.choice_cells += [(ch.name, label, s, spec.fn(seed_tables[s], **{ch.knob: value}).verdict)
                               for ch in spec.choices for value, label in ch.options for s in seeds]
            r.amendment = f"pre-registered ({preregistered})" if preregistered else spec.amendment
        if not preregistered:
            amended = [(spec, r) for spec, r in zip(specs, results) if spec.registered is not None]
            registered = judged([ClaimSpec(spec.registered, "", ()) for spec, _ in amended])
            for (_, r), reg in zip(amended, registered):
                r.registered_rule, r.registered_verdict = reg.rule, reg.verdict
        out += results
    return out


def evaluate_groups(groups: list[Group], specs=CLAIM_SPECS, preregistered: str = "") -> list[ClaimResult]:
    """`evaluate_records` on run groups (size × condition)."""
    return evaluate_records(records_of_runs([r for g in groups for r in g.runs]), specs, preregistered)


# ---------------------------------------------------------------------------
# claims.md / claims.csv / choices.csv
# ---------------------------------------------------------------------------
def _registered_text(r: ClaimResult) -> str:
    if r.registered_rule:
        return f"{r.amendment}. Registered rule: {r.registered_rule} → **{r.registered_verdict}**"
    return r.amendment or "as registered"


def claims_markdown(results: list[ClaimResult]) -> str:
    multi = len({r.arm for r in results}) > 1
    out = []
    for kind, title, intro in (
            (EVIDENCE, "Evidence", "Rules the models could fail."),
            (SANITY, "Sanity checks", "Rules that hold by construction (the last column says why): they check the "
                                      "code and the runs, not the paper's claim.")):
        rs = [r for r in results if r.kind == kind]
        if not rs:
            continue
        header = (["Arm"] if multi else []) + ["Claim", "Paper", "Ours (seed means)", "Verdict", "Per seed", "Rule",
                                               "Researcher choices (per seed)",
                                               "Threshold grid (seed means; grid chosen after results)",
                                               "As first registered"] + (["Why a sanity check"] if kind == SANITY else [])
        rows = [([r.arm] if multi else []) + [f"({r.id}) {r.claim}", r.paper, r.ours, f"**{r.verdict}**",
                                              r.per_seed_text() or "—", r.rule, r.choices_text(), r.robustness or "—",
                                              _registered_text(r)] + ([r.why_sanity] if kind == SANITY else [])
                for r in rs]
        out.append(f"## {title}\n\n{intro}\n\n" + md_table(header, rows))
    out.append(choices_markdown(results))
    return "\n".join(out)


def choices_markdown(results: list[ClaimResult]) -> str:
    """Per claim and researcher choice: each option's per-seed verdicts, and how many cells agree
    with the headline (seed-mean) verdict."""
    multi = len({r.arm for r in results}) > 1
    rows = []
    for r in results:
        options: dict = {}
        for choice, option, seed, v in r.choice_cells:
            options.setdefault((choice, option), []).append(f"{seed}: {v}")
        for (choice, option), cells in options.items():
            if all(c.endswith(NOT_RUN) for c in cells):
                continue  # e.g. no norms diagnostic with a median: the option is listed in choices.csv only
            rows.append(([r.arm] if multi else []) + [f"({r.id})", choice, option, "; ".join(cells)])
    head = ("## Researcher choices\n\nEach claim re-evaluated in every seed under the choices the rule does not fix "
            "(the rule's own option first). Agreement with the headline (seed-mean) verdict, over the evaluable "
            "choice × seed cells:\n\n" + "\n".join(
                f"- {'[' + r.arm + '] ' if multi else ''}({r.id}) headline **{r.headline}**: "
                f"{r.choices_text()}" for r in results) + "\n")
    if not rows:
        return head
    return head + "\n" + md_table((["Arm"] if multi else []) + ["Claim", "Choice", "Option", "Verdict per seed"], rows)


def claims_frame(results: list[ClaimResult]):
    import pandas as pd
    return pd.DataFrame([r.as_dict() for r in results], columns=CLAIMS_COLUMNS)


def choices_frame(results: list[ClaimResult]):
    import pandas as pd
    rows = [{"arm": r.arm, "id": r.id, "kind": r.kind, "claim": r.claim, "choice": c, "option": o,
             "headline": r.headline, "seed": s, "verdict": v,
             "agrees": (v == r.headline) if v in (REPRODUCED, NOT_REPRODUCED) else None}
            for r in results for c, o, s, v in r.choice_cells]
    return pd.DataFrame(rows, columns=CHOICES_COLUMNS)


THRESHOLD_NAMES = ("DRIFT_RATIO_MIN", "SMALL_NORM_MAX_PER_SQRT_D", "RADIAL_INVISIBLE_MAX", "RADIAL_VISIBLE_MIN",
                   "K_INVARIANCE_RATIO_MAX", "PPL_GAIN_MIN", "ACCUMULATION_MAX", "ACCUMULATION_RATIO_MIN",
                   "DEPTH_GAIN_RATIO_MIN", "INTER_LOOP_DEPTH_GAIN_RATIO_MIN", "CLAMP_DCE_MAX",
                   "CLAMP_SENSITIVITY_RATIO_MAX", "CONTROL_LOG_SCALE_MIN")


def thresholds_text() -> str:
    return "Thresholds: " + ", ".join(f"`{k}` = {globals()[k]:g}" for k in THRESHOLD_NAMES) + "."
