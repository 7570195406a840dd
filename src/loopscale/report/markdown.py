"""Number formatting and Markdown tables (no third-party table library; deterministic)."""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from .runs import finite

EMPTY = "—"
# columns holding text are left-aligned, numbers right-aligned
LEFT = {"Size", "Condition", "Runs", "Status", "Policy/granularity", "Clamp", "Run directory", "Diagnostics",
        "Claim", "Verdict", "Rule", "Paper", "Ours", "Ours (seed means)", "Per seed", "Item", "Value", "Setting", "Figure", "Table", "Condition (size)"}


def _decimals(x: float) -> Optional[int]:
    """Decimals used for x in `auto` format; None means scientific notation."""
    a = abs(x)
    if a == 0:
        return 0
    if a >= 1e6 or a < 1e-3:
        return None
    if a >= 1000:
        return 0
    if a >= 100:
        return 1
    if a >= 1:
        return 2
    return 3


def num(x, kind: str = "auto", decimals: Optional[int] = -1) -> str:
    """One number for a table cell. kinds: auto, sci (radial fractions), int, ratio, pct.
    `decimals` forces the fixed-point decimals of `auto` (None: scientific)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return EMPTY
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if kind == "int":
        return f"{int(round(x)):,}"
    if kind == "sci":
        return "0" if x == 0 else f"{x:.1e}"
    if kind == "pct":
        return f"{100 * x:.1f}%"
    if kind == "spct":
        return f"{100 * x:+.1f}%"
    if kind == "ratio":
        return f"{x:.2f}×" if abs(x) < 1000 else f"{x:.2e}×"
    if x == 0:
        return "0"
    dec = _decimals(x) if decimals == -1 else decimals
    if dec is None:
        return f"{x:.2e}"
    return f"{x:,.{dec}f}"


def pm(mean, std, n: Optional[int] = None, kind: str = "auto", n_row: Optional[int] = None) -> str:
    """'mean ± std' (std over seeds, ddof=1); '(n=…)' appended when it differs from the row's n."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return EMPTY
    s = num(mean, kind)
    if finite(std) and (n is None or n > 1):
        sd = num(std, kind, _decimals(mean) if kind == "auto" else -1)
        if std != 0 and sd.strip("0.,") == "":  # rounds to zero at the mean's precision
            sd = f"{std:.1e}"
        s += f" ± {sd}"
    if n is not None and n_row is not None and n != n_row:
        s += f" (n={n})"
    return s


def md_escape(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence], align: Optional[Sequence[str]] = None) -> str:
    """A GitHub Markdown table; `align` holds 'l' or 'r' per column (default: first two left)."""
    header = [md_escape(h) for h in header]
    rows = [[md_escape(c) for c in r] for r in rows]
    if align is None:
        align = ["l" if h in LEFT else "r" for h in header]
    sep = [":---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
