"""The concepts of loopscale, each defined once: one registry per axis of a training condition
(readouts, losses, regularizers, recurrences), one of the diagnostics, and the one `Condition`
type. docs/pipeline.md ("The registry") says who reads them. Imports nothing heavy (no torch):
the pipeline builds its DAG from it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

PAPER_PENALTY_WEIGHT = 0.01  # λ of the norm penalty in the paper (Table 1)
OTHER = 99  # order of entries that do not set one: after the paper's


# ---------------------------------------------------------------------------
# the four axes of a condition
# ---------------------------------------------------------------------------
# the architectures (loopscale.model.ARCHITECTURES) whose exits k < K read the step norm, the
# norm that also feeds the next loop: there a readout's exit K may use another norm kind
STEP_NORM_ARCHS = ("ouro",)
INVARIANT_NORMS = ("rmsnorm", "layernorm")  # r(αH) = r(H)


@dataclass(frozen=True)
class Readout:
    """r(H_k): what the head reads at exit k. `exit_norm` is the norm applied at the exits
    k < K of a pass, `final_norm` the one at exit K (None: the raw state); the norms are
    modules of loopscale.readouts (`NORMS`). `archs`: the architectures
    (loopscale.model.ARCHITECTURES) it applies to; `per_loop`: one norm module per exit."""
    name: str
    label: str  # in tables and legends
    exit_norm: Optional[str]  # "rmsnorm" | "layernorm" | "alpha" | "taper" | None (raw)
    final_norm: Optional[str]
    description: str
    order: int = OTHER  # place among readouts in the report (after the canonical conditions)
    archs: tuple = ("looped",)
    per_loop: bool = False

    def __post_init__(self):
        if None not in (self.exit_norm, self.final_norm) and self.exit_norm != self.final_norm \
                and not set(self.archs) <= set(STEP_NORM_ARCHS):
            raise ValueError(f"readout {self.name}: one norm kind per readout (exit K may differ only where the "
                             f"exits read the step norm: {', '.join(STEP_NORM_ARCHS)})")

    def applies_to(self, arch: str) -> bool:
        return arch in self.archs

    @property
    def norm(self) -> Optional[str]:
        """The kind of the model's readout norm (the exits', else exit K's; None: no readout
        parameters); exit K has a module of its own where its kind differs."""
        return self.exit_norm or self.final_norm

    @property
    def scale_invariant(self) -> bool:
        """Every exit is scale-invariant, r(αH) = r(H): the loss cannot see ‖H‖."""
        return self.exit_norm in INVARIANT_NORMS and self.final_norm in INVARIANT_NORMS

    @property
    def raw(self) -> bool:
        """No exit is normalised: the loss sees the scale at every exit."""
        return self.exit_norm is None and self.final_norm is None

    @property
    def exits_differ(self) -> bool:
        """Exits k < K are read through another function than exit K."""
        return self.exit_norm != self.final_norm or self.per_loop

    def norm_at(self, k: int, K: int) -> str:
        """The readout applied at exit k of a K-loop pass: "raw" or the norm's name."""
        return (self.final_norm if k >= K else self.exit_norm) or "raw"


@dataclass(frozen=True)
class Axis:
    """A loss, regularizer or recurrence: its name, its label in condition labels ("" when
    a condition label leaves it out, i.e. the default), and a one-line description."""
    name: str
    label: str
    description: str
    order: int = OTHER


READOUTS: dict[str, Readout] = {r.name: r for r in (
    Readout("rmsnorm", "RMSNorm readout", "rmsnorm", "rmsnorm",
            "RMSNorm at every exit: scale-invariant, the loss cannot see ‖H_k‖", 0,
            archs=("looped", "ouro")),
    Readout("layernorm", "LayerNorm readout", "layernorm", "layernorm",
            "LayerNorm (no bias) at every exit: scale-invariant", 3),
    Readout("raw", "raw readout", None, None,
            "the raw state at every exit, r(H) = H: the loss sees the scale", 1),
    Readout("final_norm", "final-only norm", None, "rmsnorm",
            "final-only norm: the raw state at exits k < K, RMSNorm at exit K only", 2),
    # the official release's other readouts (model.decode_norm_type; loopscale.readouts)
    Readout("alpha_readout", "alpha readout", "alpha", "alpha",
            "s_ref^(1-α)·s^α·u, s = RMS(H), u = H/s: between a constant scale (α=0) and raw (α=1)"),
    Readout("tapernorm", "TaperNorm readout", "taper", "taper",
            "gate·RMSNorm(H) + (1-gate)·c·H·w, gate 1 -> 0 over training (cosine): ends sample-independent"),
    # the Ouro track's (Appendix B; official src/train_ouro_from_scratch_ddp.py): there the step
    # norm model.norm is also what step k+1 receives, so `exit_norm` doubles as the recurrence;
    # "rmsnorm" above is the published per-step norm
    Readout("final_raw", "final-step raw readout", "rmsnorm", None,
            "model.norm at steps k < K, the raw state at step K (the official ConditionalNorm, --no-readout-norm)",
            OTHER + 1, archs=("ouro",)),
    Readout("final_alpha", "final-step alpha readout", "rmsnorm", "alpha",
            "model.norm at steps k < K, an alpha readout at step K (the official ConditionalAlphaReadout, "
            "--alpha-readout)", OTHER + 1, archs=("ouro",)),
    Readout("per_loop_alpha", "per-loop alpha readout", "alpha", "alpha",
            "an alpha readout of its own at every step, also fed to the next step (the official "
            "PerLoopAlphaReadout, --alpha-readout --per-loop-alpha)", OTHER + 1, archs=("ouro",), per_loop=True),
)}  # (the Ouro track's readouts come after every other one in tables, among themselves by name)


def readouts_of(arch: str) -> tuple[str, ...]:
    """The readouts that apply to an architecture (`model.arch`)."""
    return tuple(n for n, r in READOUTS.items() if r.applies_to(arch))


LOSSES: dict[str, Axis] = {a.name: a for a in (
    Axis("terminal", "terminal CE", "cross-entropy of exit K only", 0),
    Axis("per_loop", "per-loop CE", "mean cross-entropy over the K exits (dense supervision)", 1),
    Axis("adaptive", "adaptive CE", "exit-gate-weighted CE Σ_k p_k·CE_k − w·H(p) (objective.entropy_weight)"),
)}

REGULARIZERS: dict[str, Axis] = {a.name: a for a in (
    Axis("none", "", "no regularizer", 0),
    Axis("norm_penalty", "norm penalty", "+ λ·mean_k mean(H_k²) (objective.penalty_weight)", 1),
    Axis("scale_anchor", "scale anchor", "+ w·(sqrt(mean_k mean(H_k²)) − target)² (objective.anchor_weight, "
                                         "anchor_target)"),
)}

RECURRENCES: dict[str, Axis] = {a.name: a for a in (
    Axis("residual", "", "H_k feeds loop k+1 as is (the paper's)", 0),
    Axis("inter_loop_norm", "inter-loop norm", "RMSNorm(H_k) feeds loop k+1: the scale leaves the loop", 1),
    Axis("spectral_damping", "spectral damping", "σ(a)·H_k feeds loop k+1, a learned scalar (σ(2) ≈ 0.88 at init)"),
)}

# ---------------------------------------------------------------------------
# architectures (loopscale.model.ARCHITECTURES holds what each one builds)
# ---------------------------------------------------------------------------
ARCHS: dict[str, Axis] = {a.name: a for a in (
    Axis("looped", "looped LM", "the paper's looped decoder (loopscale.model.LoopedLM)", 0),
    Axis("ouro", "Ouro", "ByteDance's Ouro architecture: RoPE, sandwich norms, untied head, model.norm after "
                         "every recurrent step, exit gate (loopscale.model.LoopedLM, model.arch=ouro)", 1),
)}


# losses that read the model's exit gate (the model builds one: model.exit_gate)
GATED_LOSSES = ("adaptive",)

AXES = ("readout", "loss", "regularizer", "recurrence")  # the order of a condition id
AXIS_DEFAULTS = {"regularizer": "none", "recurrence": "residual"}  # readout and loss have none


def axis_registry(axis: str) -> dict:
    """The registry of one axis of a condition."""
    return {"readout": READOUTS, "loss": LOSSES, "regularizer": REGULARIZERS, "recurrence": RECURRENCES}[axis]


def axis_values(axis: str) -> tuple[str, ...]:
    """The names an axis takes in configs and run ids."""
    return tuple(axis_registry(axis))


# ---------------------------------------------------------------------------
# diagnostics
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Diagnostic:
    name: str
    description: str  # one line (command-line help)

    @property
    def file(self) -> str:
        """Its result file, relative to the run directory."""
        return f"eval/{self.name}.json"


DIAGNOSTICS: dict[str, Diagnostic] = {d.name: d for d in (
    Diagnostic("depth", "CE/PPL per exit k<=K and per depth k<=depth_factor*K (final readout)"),
    Diagnostic("throughput", "tokens/s of evaluation at each depth"),
    Diagnostic("norms", "per-loop ||H_k|| and the per-token distribution of ||H_K||"),
    Diagnostic("radial", "radial gradient fraction cos^2(dCE_k/dH_k, H_k) per exit"),
    Diagnostic("lemma", "radial increment and angular update over eval.lemma_loops loops"),
    Diagnostic("clamp", "inference-time scale clamps (official remove_radial, freeze_loop1; "
                        "remove_radial_from_embedding)"),
    Diagnostic("halting", "calibrated post-hoc exit policies and dynamic-depth speed-up"),
    Diagnostic("scale", "CE/PPL of the final readout of alpha*H_K, alpha from 0.1 to 10 (scale sensitivity)"),
)}


# ---------------------------------------------------------------------------
# the condition
# ---------------------------------------------------------------------------
# The paper's seven Table-1 conditions in the paper's order, then loopscale's additions:
# the canonical order of tables (and of the figures' colours: loopscale.report.styles).
CANONICAL_BASES: tuple[tuple[str, str, str, str], ...] = (
    ("rmsnorm", "terminal", "none", "residual"),
    ("raw", "terminal", "none", "residual"),
    ("rmsnorm", "per_loop", "none", "residual"),  # the drifting model
    ("raw", "per_loop", "none", "residual"),
    ("final_norm", "per_loop", "none", "residual"),
    ("rmsnorm", "terminal", "norm_penalty", "residual"),
    ("rmsnorm", "per_loop", "norm_penalty", "residual"),
    ("layernorm", "per_loop", "none", "residual"),
    ("rmsnorm", "per_loop", "none", "inter_loop_norm"),
    ("layernorm", "terminal", "none", "residual"),
)


def _order(registry: dict, name: str) -> int:
    return getattr(registry.get(name), "order", OTHER + 1)


@dataclass(frozen=True, order=True)
class Condition:
    """One training condition: readout × loss × regularizer × recurrence (+ λ of the norm
    penalty, 0 for the other regularizers)."""
    readout: str
    loss: str
    regularizer: str = "none"
    recurrence: str = "residual"
    penalty_weight: float = 0.0

    @classmethod
    def of(cls, readout: str, loss: str, regularizer: str = "none", recurrence: str = "residual",
           penalty_weight: float = PAPER_PENALTY_WEIGHT) -> "Condition":
        """A condition; λ is kept only for the norm penalty (the paper's λ by default)."""
        return cls(readout, loss, regularizer, recurrence,
                   float(penalty_weight) if regularizer == "norm_penalty" else 0.0)

    @classmethod
    def from_config(cls, cfg: dict) -> "Condition":
        """The condition of a run config dict (RunConfig.to_dict()); '?' where it says nothing."""
        m, o = cfg.get("model") or {}, cfg.get("objective") or {}
        return cls.of(m.get("readout", "?"), o.get("loss", "?"), o.get("regularizer", "none"),
                      m.get("recurrence", "residual"), o.get("penalty_weight", PAPER_PENALTY_WEIGHT))

    # -- identity ------------------------------------------------------------------------
    @property
    def base(self) -> tuple:
        return (self.readout, self.loss, self.regularizer, self.recurrence)

    @property
    def id(self) -> str:
        """`<readout>-<loss>-<regularizer>-<recurrence>`: the run directory name."""
        return "-".join(self.base)

    @property
    def paper_penalty(self) -> bool:
        """No norm penalty, or the paper's λ."""
        return self.regularizer != "norm_penalty" or self.penalty_weight == PAPER_PENALTY_WEIGHT

    @property
    def slug(self) -> str:
        """The id, plus `-lambda<λ>` for a norm penalty with another λ than the paper's."""
        return self.id if self.paper_penalty else f"{self.id}-lambda{self.penalty_weight:g}"

    # -- meaning ---------------------------------------------------------------------------
    @property
    def readout_spec(self) -> Optional[Readout]:
        return READOUTS.get(self.readout)

    @property
    def scale_invariant_readout(self) -> bool:
        """Every exit of the readout is scale-invariant (r(αH) = r(H))."""
        r = self.readout_spec
        return r is not None and r.scale_invariant

    @property
    def raw_readout(self) -> bool:
        """No exit of the readout is normalised."""
        r = self.readout_spec
        return r is not None and r.raw

    @property
    def label(self) -> str:
        """The paper's wording: 'per-loop CE + RMSNorm readout', '... + norm penalty', ..."""
        if self.readout == "?" and self.loss == "?":
            return "unknown condition (no readable config)"

        def lab(registry, name):
            return getattr(registry.get(name), "label", name)
        parts = [lab(LOSSES, self.loss), lab(READOUTS, self.readout)]
        reg, rec = lab(REGULARIZERS, self.regularizer), lab(RECURRENCES, self.recurrence)
        if reg and not self.paper_penalty:
            reg += f" (λ={self.penalty_weight:g})"
        return " + ".join(parts + [p for p in (reg, rec) if p])

    # -- order ---------------------------------------------------------------------
    def sort_key(self) -> tuple:
        """Canonical conditions first, in the paper's order; then by loss, readout,
        regularizer and recurrence order."""
        if self.base in CANONICAL_BASES:
            return (0, CANONICAL_BASES.index(self.base), self.penalty_weight)
        return (1, _order(LOSSES, self.loss), _order(READOUTS, self.readout), _order(REGULARIZERS, self.regularizer),
                _order(RECURRENCES, self.recurrence), self.penalty_weight, self.base)


def condition(readout: str, loss: str, regularizer: str = "none", recurrence: str = "residual",
              penalty_weight: float = PAPER_PENALTY_WEIGHT) -> Condition:
    """`Condition.of`: a condition, λ kept only for the norm penalty."""
    return Condition.of(readout, loss, regularizer, recurrence, penalty_weight)


def all_bases() -> list[tuple]:
    """Every point of the full grid, in report order (loss, readout, regularizer, recurrence),
    one architecture's grid after the other's (a readout of several is in the first one's)."""
    rd, ls, rg, rc = (sorted(axis_registry(a).values(), key=lambda e: e.order) for a in AXES)
    out = []
    for i, arch in enumerate(ARCHS):
        own = [r for r in rd if r.applies_to(arch) and not any(map(r.applies_to, list(ARCHS)[:i]))]
        out += [(r.name, l.name, g.name, c.name) for l, r, g, c in itertools.product(ls, own, rg, rc)]
    return out
