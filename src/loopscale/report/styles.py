"""How a condition looks in figures: its colour, line style and marker.

Colour tells the registered conditions apart (one palette colour each, in the canonical order of
`loopscale.registry.CANONICAL_BASES`; the other conditions cycle through the colours after
them), and the readout's line style and marker tell RMSNorm from LayerNorm lines even without
colour. The registry says what a condition is; this module only how it is drawn, so a new
readout needs no style (it gets `DEFAULT_STYLE`) unless you give it one in `READOUT_STYLE`.
"""
from __future__ import annotations

from typing import Union

from ..registry import CANONICAL_BASES, READOUTS, Condition, all_bases

_OKABE_ITO = {"black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
              "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7",
              "grey": "#999999"}
# Paul Tol's colour-blind-safe "muted" colours that no Okabe–Ito colour is close to
_TOL_MUTED = {"olive": "#999933", "wine": "#882255", "indigo": "#332288", "teal": "#44AA99", "sand": "#DDCC77"}
# the colours of the registered conditions, in CANONICAL_BASES' order (one each, no two alike:
# tests/test_registry.py checks their CIELAB distances), then those the other conditions cycle through
PALETTE = tuple({**_OKABE_ITO, **_TOL_MUTED}[c] for c in (
    "black", "grey", "vermillion", "blue", "bluish_green", "yellow", "reddish_purple", "olive", "sky_blue", "wine",
    "orange", "indigo", "teal", "sand"))
assert len(CANONICAL_BASES) <= len(PALETTE)

LineStyle = Union[str, tuple]
# (matplotlib line style, marker) of a readout's conditions
READOUT_STYLE: dict[str, tuple[LineStyle, str]] = {
    "rmsnorm": ("-", "o"),
    "raw": ("--", "s"),
    "final_norm": ((0, (3, 1, 1, 1, 1, 1)), "^"),
    "layernorm": ("-.", "D"),
    "alpha_readout": ((0, (1, 1)), "v"),
    "tapernorm": ((0, (5, 2)), "P"),
    "final_raw": (":", "x"),  # the Ouro track's readouts: told apart by colour
    "final_alpha": (":", "x"),
    "per_loop_alpha": (":", "x"),
}
DEFAULT_STYLE: tuple[LineStyle, str] = ("-", "x")  # a registered readout without a style of its own
UNKNOWN_STYLE: tuple[LineStyle, str] = (":", "x")  # a readout the registry does not know (an old run's)


def colour(cond: Condition) -> str:
    if cond.base in CANONICAL_BASES and cond.paper_penalty:
        return PALETTE[CANONICAL_BASES.index(cond.base)]
    # the other conditions: the palette's colours after the canonical ones, cycled
    others = [b for b in all_bases() if b not in CANONICAL_BASES]
    i = others.index(cond.base) if cond.base in others else len(others)
    i += 0 if cond.paper_penalty else int(round(cond.penalty_weight * 1000))
    return PALETTE[(len(CANONICAL_BASES) + i) % len(PALETTE)]


def readout_style(readout: str) -> tuple[LineStyle, str]:
    if readout not in READOUTS:
        return UNKNOWN_STYLE
    return READOUT_STYLE.get(readout, DEFAULT_STYLE)


def linestyle(cond: Condition) -> LineStyle:
    return readout_style(cond.readout)[0]


def marker(cond: Condition) -> str:
    return readout_style(cond.readout)[1]
