"""Every figure the README (and the docs pages that quote results) states comes from a
committed result file.

How a page declares where its figures come from: a paragraph, list or table that states a
number starts with an HTML comment naming its sources (invisible when rendered),

    <!-- figures: results/cpu/claims.csv results/drift_law/drift_law.md paper -->

Sources are files under results/ or benchmarks/ (CSV, JSON, Markdown: read as text), part of
a CSV file (`results/cpu/claims.csv:ours#id=a,b`: the `ours` column of the rows whose `id` is
a or b; either part may be left out), and `paper` for the paper's own values (src/loopscale/report/paper.py and the `paper` column of
the committed claims.csv files). Every number of the block must then be one of its sources'
numbers at the precision the page quotes it: "382" matches 382.1, "0.74" matches 0.743,
"14,300" matches 14,327 (trailing zeros of an integer may be rounding), "1.8e-2" matches
1.8e-02, "1.3M" matches 1,330,000, "7.1%" matches 7.1 or 0.071; a signed figure ("−7.1%",
"+0.0%") must have the source's sign. Formatting is normalised (1,500 == 1500; k/M/B
suffixes; the minus sign U+2212).

What is not a result, and so needs no source:
  * code: fenced blocks, `inline code`, link targets, HTML comments;
  * the parts of the paper cited by number (Table 1, Tables 1 and 5, Appendix B, Lemma 2,
    Section 3, §3), its arXiv id, git commit ids, exit ranges written k = 2..4;
  * numbers a block lists after "not results:" in its declaration, each with its reason:
        <!-- figures: results/cpu/claims.csv; not results: 2 (cores of the machine) -->
A block with a number and no declaration fails, as does a number its sources do not hold.

The check is per file, not per cell: a small integer (3 seeds) is found in almost any source.
The claims table and the verdict counts have their own exact tests (tests/test_readme.py).
"""
from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# every block of these must declare its figures' sources; in other docs/*.md pages only the
# blocks that carry a declaration are checked (so moved result prose stays checked)
CHECKED = ("README.md", "docs/results.md")
PAPER = "paper"
PAPER_FILES = ("src/loopscale/report/paper.py",)
CLAIMS = ("results/cpu/claims.csv", "results/cpu_confirm/claims.csv", "results/cpu_long/claims.csv")

DECL = re.compile(r"<!--\s*figures:(.*?)-->", re.S)
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
URL = re.compile(r"https?://\S+")
NOT_RESULTS = [  # the parts of the paper, ids and indices (see the module docstring)
    re.compile(r"\b(?:Tables?|Figures?|Fig\.|Appendix|Appendices|Sections?|§|Lemma|Theorem|Eq\.|Equation)"
               r"[\s-]*\d+(?:\s*(?:,|and|–|-)\s*\d+)*"),
    re.compile(r"\barXiv:?\s*\d{4}\.\d{4,5}"),
    re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),  # git commits
    re.compile(r"\bk\s*=\s*\d+\s*\.\.\s*\w+"),  # exit ranges: k = 2..4, k = 1..K
]
MINUS = "−-"
NUM = re.compile(r"(?<![\w.])(?P<sign>[−+-]?)(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?"
                 r"(?:e(?P<exp>[−+-]?\d+))?(?P<suffix>[kMB])?(?P<pct>%)?(?![\w])")
NUM_PLAIN = re.compile(r"(?<![\w.])(?P<sign>[−+-]?)(?P<int>\d+)(?P<frac>\.\d+)?"
                       r"(?:e(?P<exp>[−+-]?\d+))?(?P<suffix>[kMB])?(?![\w])")
SCALE = {None: 1, "k": 10**3, "M": 10**6, "B": 10**9}


@dataclass(frozen=True)
class Figure:
    text: str  # as quoted
    value: Decimal  # signed
    signed: bool  # the page wrote a sign
    units: tuple[Decimal, ...]  # the rounding units it may have been quoted at
    percent: bool
    start: int = 0  # where it stands in the text checked
    end: int = 0


def _parse(m: re.Match) -> tuple[Decimal, bool, Decimal, int]:
    sign, intpart, frac = m.group("sign"), m.group("int").replace(",", ""), m.group("frac") or ""
    exp = int((m.group("exp") or "0").replace("−", "-"))
    scale = SCALE[m.group("suffix")]
    mant = Decimal(intpart + frac)
    value = mant * Decimal(10) ** exp * scale
    if sign in MINUS:
        value = -value if sign else value
    unit = Decimal(1).scaleb(-len(frac[1:]) if frac else 0) * Decimal(10) ** exp * scale
    zeros = 0 if frac else len(intpart) - len(intpart.rstrip("0"))
    if intpart.strip("0") == "":
        zeros = 0
    return value, bool(sign), unit, zeros


def figures(text: str) -> list[Figure]:
    """The numbers of a stretch of prose (code, comments, links and non-results removed)."""
    out = []
    for m in NUM.finditer(strip(text)):
        value, signed, unit, zeros = _parse(m)
        units = tuple(unit * 10**z for z in range(zeros + 1))
        out.append(Figure(m.group(0), value, signed, units, bool(m.group("pct")), m.start(), m.end()))
    return out


def strip(text: str) -> str:
    """The text with what is not a result blanked out (same length: positions stay)."""
    for pat in (COMMENT, INLINE_CODE, LINK_TARGET, URL, *NOT_RESULTS):
        text = pat.sub(lambda m: re.sub(r"\S", " ", m.group(0)), text)
    return text


def numbers_of_text(text: str) -> set[Decimal]:
    """Every number a source file holds, read both with and without thousands separators
    (a CSV row "42,101" is two numbers; Markdown's "1,500" is one)."""
    text = re.sub(r"(?<=\d)_(?=\d)", "", text)  # Python literals: 103_227_021
    vals = set()
    for pat in (NUM, NUM_PLAIN):
        for m in pat.finditer(text):
            try:
                vals.add(_parse(m)[0])
            except (ValueError, ArithmeticError):
                continue
    return vals


SPEC = re.compile(r"(?P<path>[^:#\s]+)(?::(?P<cols>[\w,]+))?(?:#(?P<key>\w+)=(?P<vals>[\w,-]+))?$")  # ids: e2, c-acc


@lru_cache(maxsize=None)
def source_numbers(src: str) -> frozenset[Decimal]:
    """The numbers of one source: `paper`, a file, or part of a CSV file:
    FILE.csv:COL,COL (those columns) and/or FILE.csv#KEY=V,V (the rows whose KEY is one of V)."""
    if src == PAPER:
        text = "\n".join((REPO / f).read_text() for f in PAPER_FILES)
        for f in CLAIMS:
            text += "\n".join(r["paper"] for r in csv.DictReader(io.StringIO((REPO / f).read_text())))
        return frozenset(numbers_of_text(text))
    m = SPEC.match(src)
    path = REPO / m.group("path") if m else None
    if not (m and m.group("path").startswith(("results/", "benchmarks/")) and path.is_file()):
        raise ValueError(f"figure source {src!r} is not a committed file under results/ or benchmarks/")
    text = path.read_text()
    if m.group("cols") or m.group("key"):
        if path.suffix != ".csv":
            raise ValueError(f"figure source {src!r}: columns and rows select from a CSV file only")
        rows = list(csv.DictReader(io.StringIO(text)))
        cols = m.group("cols").split(",") if m.group("cols") else list(rows[0]) if rows else []
        key, vals = m.group("key"), (m.group("vals") or "").split(",")
        for c in cols + ([key] if key else []):
            if rows and c not in rows[0]:
                raise ValueError(f"figure source {src!r}: {path.name} has no column {c!r}")
        rows = [r for r in rows if not key or r[key] in vals]
        if not rows:
            raise ValueError(f"figure source {src!r}: no row selected")
        text = "\n".join(" ".join(r[c] for c in cols) for r in rows)
    return frozenset(numbers_of_text(text))


def _rounds_to(s: Decimal, q: Decimal, unit: Decimal) -> bool:
    return any((s / unit).quantize(Decimal(1), rounding=r) * unit == q for r in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def found(fig: Figure, pool: frozenset[Decimal]) -> bool:
    q = fig.value if fig.signed else abs(fig.value)
    for s in pool:
        cands = [s, s * 100] if fig.percent else [s]
        for c in cands:
            c = c if fig.signed else abs(c)
            if fig.signed and fig.value == 0 and c != 0 and not math.isclose(float(c), 0, abs_tol=float(fig.units[0])):
                continue
            if any(_rounds_to(c, q, u) for u in fig.units):
                return True
    return False


@dataclass
class Block:
    path: str
    line: int
    text: str
    sources: tuple[str, ...] | None  # None: no declaration
    exempt: dict[str, str]  # number as written -> reason


def parse_declaration(body: str) -> tuple[tuple[str, ...], dict[str, str]]:
    srcs, _, rest = body.partition(";")
    exempt = {}
    if rest.strip():
        head, _, items = rest.partition(":")
        if head.strip() != "not results":
            raise ValueError(f"unknown declaration part {rest.strip()!r}: only 'not results: N (reason) ...'")
        pairs = re.findall(r"(\S+)\s*\(([^)]+)\)", items)
        if not pairs or re.sub(r"\S+\s*\([^)]+\)", "", items).strip():
            raise ValueError(f"'not results:' needs 'NUMBER (reason)' pairs, got {items.strip()!r}")
        exempt = {n: why for n, why in pairs}
    return tuple(srcs.split()), exempt


def blocks(path: str, text: str | None = None) -> list[Block]:
    """Paragraphs, lists and tables of a Markdown page (fenced code blanked out), each with
    the declaration at its start, if any."""
    text = (REPO / path).read_text() if text is None else text
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out, cur, start = [], [], 0
    for i, line in enumerate(text.split("\n") + [""], 1):
        if line.strip():
            if not cur:
                start = i
            cur.append(line)
        elif cur:
            body = "\n".join(cur)
            decl = DECL.search(body)
            srcs, exempt = parse_declaration(decl.group(1)) if decl else (None, {})
            out.append(Block(path, start, body, srcs, exempt))
            cur = []
    return out


def problems(block: Block, required: bool) -> list[str]:
    """What is wrong with one block's figures (empty: nothing)."""
    figs = [f for f in figures(block.text) if f.text.lstrip("+−-") not in block.exempt and f.text not in block.exempt]
    where = f"{block.path}:{block.line}"
    if block.sources is None:
        if required and figs:
            return [f"{where}: states {', '.join(f.text for f in figs)} but declares no source "
                    f"(<!-- figures: FILE ... --> before it)"]
        return []
    try:
        pool = frozenset().union(*(source_numbers(s) for s in block.sources)) if block.sources else frozenset()
    except ValueError as e:
        return [f"{where}: {e}"]
    return [f"{where}: {f.text!r} is in none of {' '.join(block.sources)}" for f in figs if not found(f, pool)]


def check(path: str, text: str | None = None) -> list[str]:
    required = path in CHECKED
    return [p for b in blocks(path, text) for p in problems(b, required)]


def pages() -> list[str]:
    return [*CHECKED, *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")
                              if f"docs/{p.name}" not in CHECKED and DECL.search(p.read_text()))]
